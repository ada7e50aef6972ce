"""An expert predictor's live recall, measured on device from the verify routing, and the
per-layer trust that verify-set selection derives from it.

Shape legend: T = verified rows, L = MoE layers, K = experts per token, E = experts per layer.
"""

import torch

from sgl_ecospec.ops.bitmaps import bitmap_popcount, topk_to_bitmap
from sgl_ecospec.ops.checks import check_int


class LiveRecall:
    """Per-layer top-K recall of a predictor on the rows the target verified: an exponential
    moving average over verify steps (what selection trusts now) and cumulative totals (what
    a benchmark reports). :meth:`update` runs a fixed number of kernels and no host sync.

    Trust. With K predicted and K true experts per layer, a predicted expert is truly used
    with probability r_l (the layer's recall) and an unpredicted one with (1 - r_l) K / (E - K).
    A candidate's expected number of truly new experts in layer l is then
    ``w_l * predicted_new_l + (1 - r_l) K free_l / (E - K)`` with
    ``w_l = (r_l - K/E) / (1 - K/E)`` (0 at chance, 1 for a perfect predictor) and ``free_l``
    the experts not yet in the buffer. :meth:`layer_weights` gives ``w_l``;
    :meth:`unpredicted_cost` the second term summed over layers with ``free_l = E - K``
    (a buffer holding one token's experts), a cost every candidate pays alike. The recall
    starts at chance, so a cold predictor is trusted with nothing.

    Args:
        num_layers: L.
        num_experts: E.
        top_k: K.
        rate: weight in (0, 1] of each verify step's recall in the moving average.
        device: where the statistics live.
    """

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        *,
        rate: float = 0.05,
        device: str | torch.device = "cpu",
    ):
        check_int("num_layers", num_layers, minimum=1)
        self.num_experts = check_int("num_experts", num_experts, minimum=1)
        self.top_k = check_int("top_k", top_k, minimum=1)
        if not 0 < rate <= 1:
            raise ValueError(f"rate must be in (0, 1], got {rate}")
        self.rate = float(rate)
        self.chance = top_k / num_experts
        self.ema = torch.full((num_layers,), self.chance, dtype=torch.float32, device=device)
        self.hits = torch.zeros(num_layers, dtype=torch.float64, device=device)  # [L]
        self.rows = torch.zeros((), dtype=torch.float64, device=device)

    @classmethod
    def of(cls, predictor, device: str | torch.device = "cpu", **kwargs) -> "LiveRecall":
        """``predictor.live_recall``, attached first (a fresh one on ``device``) if missing."""
        if predictor.live_recall is None:
            predictor.live_recall = cls(
                predictor.num_layers,
                predictor.num_experts,
                predictor.top_k,
                device=device,
                **kwargs,
            )
        return predictor.live_recall

    def update(
        self,
        predicted: torch.Tensor,
        true: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> None:
        """Adds one verify step.

        Args:
            predicted: int ``[T, L, K]``: the experts predicted for the verified rows.
            true: int ``[T, L, K']``: the experts the target routed them to.
            valid: bool ``[T]`` or None (all): rows that count (e.g. not padding).
        """
        device = self.ema.device
        pred = topk_to_bitmap(predicted.to(device), self.num_experts, validate=False)
        real = topk_to_bitmap(true.to(device), self.num_experts, validate=False)
        found = bitmap_popcount(pred & real).float()  # [T, L]
        per_row = found / bitmap_popcount(real).float().clamp_min(1.0)
        weight = torch.ones(per_row.shape[0], device=device)
        if valid is not None:
            weight = valid.to(device, torch.float32)
        count = weight.sum()
        summed = (per_row * weight[:, None]).sum(0)  # [L]
        step_recall = summed / count.clamp_min(1.0)
        self.ema += (self.rate * (count > 0)) * (step_recall - self.ema)
        self.hits += summed.double()
        self.rows += count.double()

    def layer_weights(self, base: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[L]``: each layer's trust ``w_l`` in [0, 1] (times ``base`` ``[L]``, the
        configured layer weights, when given): DeltaCost's per-layer weights."""
        trust = (self.ema - self.chance) / max(1.0 - self.chance, 1e-12)
        trust = trust.clamp(0.0, 1.0)
        return trust if base is None else trust * base.to(trust)

    def unpredicted_cost(self, base: torch.Tensor | None = None) -> torch.Tensor:
        """float32 scalar tensor: the expected new experts a candidate brings that the
        predictor did not predict, ``sum_l base_l (1 - r_l) K`` (``base`` ``[L]`` or ones),
        in expert loads like DeltaCost; every candidate pays it alike, so it acts as eps."""
        missed = (1.0 - self.ema.clamp_min(self.chance)) * self.top_k  # [L]
        return (missed if base is None else missed * base.to(missed)).sum()

    def recall(self) -> float | None:
        """Cumulative recall over every row seen, all layers (a host sync), or None."""
        rows = float(self.rows)
        return float(self.hits.sum()) / (rows * self.hits.shape[0]) if rows else None

    def per_layer(self) -> list[float] | None:
        """Cumulative recall per layer over every row seen (a host sync), or None."""
        rows = float(self.rows)
        return (self.hits / rows).tolist() if rows else None
