"""The adjacent-token predictor: the context count tables, with each row's cached experts
leaning towards its latest routing, and a token never seen predicted by its parent's experts
(adjacent tokens share experts); learnt online from the verified routing, needs no training.

Shape legend: as :mod:`sgl_ecospec.predictors.base`.
"""

import torch

from sgl_ecospec.predictors.context import ContextExpertPredictor, _check_weight
from sgl_ecospec.predictors.state import ADJACENT_FORMAT


class AdjacentExpertPredictor(ContextExpertPredictor):
    """:class:`ContextExpertPredictor` plus two signals of adjacency in the token stream.

    - Recency: a token or pair row caches the top-K of ``dist + recent_weight * latest``,
      ``dist`` its smoothed distribution (sums to K per layer, so with a few observations
      its experts score near 1) and ``latest`` the multi-hot of the routing it was given
      last. Routing drifts with the context, so the latest occurrence says more about the
      next one than an old one; with ``recent_weight`` below 1 the latest routing breaks
      near-ties of the counts but does not outvote a habit.
    - The parent: routing of adjacent tokens overlaps well above chance (on the testbed a
      verified row shares 0.28 of its experts with its parent's routing, chance 0.125), so a
      row whose token was never seen takes its parent token's cached experts instead of the
      global top-K (which recalls about 0.2 there); the global top-K remains for an unseen
      token whose parent is unknown or unseen too.

    Both live in the tables the context predictor already keeps (the cached top-K): the
    memory is the same, and a prediction only picks which token row to gather (index
    arithmetic on ``[T]``).

    Args:
        num_layers, num_experts, top_k: L, E, K.
        recent_weight: weight of the latest routing in a row's cached scores (> 0).
        **context: the :class:`ContextExpertPredictor` arguments (``vocab_size``,
            ``token_buckets``, ``pair_buckets``, ``pair_weight``, ``prior_weight``,
            ``count_dtype``, ``device``).
    """

    STATE_FORMAT = ADJACENT_FORMAT

    def __init__(
        self, num_layers: int, num_experts: int, top_k: int, *, recent_weight=0.5, **context
    ):
        super().__init__(num_layers, num_experts, top_k, **context)
        self.recent_weight = _check_weight("recent_weight", recent_weight)

    def config(self) -> dict:
        """The constructor arguments that fix the table layout and learning rule."""
        return {**super().config(), "recent_weight": self.recent_weight}

    def _lookup_rows(self, rows: torch.Tensor, context_tokens: torch.Tensor | None):
        """int64 ``[T]``: a row whose token (``rows`` int64 ``[T]``) was never seen reads its
        parent's row where the parent (``context_tokens`` int ``[T]``, -1 where unknown) was
        seen; every other row reads its own (and with neither seen, the global top-K). Index
        arithmetic on ``[T]`` only, so the prediction gathers the cache once as before."""
        if context_tokens is None:
            return rows
        parent = context_tokens.to(self.device, torch.int64)
        parent_rows = self.token_rows(parent.clamp_min(0))
        lend = ~self.token_seen[rows] & (parent >= 0) & self.token_seen[parent_rows]
        return torch.where(lend, parent_rows, rows)

    def _cached_topk(self, dist: torch.Tensor, latest: torch.Tensor) -> torch.Tensor:
        """Top-K of ``dist + recent_weight * latest`` (both float32 ``[T, L, E]``, as
        :meth:`ContextExpertPredictor._cached_topk`)."""
        return self._topk(dist + self.recent_weight * latest)
