"""The cost model's eps table."""

import pytest
from sglang_ecospec import eps_table


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
