"""Input validation shared by the public ops: clear errors at the boundary."""

import math

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, t, *, ndim: int | None = None, dtypes=None, min_ndim: int = 0):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")


def check_shape(name: str, t: torch.Tensor, expected: tuple, what: str):
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} ({what}), got {tuple(t.shape)}")


def check_same_device(**tensors):
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")


def check_finite(name: str, value) -> float:
    """``value`` as a float; TypeError unless a real number, ValueError unless finite."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)


def check_positive(name: str, value) -> float:
    """``value`` as a float; the errors of :func:`check_finite`, and ValueError unless > 0."""
    value = check_finite(name, value)
    if not value > 0:
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return value


def check_int(name: str, value, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
