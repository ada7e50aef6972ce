"""The cost model's eps table."""

import pytest
from sglang_ecospec import eps_table
from sglang_ecospec.settings import EcoSpecSettings


@pytest.mark.parametrize(
    "profile, hardware, ep_size, message",
    [
        ("qwen3-235b-a22b", "h200", 1, "'qwen3-235b-a22b' has 94 MoE layers x 128 experts"),
        ("qwen3-30b-a3b", "4xh200", 8, "smaller than the EP group of 8 ranks: .* 8x4xh200"),
    ],
)
def test_cost_model_eps_rejects_another_model_or_too_few_gpus(profile, hardware, ep_size, message):
    with pytest.raises(ValueError, match=message):
        eps_table.cost_model_eps_table(
            profile,
            hardware,
            moe_layers=48,
            num_experts=128,
            top_k=8,
            verify_tokens=4,
            max_batch=8,
            ep_size=ep_size,
        )


def test_step_costs_per_bucket_for_the_adaptive_policy():
    from sgl_ecospec.costmodel import selection_cost

    kwargs = dict(moe_layers=48, num_experts=128, top_k=8, verify_tokens=4, max_batch=8)
    table = eps_table.cost_model_eps_table("qwen3-30b-a3b", "h200", draft_steps=3, **kwargs)
    cost_model = eps_table.cost_model("qwen3-30b-a3b", "h200")
    for batch, expected in zip(table.batches, table.step_costs, strict=True):
        exact = selection_cost(cost_model.perf, batch, 4, draft_steps=3, layers=48)
        assert expected == pytest.approx(exact.step_cost)
        assert table.candidate_cost(batch) == pytest.approx(
            (exact.candidate_cost, exact.candidate_decay)
        )
    assert table.step_cost(3) == table.step_costs[1]  # bucket 2: the largest key <= 3
    # A request's share of the step falls as the batch grows.
    assert list(table.step_costs) == sorted(table.step_costs, reverse=True)
    plain = eps_table.cost_model_eps_table("qwen3-30b-a3b", "h200", **kwargs)
    assert plain.step_costs is None and plain.eps == table.eps
    with pytest.raises(ValueError, match="no step costs"):
        plain.step_cost(1)
    with pytest.raises(ValueError, match="no candidate costs"):
        plain.candidate_cost(1)


def test_batch_options_take_each_buckets_costs_once():
    table = eps_table.EpsTable(
        batches=(1, 4),
        eps=(0.5, 2.0),
        step_costs=(10.0, 30.0),
        candidate_costs=((1.0, 0.5), (3.0, 0.25)),
    )
    auto = dict(eps="auto", profile="qwen3-235b-a22b", hardware="h200", min_score=0.0)
    adaptive = EcoSpecSettings(policy="adaptive", **auto)
    options_for = eps_table.BatchOptions(adaptive, table)
    one, many = options_for(1), options_for(7)
    assert (one.eps, one.step_cost, one.candidate_cost, one.candidate_decay) == (
        0.5,
        10.0,
        1.0,
        0.5,
    )
    assert (many.eps, many.step_cost, many.candidate_cost) == (2.0, 30.0, 3.0)
    assert options_for(4) is many and many.total_weight == 0.0  # one checked copy per bucket
    assert many.share_buffer and many.min_score == 0.0  # the settings' own fields
    # The other policies take the bucket's eps only.
    ecospec = eps_table.BatchOptions(EcoSpecSettings(**auto), table)(4)
    assert ecospec.eps == 2.0 and ecospec.step_cost is None and ecospec.candidate_cost == 0.0
    # With eps a number every batch selects with the settings' own checked options.
    fixed = EcoSpecSettings(eps=0.3)
    assert fixed.selection.eps == 0.3 and adaptive.selection is None
    assert eps_table.BatchOptions(fixed, None)(1) is eps_table.BatchOptions(fixed, None)(64)
    assert eps_table.BatchOptions(fixed, None)(9) is fixed.selection
    with pytest.raises(ValueError, match="never both"):
        eps_table.BatchOptions(fixed, table)
    with pytest.raises(ValueError, match="never both"):
        eps_table.BatchOptions(adaptive, None)
