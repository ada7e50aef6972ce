"""CPU development mode: the real SGLang server on a machine without a GPU.

sglang 0.5.23 installs CUDA wheels. To serve with ``--device cpu`` on a GPU-less machine, and
to run speculative decoding there, four things are ours (docs/sglang.md):

1. a stub ``libcuda.so.1`` (``stub_libcuda.c``, built by scripts/build_cpu_dev.sh) so that
   ``import sgl_kernel`` loads; scripts/launch_cpu.sh puts it on ``LD_LIBRARY_PATH``;
2. the ``sgl_kernel`` CPU ops the CUDA wheel lacks (:mod:`.ops`, registered through
   ``torch.library``);
3. the verify tree-mask layout chosen by attention backend (:func:`tree_mask_mode`): SGLang
   picks ``QLEN_ONLY`` whenever it runs on the CPU, a layout only the intel_amx kernel
   reads; the Triton backend (the one that verifies on this CPU, under
   ``TRITON_INTERPRET=1``) reads ``FULL_MASK``, and given ``QLEN_ONLY`` it reads wrong cells,
   so speculative output diverges from plain decoding;
4. the Triton backend's attention kernels in plain PyTorch (:mod:`.attention`): under the
   interpreter they took about 85% of a decode step;
5. the other Triton kernels of the speculative decode path in plain PyTorch
   (:mod:`.kernels`: the Qwen2-MoE shared-expert gate, the draft's KV lists), with the
   attention in PyTorch about 60% of the EAGLE3 scheduler's time.

:func:`enable_if_cpu` (called by the plugin entry point in every server process) turns 2-5
on only when SGLang serves on the CPU (``SGLANG_USE_CPU_ENGINE=1``) and torch sees no GPU:
the mode is never active on a GPU machine.
"""

import logging
import os

logger = logging.getLogger(__name__)

TREE_MASK_TARGET = "sglang.srt.speculative.eagle_utils.default_tree_mask_mode"
# The attention backends whose verify kernels read the QLEN_ONLY (D x D) tree mask.
QLEN_ONLY_BACKENDS = frozenset({"intel_amx"})
# Debug switch: ECOSPEC_CPU_KEEP_SGLANG_TREE_MASK=1 leaves SGLang's choice in place (to
# reproduce the divergence the fix removes).
KEEP_SGLANG_MASK_ENV = "ECOSPEC_CPU_KEEP_SGLANG_TREE_MASK"
# Debug switch: ECOSPEC_CPU_TRITON_ATTENTION=1 keeps SGLang's Triton attention kernels (run by
# the interpreter) instead of the PyTorch versions, to compare the two.
TRITON_ATTENTION_ENV = "ECOSPEC_CPU_TRITON_ATTENTION"
# Debug switch: ECOSPEC_CPU_TRITON_KERNELS=1 keeps SGLang's Triton shared-expert gate and draft
# KV-list kernels (run by the interpreter) instead of the PyTorch versions.
TRITON_KERNELS_ENV = "ECOSPEC_CPU_TRITON_KERNELS"

_enabled = False


def is_cpu_dev_mode() -> bool:
    """True when SGLang serves on the CPU (``SGLANG_USE_CPU_ENGINE=1``) and no GPU is visible."""
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") != "1":
        return False
    import torch

    return not torch.cuda.is_available()


def enable_if_cpu() -> bool:
    """Turns the CPU development mode on in this process when :func:`is_cpu_dev_mode`."""
    if not is_cpu_dev_mode():
        return False
    enable()
    return True


def enable() -> None:
    """Registers the missing CPU ops, the tree-mask hook and the PyTorch versions of the
    Triton kernels (idempotent)."""
    global _enabled
    if _enabled:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_ecospec_cpu import attention, kernels, ops

    ops.register_ops()

    def register_tree_mask_hook():
        HookRegistry.register(TREE_MASK_TARGET, tree_mask_mode, HookType.REPLACE)

    # Each part can be switched off by its debug variable, to compare with SGLang's own.
    parts = (
        (
            KEEP_SGLANG_MASK_ENV,
            "keeping SGLang's CPU tree-mask choice (QLEN_ONLY), which the Triton verify "
            "kernel misreads",
            register_tree_mask_hook,
        ),
        (
            TRITON_ATTENTION_ENV,
            "attention runs SGLang's Triton kernels under the interpreter (slow)",
            attention.register_hooks,
        ),
        (
            TRITON_KERNELS_ENV,
            "the shared-expert gate and the draft KV lists run SGLang's Triton kernels "
            "under the interpreter (slow)",
            kernels.register_hooks,
        ),
    )
    for env, kept, register in parts:
        if os.environ.get(env) == "1":
            logger.warning("%s=1: %s", env, kept)
        else:
            register()
    _enabled = True
    logger.info("sglang_ecospec: CPU development mode on (no GPU, SGLANG_USE_CPU_ENGINE=1)")


def mask_mode_for_backend(decode_backend: str | None):
    """The verify tree-mask layout that ``decode_backend``'s target-verify kernel reads."""
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode

    if decode_backend in QLEN_ONLY_BACKENDS:
        return TreeMaskMode.QLEN_ONLY
    return TreeMaskMode.FULL_MASK


def tree_mask_mode():
    """Replacement of ``eagle_utils.default_tree_mask_mode`` in CPU mode: by the attention
    backend that runs target verify (the decode backend), not by device."""
    from sglang.srt.runtime_context import attention_backends

    _, decode = attention_backends()
    return mask_mode_for_backend(decode)
