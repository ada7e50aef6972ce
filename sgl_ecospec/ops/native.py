"""Access to the compiled extension ``sgl_ecospec._C`` and the choice of implementation.

Every op has a plain PyTorch reference; the extension is a fast path. Importing the package
never fails because the extension is missing. ``impl="auto"`` on CPU tensors falls back to
the reference with one warning that says how to build it; on CUDA tensors it raises instead
(the reference there is far slower than the kernels a serving path expects, so a build
without them must not pass unnoticed). ``impl="reference"`` is allowed everywhere.

The choice is made in Python from values fixed at import (which kernels the extension
registered), so ``torch.compile`` traces it without a graph break.
"""

import importlib
import warnings

import torch

try:
    # Importing the module registers torch.ops.sgl_ecospec.*.
    importlib.import_module("sgl_ecospec._C")
    NATIVE_ERROR: str | None = None
except ImportError as exc:
    NATIVE_ERROR = str(exc)

IMPLS = ("auto", "native", "reference")
OPS = ("topk_to_bitmap", "bitmap_popcount", "select_verify_set")
_BUILD_HINT = (
    "build it with `bash scripts/setup_env.sh` (or `pip install -e . --no-build-isolation` "
    "in an environment that has torch)"
)
_CUDA_BUILD_HINT = (
    "build the CUDA kernels with `bash scripts/setup_env.sh` (or `pip install "
    "--no-build-isolation -e .`) on a machine with a CUDA toolkit and CUDA_HOME set, or pass "
    'impl="reference" to run the (much slower) PyTorch reference on purpose'
)
_warned = False


def _registered_kernels() -> dict[tuple[str, str], bool]:
    """Whether ``torch.ops.sgl_ecospec.<op>`` has a kernel per (op, "CPU" / "CUDA"), read
    once: the dispatcher query is a host call that ``torch.compile`` cannot trace."""
    has = NATIVE_ERROR is None
    return {
        (op, key): has and torch._C._dispatch_has_kernel_for_dispatch_key(f"sgl_ecospec::{op}", key)
        for op in OPS
        for key in ("CPU", "CUDA")
    }


_KERNELS = _registered_kernels()


def has_native() -> bool:
    """True when the compiled extension ``sgl_ecospec._C`` is importable."""
    return NATIVE_ERROR is None


def has_native_kernel(op: str, device: torch.device) -> bool:
    """True when ``torch.ops.sgl_ecospec.<op>`` has a kernel for ``device``'s backend (the
    CUDA kernels exist only in builds made with a CUDA toolkit)."""
    return _KERNELS.get((op, "CUDA" if device.type == "cuda" else "CPU"), False)


def use_native(impl: str, op: str, device: torch.device) -> bool:
    """Resolves ``impl`` ("auto", "native" or "reference") to whether the compiled ``op``
    runs for tensors on ``device``.

    Raises:
        ValueError: ``impl`` is not one of :data:`IMPLS`.
        RuntimeError: ``impl="native"`` without the kernel for ``device``, or ``impl="auto"``
            on a CUDA device without the CUDA kernel.
    """
    global _warned
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return False
    if has_native_kernel(op, device):
        return True
    if device.type == "cuda":
        reason = (
            f"the CUDA op sgl_ecospec::{op} is missing: sgl_ecospec._C is not available "
            f"({NATIVE_ERROR})"
            if not has_native()
            else f"the CUDA op sgl_ecospec::{op} is missing: sgl_ecospec._C was built without "
            "CUDA kernels"
        )
        raise RuntimeError(f"{reason}; {_CUDA_BUILD_HINT}")
    reason = (
        f"sgl_ecospec._C is not available ({NATIVE_ERROR})"
        if not has_native()
        else f"sgl_ecospec._C was built without {device.type} kernels"
    )
    if impl == "native":
        raise RuntimeError(f"{reason}; {_BUILD_HINT}")
    # A warning cannot be traced: torch.compile skips it, and the next eager call warns.
    if not _warned and not torch.compiler.is_compiling():
        warnings.warn(
            f"{reason}; using the PyTorch reference ops, which are much slower: {_BUILD_HINT}",
            RuntimeWarning,
            stacklevel=3,
        )
        _warned = True
    return False


def ops():
    """The registered native ops namespace, ``torch.ops.sgl_ecospec``."""
    return torch.ops.sgl_ecospec
