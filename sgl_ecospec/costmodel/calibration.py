"""Calibration on the running hardware: the MoESD model fitted to timed forwards, and the
profile file that carries the fit to the server (docs/costmodel.md, "Calibration").

1. ``measure_hardware``: the device's memory bandwidth and matmul FLOP/s, so that the
   roofline knee (``ridge_tokens``) sits where this device's does.
2. ``time_grid``: calls the caller's timers at every point of a ``CalibrationGrid``: target
   forwards over batch x tokens-per-request tokens whose routing touches a chosen number
   of unique experts per MoE layer, and optionally draft and accept/reject steps.
3. ``calibrate``: fits the ten parameters (``fit_params`` without the roofline's load-time
   bounds: a real stack's step carries overheads no load time bounds; the unique-expert
   term k2 N is fitted on the measured unions) and returns a ``CalibrationProfile`` with
   per-point relative residuals (and the measured prefill line,
   :mod:`sgl_ecospec.costmodel.prefill`, where prefills were timed); ``save`` / ``load``
   write and check its JSON file.

The prior (``analytic_params``) stays the fallback where no profile is given.
"""

import dataclasses
import datetime
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from sgl_ecospec.costmodel.performance import (
    PARAM_NAMES,
    MoESDParams,
    PerformanceModel,
    TimingPoint,
    fit_params,
)
from sgl_ecospec.costmodel.prefill import PrefillLine
from sgl_ecospec.costmodel.profiles import HardwareProfile, ModelProfile

FORMAT = "sgl-ecospec-calibration/1"
# torch dtype name -> ModelProfile.compute_dtype.
COMPUTE_DTYPE_OF = {"float32": "fp32", "bfloat16": "bf16"}


class CalibrationFileError(ValueError):
    """A calibration profile file is missing, not JSON, of another format or inconsistent."""


class ForwardTiming(NamedTuple):
    """One timed target forward: median seconds over the repeats, and the distinct routed
    experts per MoE layer it really touched (mean over layers, as routed)."""

    seconds: float
    unique_experts: float


def _check_sizes(name: str, values: Sequence[int]) -> tuple[int, ...]:
    values = tuple(values)
    if not values:
        raise ValueError(f"{name} is empty: give at least one value")
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{name} must hold integers >= 1, got {value!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"{name} repeats a value: {list(values)}")
    return tuple(int(v) for v in values)


@dataclasses.dataclass(frozen=True)
class CalibrationGrid:
    """Where the target is timed.

    Attributes:
        batch_sizes: requests per forward (B).
        tokens_per_request: tokens each request adds in the forward (1: a decode step,
            gamma > 1: a verify pass over gamma tokens).
        unique_experts: distinct routed experts per MoE layer the forward's routing is
            forced to touch; each is clamped to what B x gamma tokens can touch,
            [top_k, min(num_experts, B gamma top_k)] (``target_points``).
        repeats: timed forwards per point (the median counts), after one warm-up.
        prefill_tokens: prompt lengths of the one-request prefills timed for the prefill
            line (:mod:`sgl_ecospec.costmodel.prefill`); empty: none.
    """

    batch_sizes: tuple[int, ...]
    tokens_per_request: tuple[int, ...]
    unique_experts: tuple[int, ...]
    repeats: int = 5
    prefill_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("batch_sizes", "tokens_per_request", "unique_experts"):
            object.__setattr__(self, name, _check_sizes(name, getattr(self, name)))
        if self.prefill_tokens:
            prefill = _check_sizes("prefill_tokens", self.prefill_tokens)
            object.__setattr__(self, "prefill_tokens", prefill)
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be an integer >= 1, got {self.repeats!r}")

    def target_points(self, num_experts: int, top_k: int) -> list[tuple[int, int, int]]:
        """(batch, tokens per request, unique experts) of every target forward to time:
        each unique count clamped to what the forward's tokens can touch, duplicates
        dropped; ordered by batch, then tokens, then unique experts."""
        too_many = [u for u in self.unique_experts if u > num_experts]
        if too_many:
            raise ValueError(
                f"unique_experts {too_many} exceed the model's {num_experts} experts per layer"
            )
        points = []
        for batch in sorted(self.batch_sizes):
            for tokens in sorted(self.tokens_per_request):
                most = min(num_experts, batch * tokens * top_k)
                counts = sorted({min(max(u, top_k), most) for u in self.unique_experts})
                points += [(batch, tokens, u) for u in counts]
        return points

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in vars(self).items()}


