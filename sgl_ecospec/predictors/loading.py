"""Loading a saved predictor of any kind."""

import os

import torch

from sgl_ecospec.predictors.adjacent import AdjacentExpertPredictor
from sgl_ecospec.predictors.base import ExpertPredictor
from sgl_ecospec.predictors.context import ContextExpertPredictor
from sgl_ecospec.predictors.head import LowRankExpertHead
from sgl_ecospec.predictors.online import OnlineExpertPredictor
from sgl_ecospec.predictors.state import (
    ADJACENT_FORMAT,
    CONTEXT_FORMAT,
    HEAD_FORMAT,
    state_source,
    torch_load,
)


def load_predictor(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    num_layers: int | None = None,
    num_experts: int | None = None,
    top_k: int | None = None,
    hidden_size: int | None = None,
) -> ExpertPredictor:
    """A predictor saved by :meth:`OnlineExpertPredictor.save`,
    :meth:`ContextExpertPredictor.save`, :meth:`AdjacentExpertPredictor.save` or
    :meth:`LowRankExpertHead.save` (a head loads frozen), whichever the file holds.

    Args: as the ``load`` methods; ``hidden_size`` is checked for a head only.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is of no known kind or does not fit the model.
    """
    state, source = torch_load(path), state_source(path)
    shape = {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k}
    if isinstance(state, dict) and state.get("format") == HEAD_FORMAT:
        return LowRankExpertHead._from_state(
            state, source, device=device, lr=0.0, hidden_size=hidden_size, **shape
        )
    if isinstance(state, dict) and state.get("format") == CONTEXT_FORMAT:
        return ContextExpertPredictor._from_state(state, source, device=device, **shape)
    if isinstance(state, dict) and state.get("format") == ADJACENT_FORMAT:
        return AdjacentExpertPredictor._from_state(state, source, device=device, **shape)
    return OnlineExpertPredictor._from_state(state, source, device=device, **shape)
