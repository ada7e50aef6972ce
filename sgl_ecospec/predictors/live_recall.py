"""An expert predictor's live recall, measured on device from the verify routing, and the
per-layer trust that verify-set selection derives from it.

Shape legend: T = verified rows, L = MoE layers, K = experts per token, E = experts per layer.
"""

import torch

from sgl_ecospec.ops.bitmaps import bitmap_popcount, topk_to_bitmap
from sgl_ecospec.ops.checks import check_int
from sgl_ecospec.ops.selection import SelectionOptions


class LiveRecall:
    """Per-layer top-K recall of a predictor on the rows the target verified: an exponential
    moving average over verify steps (what selection trusts now) and cumulative totals (what
    a benchmark reports). :meth:`update` runs a fixed number of kernels and no host sync.

    Trust. With K predicted and K true experts per layer, a predicted expert is truly used
    with probability r_l (the layer's recall). A candidate's expected number of truly new
    experts in layer l is ``w_l * predicted_new_l + m_l free_l`` with
    ``w_l = (r_l - K/E) / (1 - K/E)`` (0 at chance, 1 for a perfect predictor), ``free_l``
    the experts not yet in the buffer and m_l the rate at which a free expert is one the
    candidate truly uses but the predictor missed. Under uniform routing
    m_l = (1 - r_l) K / (E - K); real routing favours popular experts, which a buffer holds
    first, so m_l is measured (:meth:`update_missed`, on the verified candidates against
    the buffer their selection started from), starting at chance, K / E.
    :meth:`layer_weights` gives ``w_l``; :meth:`unpredicted_cost` the second term summed
    over layers, a cost every candidate pays alike, with ``free_l`` the free experts of the
    step's buffer when selection starts (:meth:`buffer_free`) or ``E - K`` (a buffer holding
    one token's experts). :meth:`weigh` applies both to a step's selection. The recall
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
        # m_l: missed new experts per free expert of a candidate's starting buffer [L]
        self.missed_rate = torch.full_like(self.ema, self.chance)
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

    def unpredicted_cost(
        self, base: torch.Tensor | None = None, free: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 scalar tensor: the expected new experts a candidate brings that the
        predictor did not predict, ``sum_l base_l m_l free_l``, in expert loads like
        DeltaCost; every candidate pays it alike, so it acts as eps.

        Args:
            base: float ``[L]`` or None (ones): the configured layer weights.
            free: float ``[L]`` or None (``E - K``): experts not yet in the buffer
                (:meth:`buffer_free`).
        """
        if free is None:
            free = torch.full_like(self.missed_rate, float(self.num_experts - self.top_k))
        missed = self.missed_rate * free.to(self.missed_rate)  # [L]
        return (missed if base is None else missed * base.to(missed)).sum()

    def update_missed(
        self,
        predicted: torch.Tensor,
        true: torch.Tensor,
        buffer: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> None:
        """Adds one verify step's candidates to the missed rate m_l: per layer, the true
        experts neither predicted nor in the buffer, over the experts free in the buffer
        (ratio of the step's sums). No host sync.

        Args:
            predicted: int ``[T, L, K]``: the experts predicted for the verified candidates.
            true: int ``[T, L, K']``: the experts the target routed them to.
            buffer: int64 ``[T, L, W]``: the buffer each row's selection started from
                (:meth:`start_buffer` of its request).
            valid: bool ``[T]`` or None (all): rows that count (candidates, not roots,
                copies or uncaptured rows).
        """
        device = self.missed_rate.device
        pred = topk_to_bitmap(predicted.to(device), self.num_experts, validate=False)
        real = topk_to_bitmap(true.to(device), self.num_experts, validate=False)
        held = buffer.to(device)
        novel = bitmap_popcount(real & ~(pred | held)).float()  # [T, L]
        free = self.num_experts - bitmap_popcount(held).float()  # [T, L]
        weight = torch.ones(novel.shape[0], device=device)
        if valid is not None:
            weight = valid.to(device, torch.float32)
        summed_free = (free * weight[:, None]).sum(0)  # [L]
        step_rate = (novel * weight[:, None]).sum(0) / summed_free.clamp_min(1.0)
        counted = (summed_free > 0).float()
        self.missed_rate += (self.rate * counted) * (step_rate - self.missed_rate)

    @staticmethod
    def start_buffer(root_experts: torch.Tensor, share_buffer: bool) -> torch.Tensor:
        """int64 ``[B, L, W]``: the buffer each request's selection starts from: the union of
        every root's experts ``root_experts`` int64 ``[B, L, W]`` with ``share_buffer`` (one
        buffer for the batch), else its own root's."""
        if not share_buffer:
            return root_experts
        bits = torch.arange(64, device=root_experts.device)
        present = ((root_experts[..., None] >> bits) & 1).amax(0)  # [L, W, 64]
        # Distinct powers of two: the int64 sum wraps into bit 63 exactly as an OR would.
        union = (present << bits).sum(-1)  # [L, W]
        return union.expand_as(root_experts)

    def buffer_free(
        self,
        root_experts: torch.Tensor,
        valid: torch.Tensor | None = None,
        *,
        share_buffer: bool = True,
    ) -> torch.Tensor:
        """float32 ``[L]``: experts per layer not in the step's expert buffer when selection
        starts: outside the union of the roots' (``share_buffer``, one buffer for the batch)
        or, per request, outside its root's, averaged over the valid requests.

        Args:
            root_experts: int64 ``[B, L, W]``: the roots' predicted expert bitmaps (empty
                for requests that do not count).
            valid: bool ``[B]`` or None (all): requests that count (per-request buffers).
        """
        device = self.ema.device
        roots = root_experts.to(device)
        if share_buffer:
            held = bitmap_popcount(self.start_buffer(roots, True)[0]).float()  # [L]
        else:
            counts = bitmap_popcount(roots).float()  # [B, L]
            weight = torch.ones(counts.shape[0], device=device)
            if valid is not None:
                weight = valid.to(device, torch.float32)
            held = (counts * weight[:, None]).sum(0) / weight.sum().clamp_min(1.0)
        return (self.num_experts - held).clamp_min(0.0)

    def weigh(
        self,
        options: SelectionOptions,
        base: torch.Tensor | None,
        root_experts: torch.Tensor,
        valid: torch.Tensor | None = None,
        *,
        host_eps: bool,
    ) -> tuple[SelectionOptions, torch.Tensor]:
        """A step's selection with DeltaCost trusting only what the predictor knows: each
        layer weighted by its trust (:meth:`layer_weights`, times ``base``) and eps raised by
        the unpredicted cost U of this step's buffer (:meth:`unpredicted_cost`,
        :meth:`buffer_free`). A cold or useless predictor gets weight 0 and a large eps:
        selection by confidence.

        Args:
            options: the step's selection options (its eps, share_buffer, policy).
            base: float ``[L]`` or None: the configured layer weights.
            root_experts, valid: as :meth:`buffer_free`.
            host_eps: read U on the host (one sync) into eps, exactly. Else (graph-safe) eps
                stays and the weights are scaled by c = eps / (eps + U): P / (w.Delta + eps
                + U) = P / (c w.Delta + eps) / c ranks every candidate alike; "adaptive"'s
                stopping rule, whose step cost is not scaled, then stops later than with the
                exact rule.

        Returns:
            the options (eps raised when ``host_eps``) and DeltaCost's layer weights
            float32 ``[L]``.
        """
        free = self.buffer_free(root_experts, valid, share_buffer=options.share_buffer)
        unpredicted = self.unpredicted_cost(base, free)
        weights = self.layer_weights(base)
        if host_eps:
            return options.with_eps(options.eps + float(unpredicted)), weights
        return options, weights * (options.eps / (options.eps + unpredicted))

    def recall(self) -> float | None:
        """Cumulative recall over every row seen, all layers (a host sync), or None."""
        rows = float(self.rows)
        return float(self.hits.sum()) / (rows * self.hits.shape[0]) if rows else None

    def per_layer(self) -> list[float] | None:
        """Cumulative recall per layer over every row seen (a host sync), or None."""
        rows = float(self.rows)
        return (self.hits / rows).tolist() if rows else None