def median_seconds(run: Callable[[], None], repeats: int, sync: Callable[[], None]) -> float:
    """Median wall seconds of ``run()`` over ``repeats`` calls after one warm-up call;
    ``sync()`` (e.g. ``torch.cuda.synchronize``) before each clock read."""
    run()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_sync(device: torch.device) -> Callable[[], None]:
    """What waits for ``device``'s queued work: ``torch.cuda.synchronize`` on CUDA."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def device_name(device: torch.device) -> str:
    """A readable name of ``device``: the GPU's name, or the CPU's model and thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu: {model} ({torch.get_num_threads()} torch threads)"


def measure_hardware(device: torch.device, dtype: torch.dtype, name: str) -> HardwareProfile:
    """Memory bandwidth (a large copy) and matmul FLOP/s in ``dtype`` (a square GEMM) of
    ``device``, measured: the profile whose ridge point places the fitted knee.

    The measured matmul rate stands for every compute dtype's peak (bf16, fp8 and fp32): a
    calibrated model runs in one dtype only.
    """
    sync = device_sync(device)
    big = device.type == "cuda"
    elements = (1 << 28) if big else (1 << 25)  # 1 GiB / 128 MiB of float32
    source = torch.ones(elements, dtype=torch.float32, device=device)
    copy = torch.empty_like(source)
    seconds = median_seconds(lambda: copy.copy_(source), 5, sync)
    bandwidth = 2 * source.numel() * source.element_size() / seconds  # read + write
    size = 8192 if big else 1024
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    seconds = median_seconds(lambda: torch.matmul(a, b), 5, sync)
    flops = 2 * size**3 / seconds
    return HardwareProfile(name, bandwidth, flops, flops, flops)


def time_grid(
    grid: CalibrationGrid,
    num_experts: int,
    top_k: int,
    time_target: Callable[[int, int, int], ForwardTiming],
    *,
    time_draft: Callable[[int], float] | None = None,
    time_reject: Callable[[int], float] | None = None,
    progress: Callable[[int, int, TimingPoint], None] | None = None,
) -> list[TimingPoint]:
    """Times every grid point.

    Args:
        grid: the points.
        num_experts, top_k: the target's routed experts per layer and per token.
        time_target: (batch, tokens per request, unique experts per layer) -> the forward's
            ``ForwardTiming``; its measured union goes into the point.
        time_draft: batch -> seconds of one draft step, or None (draft parameters held 0).
        time_reject: batch -> seconds of the accept/reject step, or None (held 0).
        progress: called after each point with (points done, total, the point).

    Returns:
        "ar" points (1 token per request) and "verify" points, then "draft" and "reject"
        points per batch size.
    """
    target = grid.target_points(num_experts, top_k)
    total = len(target) + len(grid.batch_sizes) * (
        (time_draft is not None) + (time_reject is not None)
    )
    points: list[TimingPoint] = []

    def add(point: TimingPoint) -> None:
        points.append(point)
        if progress is not None:
            progress(len(points), total, point)

    for batch, tokens, unique in target:
        timing = time_target(batch, tokens, unique)
        kind = "ar" if tokens == 1 else "verify"
        add(TimingPoint(kind, batch, tokens, timing.seconds, timing.unique_experts))
    for kind, timer in (("draft", time_draft), ("reject", time_reject)):
        if timer is not None:
            for batch in sorted(grid.batch_sizes):
                add(TimingPoint(kind, batch, 1, timer(batch)))
    return points


