"""``sgl-ecospec calibrate``: controlled routing on the tiny Qwen2-MoE target, the target's
cost-model profile, the command end to end on a minimal grid, its flag checks."""

import json
import re

import pytest
import torch
from _models import (
    AUX,
    EXPERTS,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    KV_HEADS,
    TOP_K,
    VOCAB,
    eagle3_draft,
    tiny_target,
)
from transformers import AutoModelForCausalLM

from sgl_ecospec.costmodel.calibration import CalibrationProfile
from sgl_ecospec.costmodel.forward_timing import ControlledRouting, TargetTimer, target_profile
from sgl_ecospec.lab.cli import main
from sgl_ecospec.models.target import TargetModel

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("calibrate")
    tiny_target().save_pretrained(root / "target")
    draft = eagle3_draft(torch.ones(VOCAB), HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, 256, AUX, 0.05)
    draft.save_pretrained(root / "draft")
    return root


@pytest.fixture(scope="module")
def target(models):
    return TargetModel(AutoModelForCausalLM.from_pretrained(models / "target"))


def _experts_inputs(target):
    """Hooks recording the expert ids each MoE layer's experts module is called with."""
    seen = {}

    def record(layer):
        def hook(module, args):
            seen[layer] = args[1].clone()  # (hidden_states, top_k_index, top_k_weights)

        return hook

    handles = [
        target.model.model.layers[i].mlp.experts.register_forward_pre_hook(record(i))
        for i in target.moe_layers
    ]
    return seen, handles


@pytest.mark.parametrize("batch, tokens, unique", [(1, 1, 4), (1, 3, 9), (2, 2, 16), (4, 4, 5)])
def test_controlled_routing_touches_exactly_the_requested_experts(target, batch, tokens, unique):
    routing = ControlledRouting(target, seed=1)
    seen, handles = _experts_inputs(target)
    cache = target.new_cache(batch)
    ids = torch.randint(VOCAB, (batch, tokens))
    positions = torch.arange(tokens).expand(batch, -1)
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril().expand(batch, -1, -1)
    try:
        routing.assign(batch * tokens, unique)
        out = target.forward(ids, positions, cache, mask)
    finally:
        routing.remove()
        for handle in handles:
            handle.remove()
    assert sorted(seen) == target.moe_layers
    for position, layer in enumerate(target.moe_layers):
        experts = seen[layer]  # what the experts module computed with: [B*T, K]
        assert experts.shape == (batch * tokens, TOP_K)
        assert experts.unique().numel() == unique
        # No token names an expert twice: each really runs K experts.
        assert all(row.unique().numel() == TOP_K for row in experts)
        # The target's routing capture records the forced routing.
        assert torch.equal(out.routing[:, :, position].reshape(-1, TOP_K), experts)


def test_controlled_routing_changes_the_output_and_clears(target):
    routing = ControlledRouting(target, seed=0)
    ids = torch.randint(VOCAB, (1, 4))
    positions = torch.arange(4)[None]
    mask = torch.ones(4, 4, dtype=torch.bool).tril()[None]
    try:
        own = target.forward(ids, positions, target.new_cache(1), mask)
        routing.assign(4, TOP_K)
        forced = target.forward(ids, positions, target.new_cache(1), mask)
        routing.clear()
        again = target.forward(ids, positions, target.new_cache(1), mask)
    finally:
        routing.remove()
    # All 4 tokens forced onto the same K experts: the routed computation changed.
    assert (forced.routing[0, :, 0].unique().numel()) == TOP_K
    assert not torch.allclose(own.logits, forced.logits)
    assert torch.equal(own.routing, again.routing) and torch.allclose(own.logits, again.logits)


def test_controlled_routing_rejects_impossible_counts(target):
    routing = ControlledRouting(target)
    try:
        with pytest.raises(ValueError, match=r"2 tokens of top-4 routing can touch 4..8"):
            routing.assign(2, 9)
        with pytest.raises(ValueError, match="can touch 4..16 experts per layer, not 3"):
            routing.assign(8, 3)
    finally:
        routing.remove()


