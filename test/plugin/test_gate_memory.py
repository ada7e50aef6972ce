"""The gate's memory: a restarted server's gate starts from the decisions an earlier one
wrote under the same key, ignores a file of another key or a broken one, and the key follows
what the gate's figures depend on."""

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from sglang_ecospec import gate as plugin_gate
from sglang_ecospec import gate_memory
from sglang_ecospec.settings import EcoSpecSettings

from sgl_ecospec.gate import GateOptions

OPTIONS = GateOptions(probe_interval=30, max_probe_interval=30, probe_steps=3, min_samples=3)


def serve(policy, steps, batch_size, spec_seconds=0.3, plain_seconds=0.1, accepted=0.5):
    """Steps of a server whose tree loses (0.5 accepted drafts at 3x a plain step's time),
    results in step order; returns the step counts chosen."""
    chosen = []
    for _ in range(steps):
        level = policy.get_steps_for_batch(batch_size)
        chosen.append(level)
        seconds = spec_seconds if level else plain_seconds
        policy._pending.append((batch_size, policy._level, seconds, policy._stale))
        policy.on_verify_complete([accepted if level else 0] * batch_size, batch_size)
    return chosen


def checkpoint(root, name, hidden=64):
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    return str(path)


def server_args(tmp_path, num_steps=3):
    return SimpleNamespace(
        model_path=checkpoint(tmp_path, "target"),
        speculative_draft_model_path=checkpoint(tmp_path, "draft"),
        speculative_num_steps=num_steps,
        speculative_eagle_topk=4,
        speculative_num_draft_tokens=6,
        tp_size=1,
        ep_size=1,
    )


def key_of(args, settings=None, levels=(0, 3)):
    settings = settings or EcoSpecSettings()
    return gate_memory.memory_key(args, settings, levels, torch.float32, "cpu test")


def test_a_restarted_server_starts_from_the_decisions_of_the_last(tmp_path, caplog):
    key = key_of(server_args(tmp_path))
    memory = (gate_memory.memory_file(tmp_path / "gate", key), key)
    first = plugin_gate.GatePolicy(3, OPTIONS, "cpu", memory=memory)
    chosen = serve(first, 20, 16)
    assert chosen[:2] == [3, 3] and chosen[-5:] == [0] * 5  # measured, then closed
    assert memory[0].is_file()
    saved = json.loads(memory[0].read_text())
    assert saved["key"] == key and saved["buckets"]["16"]["level"] == 0

    with caplog.at_level(logging.INFO, logger=plugin_gate.__name__):
        restarted = plugin_gate.GatePolicy(3, OPTIONS, "cpu", memory=memory)
    assert "batch sizes 9-16 decode plainly" in caplog.text and "restored from" in caplog.text
    # No tree step before the first probe, probe_interval steps on.
    assert serve(restarted, 30, 16) == [0] * 30
    state = restarted.gate.state(16)
    assert state.settled and state.utility == pytest.approx(first.gate.state(16).utility)
    # Nothing restored measured at batch size 1 either: it starts from its neighbour's level.
    assert serve(restarted, 3, 1) == [0, 0, 0]
    assert restarted.draft_prefill_needed(16) is False


def test_a_bucket_that_only_inherited_its_state_is_not_remembered(tmp_path):
    key = key_of(server_args(tmp_path), levels=(0, 1, 3))
    memory = (gate_memory.memory_file(tmp_path / "gate", key), key)
    first = plugin_gate.GatePolicy(3, OPTIONS, "cpu", narrow=True, memory=memory)
    # The narrow level pays at 9-16 (1.5 tokens at 1.2x a plain step), the tree does not.
    for _ in range(40):
        level = first.get_steps_for_batch(16)
        seconds, accepted = {0: (0.1, 0), 1: (0.12, 0.5), 3: (0.3, 0.5)}[level]
        first._pending.append((16, first._level, seconds, first._stale))
        first.on_verify_complete([accepted] * 16, 16)
    assert first.gate.state(16).level == 1
    # A warmup request at batch size 1 runs the inherited level, with no plain figure.
    serve(first, 3, 1, spec_seconds=0.05)
    first.gate.record(16, 1, 0.12, 1.5)  # a decision of 9-16 writes the memory again
    first._changed(16, first.gate.state(16))
    saved = json.loads(memory[0].read_text())["buckets"]
    assert first.gate.state(1).open and list(saved) == ["16"]
    restarted = plugin_gate.GatePolicy(3, OPTIONS, "cpu", narrow=True, memory=memory)
    assert restarted.gate.buckets() == [16]


