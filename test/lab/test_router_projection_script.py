import json
import runpy
from pathlib import Path

import pytest
import torch
from _models import byte_tokenizer, tiny_target

SCRIPT = Path(__file__).parents[2] / "scripts" / "router_projection_recall.py"


@pytest.fixture(scope="module")
def script():
    return runpy.run_path(str(SCRIPT))


def test_online_table_counts_only_earlier_rows_of_the_same_token(script):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 5, (40,), generator=gen)
    routing = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(40)])
    counts, seen = script["online_table"](tokens, routing, 6)
    for i in range(40):
        expected = torch.zeros(6)
        for j in range(i):
            if tokens[j] == tokens[i]:
                expected[routing[j]] += 1
        assert torch.equal(counts[i], expected)
        assert bool(seen[i]) == bool((tokens[:i] == tokens[i]).any())


def test_features_read_the_tokens_and_anchor_each_kind_names(script):
    tokens = torch.tensor([3, 1, 4, 1, 5, 2])
    x = torch.arange(6 * 2 * 3, dtype=torch.float16).view(6, 2, 3)
    embed = torch.randn(6, 4)
    data = {"tokens": tokens, "x": x, "rows": torch.tensor([3, 5])}
    widths = {"token": 4 + 1, "root": 4 + 3 + 1, "depth1": 8 + 3 + 1, "depth2": 12 + 3 + 1}
    for kind, width in widths.items():
        assert script["features"](data, embed, 1, kind).shape == (2, width)
    depth1 = script["features"](data, embed, 1, "depth1")
    assert torch.equal(depth1[1, :4], embed[2])  # the row's own token
    assert torch.equal(depth1[1, 4:8], embed[5])  # its parent's
    assert torch.equal(depth1[1, 8:11], x[3, 1].float())  # the grandparent's input, layer 1
    assert torch.equal(depth1[:, -1], torch.ones(2))


def test_recall_of_is_the_share_of_true_experts_in_the_top_k(script):
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.0], [0.0, 0.1, 0.2, 0.3]])
    routing = torch.tensor([[0, 2], [3, 2]])
    assert script["recall_of"](scores, routing, 2) == 0.75  # rows 0.5 and 1.0


def test_script_fits_and_reports_every_predictor_on_a_tiny_target(script, tmp_path, capsys):
    target = tmp_path / "target"
    tiny_target().save_pretrained(target)
    byte_tokenizer().save_pretrained(target)
    out = tmp_path / "projection.json"
    args = ["--target", str(target), "--train-tokens", "400", "--eval-prompts", "1"]
    assert script["main"]([*args, "--new-tokens", "4", "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    names = {"table", *script["FEATURES"], *(f"{k}+table" for k in script["FEATURES"])}
    assert set(result["recall"]) == names
    layers = tiny_target().config.num_hidden_layers
    for name in names:
        assert 0.0 <= result["recall"][name] <= 1.0
        assert len(result["recall_per_layer"][name]) == layers
    assert result["train_tokens"] >= 400 and result["eval_rows"] == 2 * 4
    assert result["predict_ms_16x36"] > 0
    assert "| depth1+table |" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--ridge", "0"], ["--table-weight", "-1"]])
def test_script_rejects_bad_settings(script, bad):
    with pytest.raises(SystemExit):
        script["main"](bad)


def test_script_names_the_layers_without_a_router(script, tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=8, shared_expert_intermediate_size=8, mlp_only_layers=[1],
    )  # fmt: skip
    Qwen2MoeForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"layers \[1\] have no MoE router"):
        script["Capture"](str(tmp_path))