def test_target_timer_reports_the_measured_union(target):
    routing = ControlledRouting(target, seed=2)
    timer = TargetTimer(target, routing, context=3, repeats=2)
    try:
        timing = timer(2, 3, 10)
    finally:
        routing.remove()
    assert timing.seconds > 0 and timing.unique_experts == 10.0
    cache = timer._cache(2)
    assert cache.pending == 0 and cache.lengths.tolist() == [3, 3]  # timed rows dropped


def test_target_profile_counts_every_parameter(target):
    profile = target_profile(target, "tiny", torch.float32, "tiny")
    model = target.model
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    routed = profile.moe_layers * profile.num_experts * profile.expert_params
    assert (profile.moe_layers, profile.num_experts, profile.top_k) == (4, EXPERTS, TOP_K)
    assert profile.dense_params + routed + embedding == total
    assert profile.bytes_per_expert == 4 * profile.expert_params
    assert profile.compute_dtype == "fp32"


def test_calibrate_command_on_a_minimal_grid(models, tmp_path, capsys):
    out = tmp_path / "profile.json"
    argv = ["calibrate", "--target", str(models / "target"), "--draft", str(models / "draft")]
    argv += ["--batch-sizes", "1,2", "--tokens", "1,3", "--unique-experts", "4,12"]
    argv += ["--repeats", "1", "--context", "4", "--prefill-tokens", "8,24", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "residuals: rms" in printed.out and f"wrote {out}" in printed.out
    assert "prefill line:" in printed.out and "prefill of 24 tokens" in printed.err
    assert "[calibrate 1/" in printed.err
    profile = CalibrationProfile.load(out)
    kinds = [p.kind for p in profile.points]
    # K = 4: (1,1): 4; (1,3): 4, 12; (2,1): 4, 8 (12 clamped); (2,3): 4, 12; then draft
    # and reject per batch size.
    assert kinds.count("ar") == 3 and kinds.count("verify") == 4
    assert kinds.count("draft") == 2 and kinds.count("reject") == 2
    assert profile.fixed == () and profile.model.num_experts == EXPERTS
    assert profile.device.startswith("cpu") and profile.dtype == "float32"
    unions = sorted(p.unique_experts for p in profile.points if p.kind == "verify")
    assert unions == [4.0, 4.0, 12.0, 12.0]
    assert sorted(p.unique_experts for p in profile.points if p.kind == "ar") == [4.0, 4.0, 8.0]
    assert json.loads(out.read_text())["grid"]["unique_experts"] == [4, 12]
    line = profile.prefill
    assert line.tokens == (8, 24) and all(s > 0 for s in line.seconds)
    assert line.base >= 0 and line.per_token >= 0 and line.predict(24) > 0
    none = tmp_path / "none.json"
    argv[argv.index("8,24")], argv[-1] = "none", str(none)
    assert main(argv) == 0 and CalibrationProfile.load(none).prefill is None


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch-sizes", "0,2"], "--batch-sizes must hold distinct integers >= 1"),
        (["--tokens", "1,x"], "--tokens must be comma-separated integers"),
        (["--unique-experts", "4,99"], r"unique_experts \[99\] exceed the model's 16 experts"),
        (["--repeats", "0"], "repeats must be an integer >= 1"),
        (["--prefill-tokens", "8,0"], "--prefill-tokens must hold distinct integers >= 1"),
        (["--context", "0"], "--context must be >= 1"),
        (["--threads", "0"], "--threads must be >= 1"),
        (["--device", "tpu"], "is not a torch device|must be cpu or cuda"),
        (["--draft", "/no/such/draft"], "--draft '/no/such/draft' is not a directory"),
    ],
)
def test_calibrate_flags_are_checked(models, tmp_path, capsys, flags, message):
    argv = ["calibrate", "--target", str(models / "target"), "--out", str(tmp_path / "p.json")]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err
    assert "sgl-ecospec calibrate: error:" in err
    assert re.search(message, err), err
    assert not (tmp_path / "p.json").exists()