def test_a_file_of_another_key_or_a_broken_one_is_ignored(tmp_path, caplog):
    args = server_args(tmp_path)
    key = key_of(args)
    path = gate_memory.memory_file(tmp_path, key)
    serve(plugin_gate.GatePolicy(3, OPTIONS, "cpu", memory=(path, key)), 20, 16)
    other = key_of(args, EcoSpecSettings(eps=0.3))
    assert other != key
    with caplog.at_level(logging.WARNING, logger=gate_memory.__name__):
        fresh = plugin_gate.GatePolicy(3, OPTIONS, "cpu", memory=(path, other))
    assert "another key" in caplog.text and fresh.gate.buckets() == []
    assert serve(fresh, 2, 16) == [3, 3]  # measures anew

    for text in ("{not json", '{"key": null}', json.dumps({"key": key, "buckets": {"3": {}}})):
        path.write_text(text)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=gate_memory.__name__):
            policy = plugin_gate.GatePolicy(3, OPTIONS, "cpu", memory=(path, key))
        assert "ignored" in caplog.text and policy.gate.buckets() == []
    # A bucket of other levels (a file edited by hand): none of the file is taken.
    saved = {"level": 0, "plain_time": 0.1, "speculative": [[1, 0.2, 1.5]]}
    path.write_text(json.dumps({"key": key, "buckets": {"1": saved, "4": saved}}))
    policy = plugin_gate.GatePolicy(3, OPTIONS, "cpu", memory=(path, key))
    assert policy.gate.buckets() == []


def test_a_memory_that_cannot_be_written_is_a_warning(tmp_path, caplog):
    key = key_of(server_args(tmp_path))
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    policy = plugin_gate.GatePolicy(3, OPTIONS, "cpu", memory=(blocked / "gate.json", key))
    with caplog.at_level(logging.WARNING, logger=gate_memory.__name__):
        assert serve(policy, 20, 16)[-1] == 0
    assert "cannot write" in caplog.text


def test_only_rank0_writes(tmp_path):
    group = SimpleNamespace(rank=1, ranks=[0, 1])
    memory = (tmp_path / "gate.json", {})
    assert plugin_gate.GatePolicy(3, OPTIONS, "cpu", group, memory=memory).memory is None
    group.rank = 0
    assert plugin_gate.GatePolicy(3, OPTIONS, "cpu", group, memory=memory).memory == memory


def test_the_key_follows_what_the_figures_depend_on(tmp_path):
    args = server_args(tmp_path)
    key = key_of(args)
    assert key == key_of(args)
    assert key_of(args, EcoSpecSettings(log_interval=1, gate_memory="off")) == key
    assert key_of(args, EcoSpecSettings(min_score=0.0)) != key
    assert key_of(args, levels=(0, 1, 3)) != key
    assert key_of(SimpleNamespace(**{**vars(args), "speculative_eagle_topk": 2})) != key
    (tmp_path / "draft" / "config.json").write_text(json.dumps({"hidden_size": 32}))
    assert key_of(args) != key
    path = gate_memory.memory_file(tmp_path, key)
    assert path.parent == tmp_path and path.name.startswith("target-")


def test_the_memory_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("SGL_ECOSPEC_CACHE", str(tmp_path))
    assert gate_memory.memory_dir("auto") == tmp_path / "gate"
    assert gate_memory.memory_dir("off") is None
    assert gate_memory.memory_dir(str(tmp_path / "x")) == tmp_path / "x"
    assert EcoSpecSettings().gate_memory == "auto"
    with pytest.raises(ValueError, match="gate_memory"):
        EcoSpecSettings(gate_memory=" ")
