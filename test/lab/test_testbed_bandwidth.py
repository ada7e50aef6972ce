"""The bandwidth-bound testbed variant (``testbed/bandwidth.py``) on a tiny Qwen2-MoE: the
padded checkpoint computes the same logits and routing, its extra down-projection columns
are zero, its config names the width, the build is deterministic, and the width gives the
routed experts Qwen3-235B-A22B's share of a layer's reads; ``testbed path --bandwidth``."""

import argparse
import json

import pytest
import torch
from _models import tiny_target
from safetensors import safe_open

from sgl_ecospec.lab import numerics
from sgl_ecospec.lab.testbed import bandwidth, command

pytestmark = pytest.mark.usefixtures("one_thread")
# From the tiny target's 32: a partial repeat (transformers' grouped matmul needs rows of a
# multiple of 16 bytes).
WIDTH = 44


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(source, padded) checkpoint directories of the tiny target."""
    root = tmp_path_factory.mktemp("bandwidth")
    tiny_target().save_pretrained(root / "source")
    bandwidth.pad_checkpoint(root / "source", root / "padded", WIDTH, log=lambda _: None)
    return root / "source", root / "padded"


def tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            out.update({name: handle.get_tensor(name) for name in handle.keys()})
    return out


def test_padded_model_computes_the_same_logits_and_routing(checkpoints):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    outputs = []
    for directory in checkpoints:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        with torch.no_grad():
            outputs.append(model(ids, output_router_logits=True))
    source, padded = outputs
    assert padded.logits.shape == source.logits.shape
    torch.testing.assert_close(padded.logits, source.logits, rtol=1e-5, atol=1e-5)
    assert len(padded.router_logits) == len(source.router_logits) == 4
    for before, after in zip(source.router_logits, padded.router_logits, strict=True):
        torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
        assert torch.equal(after.topk(4).indices, before.topk(4).indices)


def test_extra_neurons_repeat_gate_and_up_rows_and_write_nothing(checkpoints):
    source, padded = (tensors(directory) for directory in checkpoints)
    assert sorted(padded) == sorted(source)
    experts = [name for name in source if ".mlp.experts." in name]
    assert len(experts) == 4 * 16 * 3
    for name in experts:
        before, after = source[name], padded[name]
        if name.endswith("down_proj.weight"):
            assert after.shape == (before.shape[0], WIDTH)
            assert torch.equal(after[:, :32], before) and not after[:, 32:].any()
        else:
            assert after.shape == (WIDTH, before.shape[1])
            assert torch.equal(after[:32], before) and torch.equal(after[32:], before[:12])
    for name in set(source) - set(experts):
        assert torch.equal(padded[name], source[name]), name


def test_config_names_the_width_and_the_index_every_tensor(checkpoints):
    source, padded = checkpoints
    before = json.loads((source / "config.json").read_text())
    after = json.loads((padded / "config.json").read_text())
    assert after.pop("moe_intermediate_size") == WIDTH
    assert before.pop("moe_intermediate_size") == 32
    assert after == before
    index = json.loads((padded / bandwidth.INDEX_FILE).read_text())
    assert sorted(index["weight_map"]) == sorted(tensors(padded))
    assert len(set(index["weight_map"].values())) == 4 + 1  # a shard per layer, one more
    assert (padded / "generation_config.json").is_file()


def test_the_build_is_deterministic(checkpoints, tmp_path):
    source, padded = checkpoints
    bandwidth.pad_checkpoint(source, tmp_path / "again", WIDTH, log=lambda _: None)
    first = numerics.weights_sha256(padded)
    assert first == numerics.weights_sha256(tmp_path / "again")
    assert first != numerics.weights_sha256(source)


def test_the_width_gives_qwen3_235b_a22b_routed_share():
    qwen = bandwidth.QWEN3_235B_A22B.weights_read()
    assert qwen["attention"] == 4096 * (2 * 64 * 128 + 2 * 4 * 128)
    assert qwen["routed_experts"] == 8 * 3 * 4096 * 1536 and qwen["router"] == 4096 * 128
    share = bandwidth.QWEN3_235B_A22B.routed_share()
    assert share == pytest.approx(150994944 / 222822400)
    # The full testbed: hidden 576, 9 / 3 heads of 64, 64 experts top-8 of 4 neurons, a
    # 1280-neuron shared expert.
    testbed = bandwidth.MoeLayerShape(576, 9, 3, 64, 64, 8, 4, 1280)
    assert testbed.routed_share() < 0.02
    width = bandwidth.padded_width(testbed, share)
    assert width == 480 and width % bandwidth.WIDTH_MULTIPLE == 0
    padded = bandwidth.MoeLayerShape(576, 9, 3, 64, 64, 8, width, 1280)
    assert padded.routed_share() == pytest.approx(share, abs=0.005)


def test_invalid_widths_and_shares_are_refused():
    with pytest.raises(ValueError, match="cannot pad 4 neurons to 3"):
        bandwidth.pad_expert("down", torch.zeros(8, 4), 3)
    with pytest.raises(ValueError, match="share must be in"):
        bandwidth.padded_width(bandwidth.QWEN3_235B_A22B, 1.0)


def test_the_command_prints_the_variant_and_refuses_two_variants(monkeypatch, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers(dest="command"))
    monkeypatch.setattr(bandwidth, "build", lambda force: tmp_path)
    args = parser.parse_args(["testbed", "path", "--bandwidth"])
    assert args.run(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"target={tmp_path / 'target'}", f"draft={tmp_path / 'draft'}"]
    with pytest.raises(SystemExit):
        parser.parse_args(["testbed", "path", "--small", "--bandwidth"])
    assert "not allowed with argument" in capsys.readouterr().err
