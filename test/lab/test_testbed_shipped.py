"""The testbed's machine-independent build (pinned numerics, weight hashes), resumable
draft training, and the shipped draft."""

import ctypes
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
from _models import TOY_SIZES as TOY
from safetensors.torch import load_file, save_file
from torch import nn

from sgl_ecospec.lab import numerics
from sgl_ecospec.lab.testbed import draft_training, recipe, shipped
from sgl_ecospec.models import eagle3


def test_weights_sha256_covers_tensors_not_file_layout(tmp_path):
    a, b = torch.arange(6.0).view(2, 3), torch.ones(4, dtype=torch.bfloat16)
    (tmp_path / "one").mkdir()
    save_file({"a": a, "b": b}, str(tmp_path / "one" / "model.safetensors"))
    (tmp_path / "two").mkdir()  # other file split, order and metadata
    save_file({"b": b}, str(tmp_path / "two" / "x.safetensors"), metadata={"k": "v"})
    save_file({"a": a}, str(tmp_path / "two" / "y.safetensors"))
    assert numerics.weights_sha256(tmp_path / "one") == numerics.weights_sha256(tmp_path / "two")
    flipped = a.clone()
    flipped.view(torch.int32)[0, 0] ^= 1  # one bit
    save_file({"a": flipped, "b": b}, str(tmp_path / "one" / "model.safetensors"))
    assert numerics.weights_sha256(tmp_path / "one") != numerics.weights_sha256(tmp_path / "two")
    save_file({"a": a.view(3, 2), "b": b}, str(tmp_path / "one" / "model.safetensors"))
    assert numerics.weights_sha256(tmp_path / "one") != numerics.weights_sha256(tmp_path / "two")


def test_weights_sha256_names_an_empty_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        numerics.weights_sha256(tmp_path)


