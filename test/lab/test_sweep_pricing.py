"""Tests of the sweep's EP pricing (``ep_cost``) and its scaling identities."""

import dataclasses

import numpy as np
import pytest
import torch
from test_sweep import step_from_ids

from sgl_ecospec.costmodel import expected_unique_experts
from sgl_ecospec.lab.bench import ep_cost, metrics
from sgl_ecospec.lab.bench.runs import performance_model

# --- EP pricing ---------------------------------------------------------------------------


def test_scale_busiest_rank_identities():
    rng = np.random.default_rng(0)
    unique = rng.uniform(8, 64, 200)
    scaled = rng.uniform(8, 128, 200)
    # R = 1: the busiest rank is the union.
    assert np.array_equal(
        ep_cost.scale_busiest_rank(unique, unique, scaled, ep_size=1, num_experts=128), scaled
    )
    # Perfect balance stays perfect: u_p / R.
    balanced = ep_cost.scale_busiest_rank(unique / 8, unique, scaled, ep_size=8, num_experts=128)
    np.testing.assert_allclose(balanced, scaled / 8)
    # Everything on one rank: the union, capped at the rank's E_p / R experts.
    lopsided = ep_cost.scale_busiest_rank(unique, unique, scaled, ep_size=8, num_experts=128)
    np.testing.assert_allclose(lopsided, np.minimum(scaled, 16))
    # Anything between lies in [u_p / R, min(u_p, E_p / R)].
    busiest = unique * rng.uniform(1 / 8, 1, 200)
    out = ep_cost.scale_busiest_rank(busiest, unique, scaled, ep_size=8, num_experts=128)
    assert (out >= np.minimum(scaled / 8, 16) - 1e-12).all() and (
        out <= np.minimum(scaled, 16)
    ).all()
    with pytest.raises(ValueError, match=r"busiest must lie in \[unique / R, unique\]"):
        ep_cost.scale_busiest_rank(9.0, 8.0, 10.0, ep_size=2, num_experts=128)
    with pytest.raises(ValueError, match=r"busiest must lie in \[unique / R, unique\]"):
        ep_cost.scale_busiest_rank(1.0, 8.0, 10.0, ep_size=4, num_experts=128)


