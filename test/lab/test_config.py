"""The typed run configurations (``sgl_ecospec.lab.config``): the JSON ``config`` they
serialize to, and where the models come from (the testbed only when a command asks)."""

import argparse
import dataclasses

import pytest

from sgl_ecospec.lab import config
from sgl_ecospec.lab.bench import cli as bench_cli
from sgl_ecospec.lab.bench import sweep, train_head
from sgl_ecospec.lab.config import BenchConfig, SweepConfig, TrainHeadConfig, with_models
from sgl_ecospec.ops.options import SERVED_MIN_SCORE

# scripts/run_main.sh's bench command.
RUN_MAIN = (
    "--dataset mt-bench,humaneval --num-prompts 4 --max-new-tokens 48 --batch-size 1 --topk 4 "
    "--steps 3 --budget 4 --budgets 1,2,4 --policy confidence,ecospec --check-lossless "
    "--profile qwen3-235b-a22b --hardware h200 --json results/bench.json "
    "--plot results/bench_experts.png"
).split()
# The keys, in order, of the dict the untyped ``validate`` returned (the JSON contract), and
# those added since at the end (bench's ``paired``).
BENCH_KEYS = [
    "datasets", "num_prompts", "seed", "max_new_tokens", "batch_size", "topk", "steps",
    "candidates", "budget", "budgets", "policies", "predictor", "predictor_file", "eps",
    "share_buffer", "calibrated_acceptance", "recall_weighted_cost", "min_score", "target",
    "draft", "small",
    "device", "dtype", "profile", "hardware", "check_lossless", "save_predictor", "paired",
    "round_sync",
]  # fmt: skip
SWEEP_KEYS = [
    "batch_sizes", "policies", "ep_sizes", "profiles", "hardware", "dataset", "num_prompts",
    "seed", "max_new_tokens", "topk", "steps", "candidates", "budget", "share_buffer",
    "predictor", "predictor_file", "paired", "recall_weighted_cost", "target", "draft", "small",
    "device", "dtype",
    "check_lossless",
]  # fmt: skip


def _parse(module, command, argv):
    parser = argparse.ArgumentParser(prog="sgl-ecospec")
    module.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args([command, *argv])


def test_bench_config_serializes_as_the_old_dict():
    cfg = BenchConfig.from_args(_parse(bench_cli, "bench", RUN_MAIN))
    assert list(cfg.to_dict()) == BENCH_KEYS
    resolved = dataclasses.replace(cfg, target="/t", draft="/d")
    assert resolved.to_dict() == {
        "datasets": ["mt-bench", "humaneval"],
        "num_prompts": 4,
        "seed": 0,
        "max_new_tokens": 48,
        "batch_size": 1,
        "topk": 4,
        "steps": 3,
        "candidates": 36,
        "budget": 4,
        "budgets": [1, 2, 4],
        "policies": ["confidence", "ecospec"],
        "predictor": "online",
        "predictor_file": None,
        "eps": cfg.eps,
        "share_buffer": True,
        "calibrated_acceptance": False,
        "recall_weighted_cost": True,
        "min_score": SERVED_MIN_SCORE,
        "target": "/t",
        "draft": "/d",
        "small": False,
        "device": "cpu",
        "dtype": "float32",
        "profile": "qwen3-235b-a22b",
        "hardware": "h200",
        "check_lossless": True,
        "save_predictor": None,
        "paired": False,
        "round_sync": False,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.budget = 8


def test_sweep_and_train_head_configs():
    cfg = SweepConfig.from_args(_parse(sweep, "sweep", ["--policies", "adaptive,confidence"]))
    assert list(cfg.to_dict()) == SWEEP_KEYS and cfg.policies == ("confidence", "adaptive")
    assert SweepConfig() == SweepConfig.from_args(_parse(sweep, "sweep", []))
    # Constructed directly, a configuration is checked as well.
    with pytest.raises(ValueError, match=r"budget 36 must be in \[1, 35\]"):
        SweepConfig(budget=36)
    with pytest.raises(ValueError, match="--eps must be > 0"):
        BenchConfig(eps=0.0)
    head = TrainHeadConfig.from_args(_parse(train_head, "train-head", ["--out", "h.pt"]))
    assert head.datasets == ("sharegpt",) and head.to_dict()["datasets"] == ["sharegpt"]
    with pytest.raises(ValueError, match="--val-fraction must be in"):
        TrainHeadConfig(val_fraction=1.0)


def test_models_are_resolved_explicitly(monkeypatch, tmp_path):
    given = BenchConfig(target="/t", draft="/d")
    assert with_models(given, build_testbed=True) is given
    cfg = BenchConfig(small=True)
    with pytest.raises(ValueError, match="does not build the testbed"):
        with_models(cfg, build_testbed=False)
    calls = []
    monkeypatch.setattr(config, "testbed_models", lambda small: calls.append(small) or ("T", "D"))
    resolved = with_models(cfg, build_testbed=True)
    assert (resolved.target, resolved.draft, calls) == ("T", "D", [True])
    assert cfg.target is None  # a copy: the configuration itself is never changed
