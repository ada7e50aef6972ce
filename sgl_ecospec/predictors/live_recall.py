"""An expert predictor's live recall, measured on device from the verify routing, and the
per-layer trust that verify-set selection derives from it.

Shape legend: T = verified rows, L = MoE layers, K = experts per token, E = experts per layer.
"""

import torch

from sgl_ecospec.ops.bitmaps import bitmap_popcount, topk_to_bitmap
from sgl_ecospec.ops.checks import check_int
from sgl_ecospec.ops.selection import SelectionOptions
from sgl_ecospec.ops.selection_reference import rank_loads


class LiveRecall:
    """Per-layer top-K recall of a predictor on the rows the target verified (cumulative
    totals, what a benchmark reports), and the trust verify-set selection puts in its
    predictions. :meth:`update` and :meth:`update_cost_fit` run a fixed number of kernels
    and no host sync.

    Trust. A candidate's cost in layer l is the shrinkage estimate
    ``w_l * predicted_new_l + (1 - w_l) * n_l``: its predicted new experts as far as they
    are trusted, the rest n_l, the new experts a verified candidate really brings to its
    step's verify pass, measured after every verify (:meth:`update_novel`). w_l is the
    slope of true on predicted new experts over the recent steps' verified candidates
    (:meth:`update_cost_fit`): 0 for predictions that say nothing about which candidate
    costs more, 1 for exact ones. Recall does not measure that: on the full testbed the
    `adjacent` predictor recalls 0.47 (a recall-derived trust (r - K/E) / (1 - K/E) of
    0.38-0.75 per layer) while its predicted new experts track the true ones with a slope of
    0.01-0.30; selection trusting the recall traded 0.7% of acceptance for 0.2% of the
    experts (docs/RESULTS.md). Under uniform routing n_l would be K (1 - K / E)^B; real
    routing favours popular experts, which the roots hold already, and a candidate shares
    experts with its parent, so it is measured. It starts at 0, so that the first steps
    verify and measure: only verified candidates measure n_l, and a pessimistic start
    (K (1 - K / E), the uniform cost of a lone candidate) priced every candidate above a
    step's worth under EP 8 at batch 1, where "adaptive" then never verified one and never
    learnt otherwise (docs/RESULTS.md).
    :meth:`unpredicted_cost` gives the second term summed over layers, a cost every
    candidate pays alike; :meth:`weigh` applies both to a step's selection. The trust
    starts at 0, so a cold predictor is trusted with nothing and selection sizes its sets
    by the measured cost alone.

    Args:
        num_layers: L.
        num_experts: E.
        top_k: K.
        rate: weight in (0, 1] of each verify step in the trust's decayed sums and (after
            the first steps) in n_l's moving average.
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
        # n_l: the new experts a verified candidate adds to its step's verify pass [L]
        self.novel = torch.zeros(num_layers, dtype=torch.float32, device=device)
        self.novel_steps = torch.zeros((), dtype=torch.float32, device=device)
        self.hits = torch.zeros(num_layers, dtype=torch.float64, device=device)  # [L]
        # update_cost_fit's decayed sums per layer of 1, x, y, x^2 and x y [5, L] over the
        # verified candidates, and the trust w_l
        self.cost_fit = torch.zeros(5, num_layers, dtype=torch.float32, device=device)
        self.trust = torch.zeros_like(self.novel)
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
        """Adds one verify step to the recall.

        Args:
            predicted: int ``[T, L, K]``: the experts predicted for the verified rows.
            true: int ``[T, L, K']``: the experts the target routed them to.
            valid: bool ``[T]`` or None (all): rows that count (e.g. not padding).
        """
        device = self.hits.device
        pred = topk_to_bitmap(predicted.to(device), self.num_experts, validate=False)
        real = topk_to_bitmap(true.to(device), self.num_experts, validate=False)
        found = bitmap_popcount(pred & real).float()  # [T, L]
        per_row = found / bitmap_popcount(real).float().clamp_min(1.0)
        weight = torch.ones(per_row.shape[0], device=device)
        if valid is not None:
            weight = valid.to(device, torch.float32)
        count = weight.sum()
        summed = (per_row * weight[:, None]).sum(0)  # [L]
        self.hits += summed.double()
        self.rows += count.double()

    def update_cost_fit(
        self,
        predicted: torch.Tensor,
        routing: torch.Tensor,
        valid: torch.Tensor | None = None,
    ) -> None:
        """Adds one verify step to the trust ``w_l``: the least-squares slope (with an
        intercept), per layer, of a verified candidate's true new experts y on its predicted
        new experts x (those outside the roots' true and predicted union: what DeltaCost
        counts), over the verified candidates of the recent steps. It reads how candidates
        differ within a request (which of them to drop) and from step to step (how many to
        verify, which "adaptive" sizes by): centred within each request instead, a step of
        batch 1 with one verified candidate, the common case there, is no evidence, and even
        exact predictions stayed barely trusted (docs/RESULTS.md, sweep run 8). Sums decay
        by ``rate`` per step; the slope is shrunk towards 0 while they are few, and clamped
        to [0, 1]. No host sync.

        Args:
            predicted: int ``[B, R, L, K]``: the predictions of the verify rows, root first
                (what selection saw).
            routing: int ``[B, R, L, K]``: the target's routing of the same rows.
            valid: bool ``[B, R]`` or None (all): rows that count.
        """
        weight = torch.ones(routing.shape[:2], device=self.trust.device)
        if valid is not None:
            weight = valid.to(weight.device, torch.float32)
        w = weight[:, 1:, None]  # [B, R - 1, 1]
        x, y = (_new_experts(ids, weight, self.num_experts) for ids in (predicted, routing))
        terms = torch.stack([w.expand_as(x), x, y, x * x, x * y]) * w  # [5, B, R - 1, L]
        self.cost_fit.mul_(1.0 - self.rate).add_(terms.sum((1, 2)))
        count, sx, sy, sxx, sxy = self.cost_fit
        count = count.clamp_min(1e-6)
        spread = (sxx - sx * sx / count).clamp_min(0.0)
        # A prior of no trust worth one candidate's spread (spread / count), so that a few
        # candidates do not swing it; in the spread's own units, since a layer whose
        # candidates bring one new expert or none varies far less than one that brings K.
        slope = (sxy - sx * sy / count) / (spread * (1.0 + 1.0 / count) + 1e-6)
        torch.clamp(slope, 0.0, 1.0, out=self.trust)

    def layer_weights(self, base: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[L]``: each layer's trust ``w_l`` in [0, 1] (times ``base`` ``[L]``, the
        configured layer weights, when given): DeltaCost's per-layer weights."""
        return self.trust.clone() if base is None else self.trust * base.to(self.trust)

    def trusted_share(self, base: torch.Tensor | None = None) -> torch.Tensor:
        """float32 scalar tensor: the layers' mean trust, weighted by ``base`` (float
        ``[L]``; the configured layer weights) when given: the share of a candidate's
        experts that DeltaCost prices."""
        if base is None:
            return self.trust.mean()
        base = base.to(self.trust)
        return (self.trust * base).sum() / base.sum().clamp_min(1e-12)

    def unpredicted_cost(self, base: torch.Tensor | None = None) -> torch.Tensor:
        """float32 scalar tensor: the cost a candidate pays beyond its trusted predictions,
        ``sum_l base_l (1 - w_l) n_l`` (``base`` float ``[L]`` or ones), in expert loads like
        DeltaCost; every candidate pays it alike, so it acts as eps."""
        missed = (1.0 - self.layer_weights()) * self.novel  # [L]
        return (missed if base is None else missed * base.to(missed)).sum()

    def update_novel(
        self,
        routing: torch.Tensor,
        valid: torch.Tensor | None = None,
        *,
        budget: int | None = None,
        placement=None,
        total_weight: float | None = None,
    ) -> None:
        """Adds one verify step to n_l, the new experts a verified candidate really brings:
        per layer, the true experts the step's verified candidates add to the roots' union,
        divided by the number of candidates (their average marginal cost in the pass). A step
        without candidates measures its roots instead, leaving each out in turn, so the
        measure never starves when selection verifies nothing; a lone root (batch 1) is not
        measured, since against an empty union it would count all its experts, several
        times a candidate's cost, and so keep selection from verifying. The first steps are
        averaged (the weight of step n is max(rate, 1 / n)), so the starting value is soon
        forgotten.
        No host sync.

        With ``budget`` the candidates' cost is amortised over a whole verify set. The
        experts the roots miss fill up as candidates are added: the first few candidates
        bring most of them, later ones little, so k candidates' average overprices the
        later ones wherever the roots nearly saturate a layer (large batches), and a rule
        that weighs every candidate at that average stops early. If the k verified
        candidates filled a share f of the M experts the roots miss, each of K = roots x
        ``budget`` candidates would, hitting them independently, fill M (1 - (1 - f)^(K/k));
        n_l is that over K. Where f is small this is the measured average (small
        batches); where the roots nearly saturate it is what a full verify set pays per
        candidate.

        With an EP placement the experts are counted as selection's EP DeltaCost counts
        them: the rise of the busiest rank's expert count plus ``total_weight`` times the
        rise on the other ranks, so that n_l is in the units of the DeltaCost it joins.

        Args:
            routing: int ``[B, R, L, K]``: the target's routing of the step's verify rows,
                each request's root first (R = 1 + its verified candidates, padded).
            valid: bool ``[B, R]`` or None (all): rows that count (not padding, not copies,
                captured).
            budget: S, candidates a request may verify, or None (no amortisation).
            placement: the EP placement selection prices with (``expert_rank`` int64 ``[E]``
                or ``[L, E]``, ``num_ranks``), or None (every expert alike).
            total_weight: weight of the experts off the busiest rank, in [0, 1]; None for
                1 / num_ranks, as ``select_verify_set``. Only with ``placement``.
        """
        device = self.novel.device
        batch, rows = routing.shape[:2]
        weight = torch.ones(batch, rows, device=device)
        if valid is not None:
            weight = valid.to(device, torch.float32)
        multi = _multi_hot(routing, weight, self.num_experts)  # [B, R, L, E]
        root_counts = multi[:, 0].sum(0)  # [L, E]: how many roots use each expert
        root_union = root_counts > 0
        candidates = weight[:, 1:].sum()
        # The experts the candidates add to the roots' union, shared out among them: a
        # candidate's average marginal cost in this pass, which is what the pass is priced
        # by (candidates of one step often share the experts no root uses).
        pass_union = root_union | (multi[:, 1:].sum((0, 1)) > 0)  # [L, E]
        cost = _UnionCost(placement, total_weight, device)
        candidate_novel = cost.added(pass_union, root_union)  # [L]
        if budget is not None:
            check_int("budget", budget, minimum=1)
            candidate_novel = candidate_novel * _fill_amortisation(
                root_union, pass_union, candidates, weight[:, 0].sum() * budget
            )
        others = (root_counts - multi[:, 0]) > 0  # [B, L, E]: the other roots' union
        roots = weight[:, 0].sum()
        root_novel = cost.added(root_union.expand_as(others), others).sum(0)  # [L]
        step_novel = torch.where(
            candidates > 0,
            candidate_novel / candidates.clamp_min(1.0),
            root_novel / roots.clamp_min(1.0),
        )
        counted = ((candidates > 0) | (roots > 1)).float()
        self.novel_steps += counted
        rate = torch.clamp(1.0 / self.novel_steps.clamp_min(1.0), min=self.rate)
        self.novel += (rate * counted) * (step_novel - self.novel)

    def weigh(
        self,
        options: SelectionOptions,
        base: torch.Tensor | None,
        *,
        host_eps: bool,
    ) -> tuple[SelectionOptions, torch.Tensor]:
        """A step's selection with DeltaCost trusting only what the predictor knows: each
        layer weighted by its trust (:meth:`layer_weights`, times ``base``) and eps raised by
        the unpredicted cost U (:meth:`unpredicted_cost`). A cold or useless predictor gets
        weight 0 and eps the measured cost of a token: selection by confidence, sized by
        what tokens really cost. Options with a ``candidate_cost`` schedule already price
        every candidate's experts (the cost model's, falling with the candidates a request
        has taken), so U is not added to them: the trusted layers' experts are priced by
        DeltaCost, and with ``host_eps`` the schedule keeps only the untrusted share of the
        layers (:meth:`trusted_share`); graph-safe, the whole schedule stays (a float of
        the op), which prices trusted experts twice and so verifies less.

        Args:
            options: the step's selection options.
            base: float ``[L]`` or None: the configured layer weights.
            host_eps: read U on the host (one sync) into eps, exactly. Else (graph-safe) eps
                stays and the weights are scaled by c = eps / (eps + U): P / (w.Delta + eps
                + U) = P / (c w.Delta + eps) / c ranks every candidate alike; "adaptive"'s
                stopping rule, whose step cost is not scaled, then stops later than with the
                exact rule.

        Returns:
            the options (eps raised when ``host_eps``) and DeltaCost's layer weights
            float32 ``[L]``.
        """
        weights = self.layer_weights(base)
        if options.candidate_cost > 0:
            if not host_eps:
                return options, weights
            share = 1.0 - float(self.trusted_share(base))
            return options.replace(candidate_cost=options.candidate_cost * share), weights
        unpredicted = self.unpredicted_cost(base)
        if host_eps:
            return options.replace(eps=options.eps + float(unpredicted)), weights
        return options, weights * (options.eps / (options.eps + unpredicted))

    def recall(self) -> float | None:
        """Cumulative recall over every row seen, all layers (a host sync), or None."""
        rows = float(self.rows)
        return float(self.hits.sum()) / (rows * self.hits.shape[0]) if rows else None

    def per_layer(self) -> list[float] | None:
        """Cumulative recall per layer over every row seen (a host sync), or None."""
        rows = float(self.rows)
        return (self.hits / rows).tolist() if rows else None


def _multi_hot(ids: torch.Tensor, weight: torch.Tensor, num_experts: int) -> torch.Tensor:
    """float32 ``[B, R, L, E]``: each row's experts (``ids`` int ``[B, R, L, K]``) as 1,
    times the row's ``weight`` (float ``[B, R]``, 0 for rows that do not count)."""
    multi = torch.zeros(*ids.shape[:3], num_experts, device=weight.device)
    multi.scatter_(3, ids.to(weight.device).long(), 1.0)
    return multi * weight[:, :, None, None]


def _new_experts(ids: torch.Tensor, weight: torch.Tensor, num_experts: int) -> torch.Tensor:
    """float32 ``[B, R - 1, L]``: each candidate's experts outside its step's roots' union
    (``ids`` int ``[B, R, L, K]``, root first; ``weight`` float ``[B, R]``, 0 for rows that do
    not count, whose experts join no union)."""
    multi = _multi_hot(ids, weight, num_experts)
    missing = (multi[:, 0].sum(0) == 0).float()  # [L, E]: experts no root uses
    return torch.einsum("brle,le->brl", multi[:, 1:], missing)


def _fill_amortisation(
    root_union: torch.Tensor, pass_union: torch.Tensor, verified, full
) -> torch.Tensor:
    """float32 ``[L]``: how much cheaper per candidate a verify set of ``full`` candidates
    fills the roots' missing experts than the ``verified`` ones did (both float32 scalars;
    ``root_union`` within ``pass_union``, bool ``[L, E]``); 1 where nothing was added."""
    missing = (~root_union).sum(-1).float()  # [L]
    added = (pass_union & ~root_union).sum(-1).float()
    verified = verified.clamp_min(1.0)
    full = torch.maximum(full, verified)
    share = (added / missing.clamp_min(1.0)).clamp(max=1.0)
    filled = missing * -torch.expm1((full / verified) * torch.log1p(-share))  # M (1 - (1-f)^(K/k))
    ratio = (filled / full) / (added / verified).clamp_min(1e-12)
    return torch.where(added > 0, ratio, torch.ones_like(ratio))


class _UnionCost:
    """What growing one layer's expert union costs, in selection's DeltaCost units: the
    experts added, or with an EP placement the busiest rank's rise plus ``total_weight``
    times the rest (``select_verify_set``'s EP cost)."""

    def __init__(self, placement, total_weight: float | None, device: torch.device):
        self.rank = None
        if placement is None:
            if total_weight is not None:
                raise ValueError("total_weight needs placement (the expert -> EP rank map)")
            return
        self.num_ranks = check_int("num_ranks", placement.num_ranks, minimum=1)
        self.rank = placement.expert_rank.to(device).long()
        self.total_weight = 1.0 / self.num_ranks if total_weight is None else float(total_weight)

    def added(self, grown: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """float32 ``[..., L]``: the cost of ``grown`` over ``base`` (bool ``[..., L, E]``,
        ``base`` within ``grown``)."""
        count = (grown & ~base).sum(-1).float()
        if self.rank is None:
            return count
        peak = [rank_loads(u, self.rank, self.num_ranks).amax(-1) for u in (grown, base)]
        rise = (peak[0] - peak[1]).float()
        return rise + self.total_weight * (count - rise)
