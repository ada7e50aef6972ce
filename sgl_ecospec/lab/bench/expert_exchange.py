"""What one testbed expert costs on the profile a sweep run is priced on, measured on the
run's own verify steps.

The sweep prices each step by scaling every (step, layer) union of the testbed to the
profile (``costmodel.scaling.scale_unique_experts``; under EP the busiest rank too,
``ep_cost.scale_busiest_rank``). That map is steep where the testbed nears saturation (64
experts against DeepSeek-V3's 256): a layer pushed from 62 to 64 experts costs dozens of
the profile's. Selection counts testbed experts with one weight per layer, set before the
run from the map's slope at the greedy roots' mean union
(``sweep_plan.testbed_expert_weight``), so it cannot see that a step's candidates push some
layers into the steep part. :class:`ExpertExchange` measures what the pricing really charges
where selection stops: on every verify step, for each verified candidate, the pricing's
load of the step (the union scaled to the profile; under EP the busiest rank's) minus its
load without that candidate (its own experts and its token removed), summed over
candidates, layers and steps, per testbed expert that only that candidate reads. Each
candidate is priced as if verified last, because the pricing is convex near saturation and
the last candidates decide where "adaptive" stops. Under EP the experts that raised the
busiest rank and the others get a price each: the others cost nothing while the testbed's
ranks have room (the busiest rank alone sets the pace), but once its busiest ranks are full
(8 experts each at EP 8) the pricing still charges the union's growth, so they do.

:meth:`ExpertExchange.adjust` gives each step's selection its layer weights scaled by the
busiest-rank price over the prior, and under EP ``total_weight`` = the other experts' price
over the busiest rank's. Each price starts at its prior (the configured weight, and that
times the configured ``total_weight``), counting for ``prior_experts`` of evidence.
"adaptive" then verifies fewer candidates where they push layers into the steep part, which
lowers the prices again, so they settle where the two meet. On a real model there is no map
to measure: the plugin's weights are the cost model's.

Shape legend: B = requests, R = verify rows per request (root first), L = MoE layers,
K = experts per token, E = the testbed's experts per layer, C = verified candidates.
"""

import dataclasses

import numpy as np
import torch

from sgl_ecospec.costmodel.scaling import scale_unique_experts
from sgl_ecospec.lab.bench.ep_cost import scale_busiest_rank
from sgl_ecospec.ops.selection import SelectionOptions

__all__ = ["ExpertExchange"]


