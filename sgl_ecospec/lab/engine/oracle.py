"""The oracle expert predictor: the target's true routing of each candidate (analysis only).

The engine runs the target once over the whole candidate tree before selection (every
candidate sees the prefix and its ancestors, exactly as it would in the verify pass), then
:meth:`OracleExpertPredictor.prime` stores that routing; :meth:`predict_topk` returns it for
the same token rows. It bounds what any predictor could achieve, at the price of an extra
target forward per step.

Shape legend: T = tokens, L = MoE layers, K = experts per token.
"""

import torch

from sgl_ecospec.predictors import ExpertPredictor


class OracleExpertPredictor(ExpertPredictor):
    """Replays the routing it was primed with; learns nothing."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        super().__init__(num_layers, num_experts, top_k)
        self._tokens: torch.Tensor | None = None
        self._routing: torch.Tensor | None = None

    def prime(self, token_ids: torch.Tensor, topk_ids: torch.Tensor) -> None:
        """Stores the true routing ``[T, L, K]`` of the token rows ``[T]`` to be predicted."""
        num_tokens = self._check_token_ids(token_ids, validate=False)
        self._check_topk_ids(topk_ids, num_tokens, validate=False)
        self._tokens, self._routing = token_ids, topk_ids.long()

    def predict_topk(self, token_ids, hidden=None, *, validate=False) -> torch.Tensor:
        """The primed routing ``[T, L, K]``; ``token_ids`` ``[T]`` must be the primed rows."""
        if self._tokens is None or not torch.equal(token_ids, self._tokens):
            raise ValueError(
                "the oracle predicts only the token rows it was primed with: call prime() "
                "with the candidates' true routing first"
            )
        return self._routing

    def observe(self, token_ids, topk_ids, hidden=None, *, validate=True) -> None:
        """Nothing to learn: the oracle already knows the routing."""