def test_busiest_rank_experts_from_bitmaps():
    assert ep_cost.contiguous_expert_rank(8, 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    steps = [
        step_from_ids(1, 1, [0], [[0, 1, 2], [0, 2, 4, 6]], 8),
        step_from_ids(1, 1, [0], [[7], [6, 7, 5]], 8),
    ]
    assert ep_cost.busiest_rank_experts(steps, 8, 4).tolist() == [[2, 1], [1, 2]]
    assert ep_cost.busiest_rank_experts(steps, 8, 1).tolist() == [[3, 4], [1, 3]]
    assert ep_cost.busiest_rank_experts(steps, 8, 8).tolist() == [[1, 1], [1, 1]]


def _uniform_steps(count, batch, per_request, experts, top_k, layers=3):
    """Steps whose layer unions hold ``u`` experts spread over ranks as evenly as ids go."""
    tokens = batch * per_request
    union = int(round(float(expected_unique_experts(tokens, experts, top_k))))
    ids = (
        list(range(0, experts, 2))[:union]
        + list(range(1, experts, 2))[: max(0, union - experts // 2)]
    )
    return [
        step_from_ids(batch, tokens, [1] * batch, [ids] * layers, experts) for _ in range(count)
    ]


def test_price_steps_at_ep1_is_the_bench_pricing():
    perf = performance_model("qwen3-235b-a22b", "h200")
    spec = _uniform_steps(4, 2, 5, 16, 2)
    ar = _uniform_steps(9, 2, 1, 16, 2)
    kw = {"num_experts": 16, "top_k": 2}
    priced_spec = ep_cost.price_steps(spec, perf, **kw, ep_size=1)
    priced_ar = ep_cost.price_steps(ar, perf, **kw, ep_size=1)
    ours = ep_cost.predicted_speedup(spec, priced_spec, ar, priced_ar, perf, num_draft_steps=3)
    bench = metrics.predicted_cost(spec, ar, perf, **kw, num_draft_steps=3)
    assert ours["speedup"] == pytest.approx(bench["speedup"], rel=1e-12)
    assert ours["verify_ms"] == pytest.approx(bench["verify_ms"], rel=1e-12)
    assert ours["ar_ms"] == pytest.approx(bench["ar_ms"], rel=1e-12)
    assert ours["step_ms"] == pytest.approx(
        bench["verify_ms"] + bench["draft_ms"] + bench["reject_ms"], rel=1e-12
    )
    assert ours["speedup_stderr"] == pytest.approx(0.0, abs=1e-12)  # identical steps
    assert np.array_equal(priced_spec.busiest_scaled, priced_spec.unique_scaled)

    # Under EP the busiest rank only adds cost: a slower pass than the balanced ideal.
    perf8 = performance_model("qwen3-235b-a22b", "8xh200")
    priced8 = ep_cost.price_steps(spec, perf8, **{"num_experts": 16, "top_k": 2}, ep_size=8)
    balanced = perf8.verify_time(1, 10, priced8.unique_scaled.mean(1))
    assert (priced8.seconds >= balanced - 1e-15).all()
    assert (priced8.busiest_scaled <= priced8.unique_scaled).all()


def test_predicted_speedup_stderr_grows_with_uneven_acceptance():
    perf = performance_model("qwen3-235b-a22b", "h200")
    base = _uniform_steps(6, 1, 5, 16, 2)
    uneven = [
        dataclasses.replace(s, accepted=[a]) for s, a in zip(base, [0, 4, 0, 4, 0, 4], strict=True)
    ]
    even = [dataclasses.replace(s, accepted=[2]) for s in base]
    ar = _uniform_steps(5, 1, 1, 16, 2)
    kw = {"num_experts": 16, "top_k": 2, "ep_size": 1}
    priced, priced_ar = ep_cost.price_steps(base, perf, **kw), ep_cost.price_steps(ar, perf, **kw)
    a = ep_cost.predicted_speedup(uneven, priced, ar, priced_ar, perf, num_draft_steps=3)
    b = ep_cost.predicted_speedup(even, priced, ar, priced_ar, perf, num_draft_steps=3)
    assert a["speedup"] == pytest.approx(b["speedup"])  # same tokens in total
    assert a["speedup_stderr"] > 0.1 * a["speedup"] and b["speedup_stderr"] < 1e-12


def test_paired_speedup_prices_both_sets_as_a_run():
    """Each set of a paired step is priced as ``predicted_speedup`` prices a run: with the
    compared set equal to the run's the two agree and differ by 0; a compared set that
    accepts less on the same passes is slower by the tokens it loses, with a standard error
    from how unevenly it loses them."""
    perf = performance_model("qwen3-235b-a22b", "8xh200")
    kw = {"num_experts": 16, "top_k": 2}
    ar = _uniform_steps(5, 2, 1, 16, 2)
    run = [
        dataclasses.replace(s, accepted=[a, 1])
        for s, a in zip(_uniform_steps(6, 2, 3, 16, 2), [0, 2, 1, 2, 0, 2], strict=True)
    ]

    def paired(steps, against_accepted):
        return [
            dataclasses.replace(
                s,
                paired_bitmaps=torch.stack([s.expert_bitmap] * 2),
                paired_accepted=[sum(s.accepted), a],
                paired_verified=[s.verified_tokens] * 2,
            )
            for s, a in zip(steps, against_accepted, strict=True)
        ]

    for ep_size in (1, 4):
        priced = ep_cost.price_steps(run, perf, **kw, ep_size=ep_size)
        priced_ar = ep_cost.price_steps(ar, perf, **kw, ep_size=ep_size)
        alone = ep_cost.predicted_speedup(run, priced, ar, priced_ar, perf, num_draft_steps=3)
        same = ep_cost.paired_speedup(
            paired(run, [sum(s.accepted) for s in run]),
            ar,
            priced_ar,
            perf,
            **kw,
            ep_size=ep_size,
            num_draft_steps=3,
        )
        assert same["run"] == pytest.approx(alone["speedup"])
        assert same["compared"] == pytest.approx(alone["speedup"])
        assert same["difference"] == 0.0 and same["stderr"] == pytest.approx(0.0, abs=1e-12)
        fewer = ep_cost.paired_speedup(
            paired(
                run, [sum(s.accepted) - d for s, d in zip(run, [1, 0, 1, 2, 0, 2], strict=True)]
            ),
            ar,
            priced_ar,
            perf,
            **kw,
            ep_size=ep_size,
            num_draft_steps=3,
        )
        seconds = priced.seconds.sum() + 6 * (3 * perf.draft_time(2) + perf.reject_time(2))
        ar_rate = sum(s.verified_tokens for s in ar) / priced_ar.seconds.sum()
        assert fewer["difference"] == pytest.approx(6 / seconds / ar_rate)
        assert fewer["stderr"] > 0