class ExpertExchange:
    """The measured prices of testbed experts in the profile's loads.

    Args:
        num_experts, top_k: E_t, K_t of the testbed.
        profile: the priced profile (anything with ``num_experts`` and ``top_k``).
        prior: the price of an expert before any step (the weight selection was
            configured with), > 0.
        prior_experts: how much evidence, in testbed experts, each prior counts for (> 0).
        ep_size: R, EP ranks (contiguous placement, ``ep_cost.contiguous_expert_rank``);
            E_t must be a multiple of it.
        total_weight: the configured weight of the experts off the busiest rank under EP,
            in [0, 1]; None for 1 / R.
    """

    def __init__(
        self,
        *,
        num_experts: int,
        top_k: int,
        profile,
        prior: float,
        prior_experts: float,
        ep_size: int = 1,
        total_weight: float | None = None,
    ):
        if not prior > 0 or not prior_experts > 0:
            raise ValueError(
                f"prior and prior_experts must be > 0, got {prior} and {prior_experts}"
            )
        if ep_size < 1 or num_experts % ep_size:
            raise ValueError(f"ep_size must be >= 1 and divide {num_experts}, got {ep_size}")
        self.num_experts, self.top_k, self.profile = num_experts, top_k, profile
        self.prior, self.prior_experts = float(prior), float(prior_experts)
        self.ep_size = ep_size
        self.total_weight = 1.0 / ep_size if total_weight is None else float(total_weight)
        # Profile loads charged, and testbed experts, summed over candidates, layers, steps:
        # [0] the experts that raised the busiest rank (all of them at EP 1), [1] the others.
        self.charged = np.zeros(2)
        self.experts = np.zeros(2)

    def prices(self) -> tuple[float, float]:
        """Profile loads per testbed expert, (raising the busiest rank, the others), each
        with its prior blended in."""
        priors = self.prior * np.array([1.0, self.total_weight])
        prices = (priors * self.prior_experts + self.charged) / (self.prior_experts + self.experts)
        return float(prices[0]), float(prices[1])

    def rate(self) -> float:
        """The price of an expert that raises the busiest rank (every expert at EP 1)."""
        return self.prices()[0]

    def scale(self) -> float:
        """rate / prior: the factor on the configured layer weights."""
        return self.rate() / self.prior

    def adjust(self, options: SelectionOptions, extra: dict) -> tuple[SelectionOptions, dict]:
        """A step's selection at the measured prices: ``extra["layer_weights"]`` (float
        ``[L]``, the configured ones) times :meth:`scale`, and under EP ``total_weight`` =
        the other experts' price over the busiest rank's, in [0, 1]."""
        busiest, others = self.prices()
        extra = {**extra, "layer_weights": extra["layer_weights"] * (busiest / self.prior)}
        if self.ep_size > 1:
            weight = min(max(others / busiest, 0.0), 1.0)
            options = dataclasses.replace(options, total_weight=weight)
        return options, extra

    def update(self, routing: torch.Tensor, valid: torch.Tensor) -> None:
        """Adds one verify step.

        Args:
            routing: int ``[B, R, L, K]``: the target's routing of every verify row.
            valid: bool ``[B, R]``: the verified rows (column 0 the roots).
        """
        roots, verified = int(valid[:, 0].sum()), int(valid.sum())
        if roots == 0 or verified == roots:
            return  # no candidate verified: nothing was added to price
        rows = torch.zeros(*routing.shape[:3], self.num_experts, dtype=torch.bool)
        rows.scatter_(3, routing.long().cpu(), True)
        rows &= valid.cpu()[:, :, None, None]
        users = rows.sum((0, 1))  # [L, E]: verified rows reading each expert
        union, busiest = self._counts(users > 0)  # [L] each
        candidates = rows[:, 1:][valid.cpu()[:, 1:]]  # [C, L, E]
        alone = candidates & (users == 1)  # experts only that candidate reads
        added = alone.sum(-1).double().numpy()  # [C, L]
        ranks = (users > 0) & ~alone  # [C, L, E]: the union without the candidate
        busiest_without = ranks.view(*ranks.shape[:2], self.ep_size, -1).sum(-1).amax(-1)
        rise = busiest - busiest_without.double().numpy()  # [C, L]
        others = added - rise
        load = self._priced(union, busiest, verified)
        charged = load - self._priced(union - added, busiest - rise, verified - 1)
        # The others' share: the load without them alone (the busiest rank and token kept).
        charged_others = load - self._priced(union - others, busiest, verified)
        self.charged += [float((charged - charged_others).sum()), float(charged_others.sum())]
        self.experts += [float(rise.sum()), float(others.sum())]

    def _counts(self, experts: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(union, busiest rank's experts), float64 ``[L]`` each, of bool ``[L, E]``."""
        per_rank = experts.view(experts.shape[0], self.ep_size, -1).sum(-1)
        return experts.sum(-1).double().numpy(), per_rank.amax(-1).double().numpy()

    def _priced(self, union: np.ndarray, busiest: np.ndarray, tokens: int) -> np.ndarray:
        """The pricing's busiest-rank load on the profile (the union at EP 1) of testbed
        unions and busiest ranks (float64, one shape) in a pass of ``tokens`` rows."""
        union = np.maximum(union, self.top_k)  # a pass reads at least one token's experts
        busiest = np.clip(busiest, union / self.ep_size, union)
        scaled = np.asarray(
            scale_unique_experts(
                union,
                num_experts=self.num_experts,
                top_k=self.top_k,
                profile=self.profile,
                tokens=tokens,
            ),
            dtype=np.float64,
        )
        return scale_busiest_rank(
            busiest, union, scaled, ep_size=self.ep_size, num_experts=self.profile.num_experts
        )
