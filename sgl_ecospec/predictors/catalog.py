"""The online predictors by name, as commands and settings choose them (``--predictor``).

- ``online``: :class:`OnlineExpertPredictor`, float counts per token in 4,096 hashed rows;
- ``vocab``: :class:`ContextExpertPredictor` with every token its own row (compact counts);
- ``context``: ``vocab`` plus the (parent token, token) pair table, backing off to the token;
- ``adjacent``: :class:`AdjacentExpertPredictor`, ``context`` whose cached experts lean
  towards each row's latest routing and whose unseen tokens take their parent's experts.
"""

import torch

from sgl_ecospec.predictors.adjacent import AdjacentExpertPredictor
from sgl_ecospec.predictors.base import ExpertPredictor
from sgl_ecospec.predictors.context import ContextExpertPredictor
from sgl_ecospec.predictors.online import OnlineExpertPredictor

ONLINE_PREDICTORS = ("online", "vocab", "context", "adjacent")
# Pair slots of ``context`` and ``adjacent``: chosen by the recall-vs-memory measurement
# (docs/predictor.md).
DEFAULT_PAIR_BUCKETS = 16384


def make_predictor(
    name: str,
    num_layers: int,
    num_experts: int,
    top_k: int,
    *,
    vocab_size: int | None = None,
    device: str | torch.device = "cpu",
) -> ExpertPredictor:
    """A fresh (cold) online predictor of kind ``name`` (:data:`ONLINE_PREDICTORS`).

    Args:
        name: the kind.
        num_layers, num_experts, top_k: the target's L, E and K.
        vocab_size: the target's vocabulary size; required by all but ``online``.
        device: where the tables live.
    """
    shape = (num_layers, num_experts, top_k)
    if name == "online":
        return OnlineExpertPredictor(*shape, device=device)
    if name not in ONLINE_PREDICTORS:
        raise ValueError(
            f"unknown online predictor {name!r}; valid: {', '.join(ONLINE_PREDICTORS)}"
        )
    if vocab_size is None:
        raise ValueError(f"predictor {name!r} gives every token its own row: pass vocab_size")
    if name == "vocab":
        return ContextExpertPredictor(*shape, vocab_size=vocab_size, device=device)
    kind = AdjacentExpertPredictor if name == "adjacent" else ContextExpertPredictor
    return kind(*shape, vocab_size=vocab_size, pair_buckets=DEFAULT_PAIR_BUCKETS, device=device)
