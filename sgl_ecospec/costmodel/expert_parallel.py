"""Verify-pass time under expert parallelism (EP): the busiest rank sets the pace.

Under EP R each rank holds E / R whole experts and streams only its own, at 1 / R of the
group's bandwidth, and every MoE layer waits for its busiest rank. With the performance
model's hardware being the whole EP group (e.g. "8xh200" for EP 8), the load term k2 N of
``PerformanceModel.verify_time`` becomes k2 R b, b the busiest rank's distinct experts per
layer:

    pass_time = verify_time(tokens, N) + k2 (R b - N)

so only the load term changes (the expert GEMMs' compute keeps N), and R = 1 (b = N) gives
``verify_time`` itself. With uniform routing b is ``formulas.expected_busiest_rank_experts``
(:func:`uniform_ep_verify_time`): the step time a cost profile per token count predicts on
an EP deployment, which both EcoSpec's adaptive account (``selection_cost``) and the EVICT
peer's step seconds read. Pricing with the union alone (k2 N) would charge a batch-1 pass on
Qwen3-235B at EP 8 for 8 expert loads where its busiest rank streams about 2.5 x 8.
"""

import numpy as np

from sgl_ecospec.costmodel import formulas
from sgl_ecospec.costmodel.performance import PerformanceModel


def ep_pass_time(perf: PerformanceModel, tokens, unique, busiest, ep_size: int) -> np.ndarray:
    """Seconds of target passes under EP: ``verify_time(tokens, N) + k2 (R b - N)``.

    Args:
        perf: the model on the whole EP group's hardware.
        tokens: tokens in each pass (integers >= 1), float or array.
        unique: N, distinct experts per layer of each pass (broadcast with ``tokens``).
        busiest: b, the busiest rank's distinct experts per layer, in [N / R, N].
        ep_size: R (>= 1).
    """
    if isinstance(ep_size, bool) or not isinstance(ep_size, int | np.integer) or ep_size < 1:
        raise ValueError(f"ep_size must be an int >= 1, got {ep_size!r}")
    unique = np.asarray(unique, dtype=np.float64)
    base = np.asarray(perf.verify_time(1, tokens, unique), dtype=np.float64)
    return base + perf.params.k2 * (ep_size * np.asarray(busiest, dtype=np.float64) - unique)


def uniform_ep_verify_time(perf: PerformanceModel, batch, gamma, ep_size: int):
    """Seconds of a verify pass over ``batch x gamma`` tokens under EP ``ep_size`` with
    uniform routing: :func:`ep_pass_time` with N = N(B gamma) and b its expected busiest
    rank (``formulas.expected_busiest_rank_experts``); ``verify_time(batch, gamma)`` at
    R = 1.

    Args:
        perf: the model on the whole EP group's hardware.
        batch: requests, >= 1.
        gamma: tokens verified per request, integer >= 1.
        ep_size: R, in [1, the model's experts per layer].
    """
    if ep_size == 1:
        return perf.verify_time(batch, gamma)
    model = perf.model
    tokens = np.asarray(batch, dtype=np.float64) * formulas.check_gamma(gamma)
    unique = formulas.expected_unique_experts(tokens, model.num_experts, model.top_k)
    busiest = formulas.expected_busiest_rank_experts(
        tokens, model.num_experts, model.top_k, ep_size
    )
    return formulas._result(ep_pass_time(perf, tokens, unique, busiest, ep_size))
