"""What one testbed expert costs on the profile a sweep run is priced on, measured on the
run's own verify steps.

The sweep prices each step by scaling every (step, layer) union of the testbed to the
profile (``costmodel.scaling.scale_unique_experts``; under EP the busiest rank too,
``ep_cost.scale_busiest_rank``). That map is steep where the testbed nears saturation (64
experts against DeepSeek-V3's 256): a layer pushed from 62 to 64 experts costs dozens of
the profile's. Selection counts testbed experts with one weight per layer, set before the
run from the map's slope at the greedy roots' mean union
(``sweep_plan.testbed_expert_weight``), so it cannot see that a step's candidates push some
layers into the steep part. :class:`ExpertExchange` measures the rate the pricing really
charges where selection stops: on every verify step, for each verified candidate, the
pricing's load of the step (the union; under EP the busiest rank's, scaled to the profile)
minus its load without that candidate (its own experts and its token removed), over what
selection's DeltaCost counts for that candidate's own experts on the testbed (the experts
only it reads; under EP the busiest rank's rise plus ``total_weight`` times the others),
summed over candidates, layers and steps, with the prior weight counting for
``prior_experts`` of evidence. Each candidate is priced as if verified last, because the
pricing is convex near saturation and the last candidates decide where "adaptive" stops.
The engine scales its layer weights by rate / prior (``OfflineEngine.generate_speculative``'s
``exchange``); adaptive then verifies fewer candidates where they push layers into the
steep part, which lowers the rate again, so the rate settles where the two meet. On a real
model there is no map to measure: selection's weights are the cost model's.

Shape legend: B = requests, R = verify rows per request (root first), L = MoE layers,
K = experts per token, E = the testbed's experts per layer, C = verified candidates.
"""

import numpy as np
import torch

from sgl_ecospec.costmodel.scaling import scale_unique_experts
from sgl_ecospec.lab.bench.ep_cost import scale_busiest_rank

__all__ = ["ExpertExchange"]


class ExpertExchange:
    """The measured exchange rate of testbed experts into a profile's.

    Args:
        num_experts, top_k: E_t, K_t of the testbed.
        profile: the priced profile (anything with ``num_experts`` and ``top_k``).
        prior: the rate before any step (the weight selection was configured with), > 0.
        prior_experts: how much evidence, in testbed experts, the prior counts for (> 0):
            the measured rate takes over once the steps have added more than that.
        ep_size: R, EP ranks (contiguous placement, ``ep_cost.contiguous_expert_rank``);
            E_t must be a multiple of it.
        total_weight: selection's weight of the experts off the busiest rank under EP, in
            [0, 1]; None for 1 / R.
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
        self.priced_rise = 0.0  # profile expert loads, summed over layers and steps
        self.testbed_rise = 0.0  # selection's DeltaCost units on the testbed, likewise

    def rate(self) -> float:
        """Profile expert loads per unit of testbed DeltaCost of a candidate verified last,
        the prior blended in."""
        return (self.prior * self.prior_experts + self.priced_rise) / (
            self.prior_experts + self.testbed_rise
        )

    def scale(self) -> float:
        """rate / prior: the factor on the configured layer weights."""
        return self.rate() / self.prior

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
        charged = self._priced(union, busiest, verified) - self._priced(
            union - added, busiest - rise, verified - 1
        )
        self.priced_rise += float(charged.sum())
        self.testbed_rise += float((rise + self.total_weight * (added - rise)).sum())

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
