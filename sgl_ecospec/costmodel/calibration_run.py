"""Calibration end to end, shared by ``sgl-ecospec calibrate`` (the lab) and the plugin's
startup calibration (its child process): the grid and device flags, checked; the target and
its draft timed on the device (:mod:`sgl_ecospec.costmodel.forward_timing`); the fit; the
profile file; the fit table.

The callers resolve where the models are and hand in the loader of the target (transformers'
``AutoModelForCausalLM.from_pretrained``): this module imports torch only.
"""

import argparse
import dataclasses
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from sgl_ecospec.costmodel.calibration import (
    COMPUTE_DTYPE_OF,
    CalibrationGrid,
    CalibrationProfile,
    calibrate,
    device_name,
    measure_hardware,
    time_grid,
)
from sgl_ecospec.costmodel.forward_timing import (
    ControlledRouting,
    TargetTimer,
    draft_timer,
    prefill_timer,
    reject_timer,
    target_profile,
)
from sgl_ecospec.costmodel.prefill import PrefillLine
from sgl_ecospec.costmodel.profiles import ridge_tokens
from sgl_ecospec.models.eagle3 import Eagle3Draft
from sgl_ecospec.models.target import TargetModel

DEFAULT_BATCH_SIZES = "1,2,4,8,16"
DEFAULT_TOKENS = "1,2,4,8"
DEFAULT_UNIQUE_EXPERTS = "8,16,32,64"
DEFAULT_REPEATS = 5
# Prompt lengths of the timed prefills (the prefill line): MT-Bench's first turns are 50-200.
DEFAULT_PREFILL_TOKENS = "32,128,256"
# The CPU development server's OpenMP threads (scripts/launch_cpu.sh, ECOSPEC_CPU_THREADS).
DEFAULT_CPU_THREADS = 1
DEFAULT_CONTEXT = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The device, dtype, grid and output flags (the caller adds ``--target`` and ``--draft``)."""
    device = parser.add_argument_group("device")
    device.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    device.add_argument("--dtype", choices=sorted(COMPUTE_DTYPE_OF), default="float32")
    device.add_argument(
        "--threads",
        type=int,
        help=f"torch CPU threads (default: {DEFAULT_CPU_THREADS} on the CPU, as the CPU server "
        "runs, else torch's)",
    )
    grid = parser.add_argument_group("grid")
    grid.add_argument("--batch-sizes", default=DEFAULT_BATCH_SIZES, help="requests per forward")
    grid.add_argument("--tokens", default=DEFAULT_TOKENS, help="new tokens per request (gamma)")
    grid.add_argument(
        "--unique-experts",
        default=DEFAULT_UNIQUE_EXPERTS,
        help="distinct experts per MoE layer the routing is forced to (clamped per point)",
    )
    grid.add_argument("--repeats", type=int, default=DEFAULT_REPEATS, help="timed runs per point")
    grid.add_argument(
        "--prefill-tokens",
        default=DEFAULT_PREFILL_TOKENS,
        help="prompt lengths of the one-request prefills timed for the prefill line (what the "
        "serving benchmark prices the prefills between decode steps by); none: no prefill",
    )
    grid.add_argument(
        "--context", type=int, default=DEFAULT_CONTEXT, help="prefilled tokens per request"
    )
    grid.add_argument("--seed", type=int, default=0, help="input tokens and expert choice")
    parser.add_argument(
        "--out", metavar="FILE", help="profile file (default results/calibration/<device>.json)"
    )


@dataclasses.dataclass(frozen=True)
class CalibrationRun:
    """The checked flags of one calibration (:func:`add_arguments`)."""

    grid: CalibrationGrid
    context: int
    device: torch.device
    dtype_name: str
    threads: int | None
    seed: int
    out: Path

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "CalibrationRun":
        """Checks the flags (ValueError naming the flag at fault), before any model loads."""
        prefill = () if args.prefill_tokens == "none" else args.prefill_tokens
        grid = CalibrationGrid(
            _sizes("--batch-sizes", args.batch_sizes),
            _sizes("--tokens", args.tokens),
            _sizes("--unique-experts", args.unique_experts),
            args.repeats,
            _sizes("--prefill-tokens", prefill) if prefill else (),
        )
        if args.context < 1:
            raise ValueError(f"--context must be >= 1, got {args.context}")
        device = _device(args.device)
        threads = args.threads
        if threads is None and device.type == "cpu":
            threads = DEFAULT_CPU_THREADS
        if threads is not None and threads < 1:
            raise ValueError(f"--threads must be >= 1, got {threads}")
        out = Path(args.out or f"results/calibration/{device_slug(device)}.json")
        return cls(grid, args.context, device, args.dtype, threads, args.seed, out)


def calibrate_checkpoint(
    run: CalibrationRun,
    target_dir: str,
    draft_dir: str | None,
    name: str,
    load_model: Callable[..., torch.nn.Module],
    command: str,
) -> CalibrationProfile:
    """Times the target at ``target_dir`` (and its draft, unless None) on ``run.device``,
    fits the model, writes ``run.out`` and prints the fit table; progress goes to stderr.

    Args:
        name: the model's name in the profile.
        load_model: ``load_model(target_dir, dtype=..., attn_implementation="sdpa")`` -> the
            transformers model (``AutoModelForCausalLM.from_pretrained``).
        command: the command line recorded in the profile.
    """
    started = time.perf_counter()
    if run.threads is not None:
        torch.set_num_threads(run.threads)
    if draft_dir is not None and not Path(draft_dir).is_dir():
        raise FileNotFoundError(f"--draft {draft_dir!r} is not a directory")
    device, dtype, grid = run.device, getattr(torch, run.dtype_name), run.grid
    model = load_model(target_dir, dtype=dtype, attn_implementation="sdpa")
    target = TargetModel(model, device=device)
    profile = target_profile(target, name, dtype, target_dir)
    points = grid.target_points(profile.num_experts, profile.top_k)  # checks --unique-experts
    label = device_name(device)
    _log(f"[calibrate] {name} ({run.dtype_name}) on {label}: measuring the device")
    hardware = measure_hardware(device, dtype, f"measured {device_slug(device)}")
    _log(
        f"[calibrate] {hardware.memory_bandwidth / 1e9:.1f} GB/s copy, "
        f"{hardware.peak_bf16_flops / 1e9:.1f} GFLOP/s matmul, ridge "
        f"{ridge_tokens(profile, hardware):.1f} tokens; timing {len(points)} target points"
    )
    routing = ControlledRouting(target, seed=run.seed)
    timer = TargetTimer(target, routing, run.context, grid.repeats, seed=run.seed)
    time_draft = None
    if draft_dir is not None:
        draft = Eagle3Draft.from_pretrained(draft_dir, dtype=dtype, device=device).eval()
        time_draft = draft_timer(draft, target, run.context, grid.repeats)
    time_reject = reject_timer(target, max(grid.tokens_per_request), grid.repeats)

    def progress(done: int, total: int, point) -> None:
        union = "" if point.unique_experts is None else f" U={point.unique_experts:g}"
        _log(
            f"[calibrate {done}/{total} {time.perf_counter() - started:.0f}s] {point.kind} "
            f"B={point.batch} gamma={point.gamma}{union}: {point.seconds * 1e3:.3f} ms"
        )

    with torch.no_grad():
        timed = time_grid(
            grid,
            profile.num_experts,
            profile.top_k,
            timer,
            time_draft=time_draft,
            time_reject=time_reject,
            progress=progress,
        )
        prefill = None
        if grid.prefill_tokens:
            time_prefill = prefill_timer(target, grid.repeats, seed=run.seed)
            seconds = []
            for tokens in grid.prefill_tokens:
                seconds.append(time_prefill(tokens))
                _log(
                    f"[calibrate {time.perf_counter() - started:.0f}s] prefill of {tokens} "
                    f"tokens: {seconds[-1] * 1e3:.1f} ms"
                )
            prefill = PrefillLine.fit(grid.prefill_tokens, seconds)
    fitted = calibrate(
        timed,
        profile,
        hardware,
        device=label,
        dtype=run.dtype_name,
        grid=grid,
        command=command,
        prefill=prefill,
    )
    fitted.save(run.out)
    print(format_fit(fitted))
    print(f"wrote {run.out} ({time.perf_counter() - started:.0f} s)")
    return fitted


def checkpoint_name(target_dir: str) -> str:
    """The profile's model name of a checkpoint: its folder and the one above (a testbed's
    ``target/`` folder is named by its build folder as well)."""
    return "/".join(Path(target_dir).resolve().parts[-2:])


def device_slug(device: torch.device) -> str:
    """File-name form of the device: "cpu", or the GPU's name ("nvidia-h200")."""
    if device.type != "cuda":
        return device.type
    return re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name(device).lower()).strip("-")


