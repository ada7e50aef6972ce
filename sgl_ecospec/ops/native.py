"""Access to the compiled extension ``sgl_ecospec._C`` and the choice of implementation.

Every op has a plain PyTorch reference; the extension is a fast path. Importing the package
never fails because the extension is missing: ``impl="auto"`` falls back to the reference
with one warning that says how to build it.
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
_BUILD_HINT = (
    "build it with `bash scripts/setup_env.sh` (or `pip install -e . --no-build-isolation` "
    "in an environment that has torch)"
)
_warned = False


def has_native() -> bool:
    """True when the compiled extension ``sgl_ecospec._C`` is importable."""
    return NATIVE_ERROR is None


def has_native_kernel(op: str, device: torch.device) -> bool:
    """True when ``torch.ops.sgl_ecospec.<op>`` has a kernel for ``device``'s backend (the
    CUDA kernels exist only in builds made with a CUDA toolkit)."""
    if not has_native():
        return False
    key = "CUDA" if device.type == "cuda" else "CPU"
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"sgl_ecospec::{op}", key)


def use_native(impl: str, op: str, device: torch.device) -> bool:
    """Resolves ``impl`` ("auto", "native" or "reference") to whether the compiled ``op``
    runs for tensors on ``device``."""
    global _warned
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return False
    if has_native_kernel(op, device):
        return True
    reason = (
        f"sgl_ecospec._C is not available ({NATIVE_ERROR})"
        if not has_native()
        else f"sgl_ecospec._C was built without {device.type} kernels"
    )
    if impl == "native":
        raise RuntimeError(f"{reason}; {_BUILD_HINT}")
    if not _warned:
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