@dataclasses.dataclass(frozen=True)
class CalibrationProfile:
    """A fitted model of one target on one device, as ``sgl-ecospec calibrate`` writes it.

    Attributes:
        device: the device timed on (``device_name``).
        torch_version: torch's version string during the timing.
        dtype: the weights' and activations' torch dtype name ("float32", "bfloat16").
        model: the target's shape.
        hardware: the measured device profile (``measure_hardware``): sets the knee.
        grid: where the target was timed.
        params: the fitted parameters.
        fixed: parameters held at 0 (no point of their kind was timed).
        points: the timed points (target, draft, reject).
        created: UTC time of the fit, ISO 8601.
        command: the command line that made it, or "".
        prefill: the measured prefill line, or None (no prefill timed).
    """

    device: str
    torch_version: str
    dtype: str
    model: ModelProfile
    hardware: HardwareProfile
    grid: CalibrationGrid
    params: MoESDParams
    fixed: tuple[str, ...]
    points: tuple[TimingPoint, ...]
    created: str
    command: str = ""
    prefill: PrefillLine | None = None

    def performance_model(self) -> PerformanceModel:
        """The fitted ``PerformanceModel`` (the model and measured device of the file)."""
        return PerformanceModel(self.model, self.hardware, self.params)

    def predicted_seconds(self) -> np.ndarray:
        """float64 ``[P]``: the fitted model's time of every point."""
        perf = self.performance_model()
        predict = {
            "ar": lambda p: perf.ar_time(p.batch, p.unique_experts),
            "verify": lambda p: perf.verify_time(p.batch, p.gamma, p.unique_experts),
            "draft": lambda p: perf.draft_time(p.batch),
            "reject": lambda p: perf.reject_time(p.batch),
        }
        return np.array([predict[p.kind](p) for p in self.points], dtype=np.float64)

    def residuals(self) -> np.ndarray:
        """float64 ``[P]``: (predicted - measured) / measured per point."""
        measured = np.array([p.seconds for p in self.points], dtype=np.float64)
        return self.predicted_seconds() / measured - 1.0

    @property
    def rms_residual(self) -> float:
        """Root-mean-square relative residual."""
        return float(np.sqrt(np.mean(self.residuals() ** 2)))

    @property
    def max_abs_residual(self) -> float:
        """Largest |relative residual|."""
        return float(np.max(np.abs(self.residuals())))

    def summary(self) -> str:
        """One line for logs: device, fit quality and the main terms."""
        p = self.params
        return (
            f"{self.model.name} ({self.dtype}) on {self.device}, {len(self.points)} points, "
            f"residual rms {self.rms_residual:.1%} max {self.max_abs_residual:.1%}; "
            f"bias {p.bias * 1e3:.3g} ms, k2 {p.k2 * 1e3:.3g} ms per unique expert per layer, "
            f"knee {p.lam:.2f} RP, s {p.s:.4g}; created {self.created}"
        )

    def to_json(self) -> dict:
        """The file's JSON object (``load`` reads it back)."""
        predicted, residuals = self.predicted_seconds(), self.residuals()
        return {
            "format": FORMAT,
            "created": self.created,
            "command": self.command,
            "device": self.device,
            "torch_version": self.torch_version,
            "dtype": self.dtype,
            "model": dataclasses.asdict(self.model),
            "hardware": dataclasses.asdict(self.hardware),
            "grid": self.grid.as_dict(),
            "params": self.params.as_dict(),
            "fixed": list(self.fixed),
            "rms_residual": self.rms_residual,
            "max_abs_residual": self.max_abs_residual,
            "points": [
                {**dataclasses.asdict(point), "predicted": float(pred), "residual": float(res)}
                for point, pred, res in zip(self.points, predicted, residuals, strict=True)
            ],
            "prefill": None if self.prefill is None else self.prefill.to_json(),
        }

    def save(self, path: str | Path) -> Path:
        """Writes the JSON file (parent folders created); returns its path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CalibrationProfile":
        """Reads and checks a file written by ``save``.

        Raises:
            CalibrationFileError: no such file, not JSON, another format, or a field
                missing or out of range (the message names the file, the field and the fix).
        """
        where = f"calibration profile {str(path)!r}"
        remedy = "write one with `sgl-ecospec calibrate --out FILE`"
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise CalibrationFileError(f"{where}: no such file; {remedy}") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CalibrationFileError(f"{where} is not a JSON file ({exc}); {remedy}") from None
        tag = data.get("format") if isinstance(data, dict) else None
        if tag != FORMAT:
            raise CalibrationFileError(
                f"{where} is not an sgl-ecospec calibration profile: format tag {tag!r}, "
                f"expected {FORMAT!r}; {remedy}"
            )
        try:
            return cls._from_json(data)
        except (KeyError, TypeError, ValueError) as exc:
            detail = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise CalibrationFileError(f"{where} is corrupt: {detail}; {remedy}") from None

    @classmethod
    def _from_json(cls, data: dict) -> "CalibrationProfile":
        params = data["params"]
        if sorted(params) != sorted(PARAM_NAMES):
            raise ValueError(f"params must have exactly {list(PARAM_NAMES)}, got {sorted(params)}")
        fields = {f.name for f in dataclasses.fields(TimingPoint)}
        points = tuple(
            TimingPoint(**{k: v for k, v in point.items() if k in fields})
            for point in data["points"]
        )
        if not points:
            raise ValueError("no timed points")
        unknown = sorted(set(data["fixed"]) - set(PARAM_NAMES))
        if unknown:
            raise ValueError(f"fixed names unknown parameters {unknown}")
        profile = cls(
            device=str(data["device"]),
            torch_version=str(data["torch_version"]),
            dtype=str(data["dtype"]),
            model=ModelProfile(**data["model"]),
            hardware=HardwareProfile(**data["hardware"]),
            grid=CalibrationGrid(
                **{k: tuple(v) if isinstance(v, list) else v for k, v in data["grid"].items()}
            ),
            params=MoESDParams(**{k: float(v) for k, v in params.items()}),
            fixed=tuple(data["fixed"]),
            points=points,
            created=str(data["created"]),
            command=str(data.get("command", "")),
            prefill=PrefillLine.from_json(data["prefill"]) if data.get("prefill") else None,
        )
        if not math.isfinite(profile.rms_residual):
            raise ValueError("the fitted model predicts a non-finite time at a timed point")
        return profile


def calibrate(
    points: Sequence[TimingPoint],
    model: ModelProfile,
    hardware: HardwareProfile,
    *,
    device: str,
    dtype: str,
    grid: CalibrationGrid,
    command: str = "",
    prefill: PrefillLine | None = None,
) -> CalibrationProfile:
    """Fits the MoESD model to ``points`` timed on ``hardware`` (``time_grid``).

    Least squares on relative residuals (``fit_params(load_bounds=False)``): bias and k2
    only >= 0, lam in [0.2, 1] of the measured ridge point, s in [1, 2].

    Args:
        points: the timed points; "ar"/"verify" points carry their measured unions.
        model: the timed target's shape.
        hardware: the measured device (``measure_hardware``).
        device: the device's readable name; dtype: the torch dtype name timed in.
        grid: where the points were timed (recorded in the profile).
        command: the command line, recorded.
        prefill: the prefill line fitted to the timed prefills, or None.
    """
    fit = fit_params(points, model, hardware, load_bounds=False)
    return CalibrationProfile(
        device=device,
        torch_version=torch.__version__,
        dtype=dtype,
        model=model,
        hardware=hardware,
        grid=grid,
        params=fit.params,
        fixed=fit.fixed,
        points=fit.points,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        command=command,
        prefill=prefill,
    )
