"""ECOSPEC's startup checks (``deployment.py``) on server arguments as SGLang resolves them:
each command line goes through ``sglang.launch_server``'s own parser and resolution
(``prepare_server_args`` + ``resolve_once``, on the CPU) against a model directory that holds
only a ``config.json``, as the worker receives them."""

import pytest
import torch
from sglang_ecospec import algorithm, deployment

from plugin._helpers import MOE_CONFIGS, write_model_configs
from sgl_ecospec.ops import native

TREE = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "4"]
TREE += ["--speculative-num-draft-tokens", "8"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A directory with one model directory (only its config.json) per MOE_CONFIGS name."""
    return write_model_configs(tmp_path_factory.mktemp("models"))


def server_args(models, *flags, model="qwen3-moe"):
    """``python -m sglang.launch_server`` with ``flags`` as the worker sees them: parsed by
    SGLang's parser and resolved (its automatic choices made)."""
    from sglang.srt.server_args import prepare_server_args

    algorithm.register_algorithm()
    argv = ["--model-path", str(models / model), "--skip-tokenizer-init", "--device", "cpu"]
    argv += ["--speculative-algorithm", "ECOSPEC"]
    argv += ["--speculative-draft-model-path", str(models / "qwen3-moe"), *flags]
    args = prepare_server_args(argv)
    args.resolve_once()
    return args


def resolved(args):
    from sglang.srt.arg_groups.model_override_base import resolved_view

    return resolved_view(args)


@pytest.mark.parametrize("model", sorted(MOE_CONFIGS))
def test_sglang_auto_chosen_chain_is_refused_naming_the_topk_flag(models, model):
    args = server_args(models, model=model)  # the launcher accepts: no tree flag given
    view = resolved(args)
    assert (view.speculative_num_steps, view.speculative_eagle_topk) == (3, 1)
    with pytest.raises(deployment.DeploymentError) as refused:
        deployment.check_startup(args)
    message = str(refused.value)
    assert "--speculative-eagle-topk is 1" in message
    assert "--speculative-eagle-topk above 1 with a matching --speculative-num-draft-tokens" in (
        message
    )


def test_a_tree_on_one_rank_is_accepted(models):
    args = server_args(models, *TREE)
    assert resolved(args).speculative_eagle_topk == 4
    deployment.check_startup(args)


def test_tree_flags_that_leave_nothing_to_select_are_refused_by_the_launcher(models):
    chain = ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1"]
    with pytest.raises(ValueError, match="--speculative-eagle-topk is 1"):
        server_args(models, *chain, "--speculative-num-draft-tokens", "4")
    # One step of topk 4 has 4 candidates: 5 draft tokens verify them all.
    whole = ["--speculative-num-steps", "1", "--speculative-eagle-topk", "4"]
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens 5 verifies all 4"):
        server_args(models, *whole, "--speculative-num-draft-tokens", "5")
    server_args(models, *whole, "--speculative-num-draft-tokens", "4")


def test_dp_attention_without_all_to_all_is_refused_naming_the_flag(models):
    args = server_args(models, *TREE, "--tp-size", "2", "--enable-dp-attention", "--dp-size", "2")
    assert resolved(args).moe_a2a_backend == "none"
    with pytest.raises(deployment.DeploymentError, match=r"--enable-dp-attention .* 2 DP ranks"):
        deployment.check_startup(args)


def test_all_to_all_with_attention_tp_is_refused_naming_the_flag(models):
    flags = ["--tp-size", "2", "--ep-size", "2", "--moe-a2a-backend", "deepep"]
    args = server_args(models, *TREE, *flags)
    with pytest.raises(
        deployment.DeploymentError, match="--moe-a2a-backend deepep and attention TP 2"
    ):
        deployment.check_startup(args)
    # DP attention with one attention-TP rank per DP rank: each rank routes its own tokens.
    dp = ["--tp-size", "2", "--enable-dp-attention", "--dp-size", "2"]
    deployment.check_startup(server_args(models, *TREE, *dp, "--moe-a2a-backend", "deepep"))


def test_cuda_without_the_compiled_ops_is_refused_with_build_instructions(models, monkeypatch):
    args = server_args(models, *TREE)
    kernels = {(op, key): True for op in native.OPS for key in ("CPU", "CUDA")}
    monkeypatch.setattr(native, "_KERNELS", kernels)
    deployment.check_startup(args, device="cuda")
    kernels[("select_verify_set", "CUDA")] = False
    with pytest.raises(deployment.DeploymentError) as refused:
        deployment.check_startup(args, device="cuda:0")
    message = str(refused.value)
    assert "sgl_ecospec::select_verify_set" in message and "CUDA_HOME" in message
    assert "pip install --no-build-isolation ." in message and "scripts/setup_env.sh" in message
    deployment.check_startup(args)  # the CPU (the resolved --device) needs no CUDA op
    deployment.check_native_ops(torch.device("cpu"))


def test_worker_checks_before_sglang_builds_it(monkeypatch):
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    built = []

    def sglang_init(self, *args):
        built.append(args)
        self._draft_worker = None  # no draft model: ECOSPEC builds no runtime

    monkeypatch.setattr(EAGLEWorkerV2, "__init__", sglang_init)

    def refuse(server_args):
        raise deployment.DeploymentError(f"refused {server_args}")

    monkeypatch.setattr(deployment, "check_startup", refuse)
    worker = algorithm.worker_class()
    with pytest.raises(deployment.DeploymentError, match="refused args"):
        worker("args", 0, 0, None)
    assert built == []
    monkeypatch.setattr(deployment, "check_startup", lambda server_args: None)
    worker("args", 0, 0, None)
    assert built == [("args", 0, 0, None)]


def test_the_cpu_keeps_the_overlap_scheduler_unless_told_otherwise(models):
    # SGLang turns it off for speculative decoding on the CPU; ECOSPEC keeps it (its plain
    # decoding steps then cost what the plain server's do), and the flag still wins.
    assert resolved(server_args(models, *TREE)).disable_overlap_schedule is False
    flag = "--disable-overlap-schedule"
    assert resolved(server_args(models, *TREE, flag)).disable_overlap_schedule is True