def test_run_pinned_sets_the_environment_and_reports_failure(monkeypatch):
    for name in numerics.PINNED_ENV:
        monkeypatch.delenv(name, raising=False)
    assert not numerics.pinned()
    check = "from sgl_ecospec.lab import numerics; assert numerics.pinned()"
    numerics.run_pinned([sys.executable, "-c", check])
    with pytest.raises(RuntimeError, match="exit code 3"):
        numerics.run_pinned([sys.executable, "-c", "raise SystemExit(3)"])
    for name, value in numerics.pinned_env().items():
        monkeypatch.setenv(name, value)
    assert numerics.pinned()


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")
def test_a_pinned_process_runs_mkl_on_its_avx2_branch():
    """MKL honours MKL_CBWR=AVX2 only where it takes the CPU for an Intel one; on others
    (an AMD EPYC here) the pinned environment preloads the shim, else MKL would silently
    run its AUTO branch and the testbed's weights would come out other bits."""
    matmul = "import torch; torch.ones(64, 64) @ torch.ones(64, 64)"
    out = subprocess.run(
        [sys.executable, "-c", matmul],
        env={**os.environ, **numerics.pinned_env(), "MKL_VERBOSE": "1"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "CNR:AVX2,STRICT" in out, out


def test_the_mkl_shim_is_built_once_and_needs_a_compiler(tmp_path, monkeypatch):
    monkeypatch.setattr(numerics, "needs_mkl_shim", lambda: True)
    shim = numerics.mkl_intel_cpu_shim(tmp_path)
    assert shim.is_file() and shim.parent == tmp_path / "numerics"
    assert numerics.mkl_intel_cpu_shim(tmp_path) == shim  # cached
    assert ctypes.CDLL(str(shim)).mkl_serv_intel_cpu_true() == 1
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(numerics.PinningError, match="needs a C compiler"):
        numerics.mkl_intel_cpu_shim(tmp_path / "other")
    monkeypatch.setattr(numerics, "needs_mkl_shim", lambda: False)
    assert numerics.mkl_intel_cpu_shim(tmp_path / "other") is None


def _toy(seed=0):
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(8):
        tokens = (torch.randint(40, (1,), generator=gen) + torch.arange(12)) % 40
        top_ids = (tokens[:, None] + 1 + torch.arange(4)) % 40
        top_probs = torch.tensor([0.7, 0.1, 0.1, 0.1]).expand(12, 4).clone()
        aux = torch.randn(12, 32, generator=gen).bfloat16()
        samples.append(draft_training.Sample(tokens, aux, top_ids, top_probs))
    config = eagle3.Eagle3Config(**TOY, draft_vocab_size=40, aux_layer_ids=[0, 1])
    draft = eagle3.init_weights(eagle3.Eagle3Draft(config), seed=seed)
    embed = nn.Embedding.from_pretrained(torch.randn(40, 16, generator=gen))
    return draft, embed, samples


SPEC = dataclasses.replace(
    recipe.SMALL.draft, epochs=4, batch_tokens=48, lr=1e-2, ttt_steps=2, soft_top_k=4
)


@pytest.mark.parametrize("bf16", [False, True])
def test_train_draft_resumed_from_a_checkpoint_equals_one_run(tmp_path, bf16):
    spec = dataclasses.replace(SPEC, bf16_autocast=bf16)
    quiet = dict(log=lambda _: None)
    draft, embed, samples = _toy()
    whole = draft_training.train_draft(
        draft, embed, samples, spec, torch.Generator().manual_seed(1), **quiet
    )
    checkpoint = tmp_path / "ckpt.pt"
    part_draft, embed, samples = _toy()
    first = draft_training.train_draft(
        part_draft,
        embed,
        samples,
        spec,
        torch.Generator().manual_seed(1),
        checkpoint=checkpoint,
        until_epoch=2,
        **quiet,
    )
    assert len(first) == 2 and checkpoint.is_file()
    resumed_draft, embed, samples = _toy()  # a fresh process: weights come from the file
    resumed = draft_training.train_draft(
        resumed_draft,
        embed,
        samples,
        spec,
        torch.Generator().manual_seed(99),  # its state too
        checkpoint=checkpoint,
        **quiet,
    )
    assert resumed == whole
    for name, tensor in draft.state_dict().items():
        assert torch.equal(tensor, resumed_draft.state_dict()[name]), name


def _manifest(target_sha="ab" * 32):
    return {
        "target_sha256": target_sha,
        "command": "sgl-ecospec testbed train-draft",
        "spec": {},
        "data_tokens": {},
        "history": [],
        "acceptance": {},
        "trained": {},
    }


def test_shipped_draft_round_trips_and_is_found_by_target_hash(tmp_path):
    draft, _, _ = _toy()
    written = shipped.write(draft, tmp_path / "toy-v1", _manifest())
    assert written.name == "toy-v1" and written.manifest["dtype"] == "bfloat16"
    assert shipped.find("ab" * 32, root=tmp_path) == written
    assert shipped.find("cd" * 32, root=tmp_path) is None
    loaded = written.load()
    for name, tensor in draft.state_dict().items():
        expected = tensor.to(torch.bfloat16).float() if tensor.is_floating_point() else tensor
        assert torch.equal(loaded.state_dict()[name], expected), name


def test_a_damaged_or_incomplete_shipped_draft_is_refused(tmp_path):
    draft, _, _ = _toy()
    written = shipped.write(draft, tmp_path / "toy-v1", _manifest())
    path = written.path / "model.safetensors"
    weights = load_file(str(path))
    weights["fc.weight"][0, 0] += 1
    save_file(weights, str(path))
    with pytest.raises(ValueError, match="damaged.*git checkout"):
        written.load()
    manifest = json.loads((written.path / shipped.MANIFEST_FILE).read_text())
    del manifest["command"]
    (written.path / shipped.MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="lacks \\['command'\\]"):
        shipped.shipped_drafts(tmp_path)


def test_make_reproducible_reexecutes_the_command_pinned_then_fixes_threads(monkeypatch):
    calls = []
    monkeypatch.setattr(numerics.os, "execve", lambda *call: calls.append(call))
    for name in numerics.PINNED_ENV:
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    try:
        numerics.make_reproducible(["bench", "--reproducible", "--small"])
        ((program, argv, env),) = calls
        assert program == sys.executable
        assert argv == [
            sys.executable,
            "-m",
            "sgl_ecospec.lab.cli",
            "bench",
            "--reproducible",
            "--small",
        ]
        assert all(env[name] == value for name, value in numerics.pinned_env().items())
        for name, value in numerics.pinned_env().items():
            monkeypatch.setenv(name, value)
        calls.clear()
        numerics.make_reproducible(["bench"])  # already pinned: runs on, fixed threads
        assert calls == [] and torch.get_num_threads() == numerics.REPRODUCIBLE_THREADS
    finally:
        torch.set_num_threads(before)


def test_the_shipped_full_draft_matches_the_full_recipes_target():
    drafts = shipped.shipped_drafts()
    assert [d.name for d in drafts] == ["full-v1"]
    full = drafts[0]
    assert full.target_sha256 == recipe.TARGET_SHA256["full"]
    assert full.manifest["command"].startswith("sgl-ecospec testbed train-draft")
    assert full.manifest["spec"] == json.loads(json.dumps(dataclasses.asdict(recipe.SHIPPED_DRAFT)))
    draft = full.load()  # checks the weights against the manifest's hash
    assert draft.config.draft_vocab_size == recipe.SHIPPED_DRAFT.vocab_size
    assert list(draft.config.aux_layer_ids) == list(recipe.FULL.draft.aux_layer_ids)