def _sizes(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"{flag} must hold distinct integers >= 1, got {text!r}")
    return values


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise ValueError(f"--device {text!r} is not a torch device (cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {text}: no CUDA device is visible; use --device cpu")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda[:N], got {text!r}")
    return device


def format_fit(profile: CalibrationProfile) -> str:
    """The fit table: parameters, then every point's measured and predicted time."""
    p = profile.params
    lines = [
        f"calibration: {profile.model.name} ({profile.dtype}) on {profile.device}",
        f"  knee lam x RP = {p.lam * ridge_tokens(profile.model, profile.hardware):.1f} tokens",
        "param          value",
    ]
    units = {"lam": "", "s": ""}
    for key, value in p.as_dict().items():
        held = "  (held: not timed)" if key in profile.fixed else ""
        unit = units.get(key, " ms")
        shown = value if key in units else value * 1e3
        lines.append(f"{key:<12} {shown:>12.5g}{unit}{held}")
    lines.append("kind    batch gamma unique  measured_ms predicted_ms residual")
    predicted, residuals = profile.predicted_seconds(), profile.residuals()
    for point, pred, res in zip(profile.points, predicted, residuals, strict=True):
        union = "-" if point.unique_experts is None else f"{point.unique_experts:.1f}"
        lines.append(
            f"{point.kind:<7} {point.batch:>5} {point.gamma:>5} {union:>6} "
            f"{point.seconds * 1e3:>12.3f} {pred * 1e3:>12.3f} {res:>+8.1%}"
        )
    lines.append(
        f"residuals: rms {profile.rms_residual:.1%}, max {profile.max_abs_residual:.1%} "
        f"over {len(profile.points)} points"
    )
    line = profile.prefill
    if line is not None:
        lines.append(
            f"prefill line: {line.base * 1e3:.1f} ms + {line.per_token * 1e3:.3f} ms per token"
        )
        for tokens, seconds, res in zip(line.tokens, line.seconds, line.residuals(), strict=True):
            lines.append(f"prefill {tokens:>5} tokens {seconds * 1e3:>12.3f} ms {res:>+8.1%}")
    return "\n".join(lines)


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
