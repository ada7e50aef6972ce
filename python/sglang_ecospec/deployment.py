"""ECOSPEC's startup checks: server configurations where ECOSPEC would start but not work.

:func:`check_startup` runs once, when the ECOSPEC worker starts
(``algorithm.EcoSpecWorker.__init__``, before SGLang's EAGLE worker is built). There SGLang's
server arguments are final: its automatic choices (the draft tree when no tree flag is given,
MoE backends, parallel widths) were made after the launcher's ``validate_server_args`` ran.
Each refusal is a :class:`DeploymentError` that names the server flag to change:

- a draft tree with nothing to select: ``--speculative-eagle-topk`` 1 (SGLang's automatic
  choice, steps 3, topk 1, 4 draft tokens, for Qwen3-MoE, DeepSeek-V3, GPT-OSS and most other
  models) makes SGLang draft a chain and never call the selection; a
  ``--speculative-num-draft-tokens`` that verifies every candidate leaves no choice;
- MoE inputs whose first rows are not this rank's verify tokens, where the routing capture
  (:mod:`sglang_ecospec.routing`) would read other tokens' routing: attention data
  parallelism without an all-to-all MoE backend (the MoE layers route the tokens of all DP
  ranks, gathered into one buffer), and an all-to-all MoE backend with attention TP above 1
  (each attention-TP rank routes a shard of the tokens, ``is_moe_input_scattered_across_dp_ranks``
  in SGLang's ``layers/moe/utils.py``);
- a CUDA device without the CUDA kernels of ``sgl_ecospec._C`` (a build without a CUDA
  toolkit, or none at all).
"""

import torch

from sgl_ecospec.ops import native

ALGORITHM_FLAG = "--speculative-algorithm ECOSPEC"
TREE_EXAMPLE = (
    "--speculative-num-steps 3 --speculative-eagle-topk 4 --speculative-num-draft-tokens 8"
)
BUILD_HINT = (
    "build them where the server runs, with the CUDA toolkit installed and CUDA_HOME set: "
    "`pip install --no-build-isolation .` in the sgl-ecospec source tree (SGL_ECOSPEC_CUDA=1 "
    "makes a missing toolkit an error), or `bash scripts/setup_env.sh`"
)


class DeploymentError(ValueError):
    """A server configuration ECOSPEC refuses; the message names the flag to change."""


def check_startup(server_args, device: str | torch.device | None = None) -> None:
    """Every startup check, on SGLang's resolved server arguments.

    Args:
        server_args: SGLang's ``ServerArgs`` after resolution (``resolve_once``).
        device: the worker's device; None: the resolved ``--device``.

    Raises:
        DeploymentError: the first check that fails.
    """
    from sglang.srt.arg_groups.model_override_base import resolved_view

    view = resolved_view(server_args)
    check_draft_tree(
        view.speculative_eagle_topk, view.speculative_num_steps, view.speculative_num_draft_tokens
    )
    check_moe_rows(view)
    check_native_ops(torch.device(device if device is not None else view.device))


def num_candidates(topk: int, num_steps: int) -> int:
    """N = K + (S - 1) K^2: the candidates of SGLang's draft tree."""
    return topk + (num_steps - 1) * topk * topk


def check_draft_tree(topk: int | None, steps: int | None, num_draft_tokens: int | None) -> None:
    """Refuses a draft tree where selection has nothing to choose (None: not decided yet)."""
    if topk is not None and topk <= 1:
        raise DeploymentError(
            f"{ALGORITHM_FLAG} needs a draft tree, but --speculative-eagle-topk is {topk} "
            "(SGLang chooses topk 1 for most models when --speculative-num-steps, "
            "--speculative-eagle-topk and --speculative-num-draft-tokens are not given): with "
            "topk 1 SGLang drafts a chain and never calls ECOSPEC's verify-set selection. Set "
            "--speculative-eagle-topk above 1 with a matching --speculative-num-draft-tokens, "
            f"e.g. {TREE_EXAMPLE}"
        )
    if topk is None or steps is None or num_draft_tokens is None:
        return
    candidates = num_candidates(topk, steps)
    if num_draft_tokens - 1 >= candidates:
        raise DeploymentError(
            f"{ALGORITHM_FLAG}: --speculative-num-draft-tokens {num_draft_tokens} verifies all "
            f"{candidates} draft candidates of the tree (--speculative-eagle-topk {topk}, "
            f"--speculative-num-steps {steps}) plus the bonus token, so there is nothing to "
            f"select: set --speculative-num-draft-tokens to at most {candidates}, e.g. "
            f"{TREE_EXAMPLE}"
        )


def check_moe_rows(view) -> None:
    """Refuses parallel layouts where the MoE layers' first rows are not this rank's verify
    tokens (``view``: resolved server arguments)."""
    from sglang.srt.runtime_context import attn_dp_enabled_of, attn_tp_size_of

    a2a = view.moe_a2a_backend or "none"
    attn_tp = attn_tp_size_of(view)
    if a2a != "none" and attn_tp > 1:
        raise DeploymentError(
            f"{ALGORITHM_FLAG} cannot capture the verify tokens' routing with "
            f"--moe-a2a-backend {a2a} and attention TP {attn_tp}: each attention-TP rank "
            "routes only its shard of the tokens, so the captured rows are not the verify "
            "tokens. Use --moe-a2a-backend none, or attention TP 1 (--enable-dp-attention "
            "with --dp-size equal to --tp-size)"
        )
    if a2a == "none" and attn_dp_enabled_of(view):
        raise DeploymentError(
            f"{ALGORITHM_FLAG} does not support attention data parallelism "
            f"(--enable-dp-attention / --attn-dp-size, here {view.attn_dp_size} DP ranks) with "
            "--moe-a2a-backend none: the MoE layers route the tokens of all DP ranks gathered "
            "into one buffer, so this rank's verify tokens are not the rows the routing "
            "capture reads. Remove --enable-dp-attention (or --attn-dp-size), or use an "
            "all-to-all MoE backend (--moe-a2a-backend deepep) with attention TP 1"
        )


def check_native_ops(device: torch.device) -> None:
    """Refuses a CUDA device without the compiled CUDA ops (the PyTorch reference would
    stand in for them in every decode step, far slower)."""
    if device.type != "cuda":
        return
    missing = [op for op in native.OPS if not native.has_native_kernel(op, device)]
    if not missing:
        return
    reason = (
        f"sgl_ecospec._C cannot be imported ({native.NATIVE_ERROR})"
        if not native.has_native()
        else "sgl_ecospec._C was built without CUDA kernels"
    )
    names = ", ".join(f"sgl_ecospec::{op}" for op in missing)
    raise DeploymentError(
        f"{ALGORITHM_FLAG} on {device} needs the CUDA ops {names}, but {reason}; {BUILD_HINT}"
    )
