"""Calibration at startup (setting ``calibrate``): the served model timed on this process's
device in a child process, its profile cached, then read as any calibration profile file is
(``eps_table.cost_model``).

The child is ``python -m sglang_ecospec.calibration_child --target <model_path> --draft
<draft> --device <this device> --dtype <served dtype> [grid settings] --out <file>``: the
library's calibration, the one ``sgl-ecospec calibrate`` runs (same flags, timing, fit and
file), in its own process so that the timed models leave the server's memory with it. Its
stdout (the fit table: every point's measured and predicted time and residual) is logged at
INFO.

Cache: ``$SGL_ECOSPEC_CACHE/calibration`` (default ``~/.cache/sgl-ecospec/calibration``, the
lab's cache root), one file per key: the model path and a hash of its config.json (and the
draft's), the device's name (on the CPU with the server's torch threads), the dtype, the
grid settings and the package version. A later start with the same key reuses the file
without running the child.

Ranks: one process per node calibrates, the lowest rank of its TP group on the host (one
all-gather of host names over the group's CPU group); the group's other ranks on that host
wait for the file. A lock file beside it serialises calibrations of one key on a node
(data-parallel replicas, two servers): the second to take it finds the profile. A failure
(the child exits non-zero, e.g. a checkpoint the calibrator cannot load, or runs past
``calibrate_timeout``) does not stop the server: it is recorded in a ``.failed`` file beside
the profile, so that the waiting ranks stop waiting, and :func:`cost_profile` logs a WARNING
with the child's last stderr lines and the command to run instead, and returns the prior as
the fallback.
"""

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from sgl_ecospec.costmodel.calibration import CalibrationFileError, CalibrationProfile, device_name
from sglang_ecospec.cache_files import cache_root, file_digest, key_digest, plugin_version, slug
from sglang_ecospec.settings import CALIBRATION_GRID, EcoSpecSettings, calibration_sizes

logger = logging.getLogger(__name__)

CALIBRATE_MODULE = "sglang_ecospec.calibration_child"
# The calibrate command's flag of each CALIBRATION_GRID setting, in that order.
GRID_FLAGS = ("--batch-sizes", "--tokens", "--unique-experts", "--repeats")
# The dtypes `sgl-ecospec calibrate --dtype` times; float16 as bfloat16 (same bytes per weight).
TIMED_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "bfloat16"}
STDERR_LINES = 15  # of a failed child, in the warning
POLL_SECONDS = 0.5  # how often a waiting rank looks for the profile or a failure
# A waiting rank waits for the calibrating one's lock wait and child (each up to
# calibrate_timeout) plus this margin.
WAIT_MARGIN_SECONDS = 60.0


class CalibrationFailed(RuntimeError):
    """The startup calibration gave no profile (the message says why)."""


class ChildResult(NamedTuple):
    """A finished calibration child: exit status (None: stopped at the timeout), stdout,
    stderr."""

    returncode: int | None
    stdout: str
    stderr: str


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the startup calibration times.

    Attributes:
        model_path: the served checkpoint (SGLang's ``model_path``), a local directory.
        draft_path: its EAGLE-3 draft (``speculative_draft_model_path``), or None: the
            draft's parameters are held at 0.
        dtype: the served torch dtype.
        device: this process's device (a CUDA device with its index).
    """

    model_path: str
    draft_path: str | None
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def from_server(cls, server_args, dtype: torch.dtype, device) -> "ServedModel":
        """From SGLang's final server arguments, the model runner's dtype and the worker's
        device ("cuda" resolved to this process's current CUDA device)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        draft = server_args.speculative_draft_model_path
        return cls(server_args.model_path, draft, dtype, device)


def cost_profile(
    settings: EcoSpecSettings, served: ServedModel, group=None
) -> tuple[str, str | None]:
    """``(profile, hardware)`` for ``eps_table.cost_model_eps_table``: the calibrated profile
    file (:func:`calibrated_profile`), or after a failure, logged as a WARNING, the fallback
    prior's model profile and hardware from the settings.

    Raises:
        ValueError: the calibration failed and the settings name no prior.
    """
    try:
        return str(calibrated_profile(settings, served, group)), None
    except CalibrationFailed as exc:
        failure = str(exc)
    command = shlex.join(
        [
            "sgl-ecospec",
            "calibrate",
            "--target",
            served.model_path,
            "--draft",
            served.draft_path or "none",
            "--device",
            str(served.device),
            "--out",
            "FILE",
        ]
    )
    advice = (
        f"calibrate by hand (`{command}`; `--draft none` if the draft does not load) and pass "
        "the file with SGLANG_ECOSPEC_PROFILE=FILE and SGLANG_ECOSPEC_CALIBRATE=off"
    )
    if settings.profile is None:
        raise ValueError(
            f"ECOSPEC: the startup calibration failed and no fallback prior is set: {failure}\n"
            f"To start, {advice}; or set SGLANG_ECOSPEC_PROFILE and SGLANG_ECOSPEC_HARDWARE to "
            "a model profile and hardware for the roofline prior"
        )
    logger.warning(
        "ECOSPEC: the startup calibration failed: %s\nThe cost model falls back to the prior "
        "(%s on %s). To use a calibrated model, %s.",
        failure,
        settings.profile,
        settings.hardware,
        advice,
    )
    return settings.profile, settings.hardware


def calibrated_profile(settings: EcoSpecSettings, served: ServedModel, group=None) -> Path:
    """The calibration profile of ``served`` on its device: the cached file, or calibrated
    now (this process leads its node: :func:`leads_calibration`) or by the node's leader
    (waited for). Every rank of ``group`` (SGLang's ``GroupCoordinator`` of the ranks sharing
    the batch, or None) calls it.

    Raises:
        CalibrationFailed: no profile (why, with the child's last stderr lines).
    """
    started = time.time()  # a failure recorded from now on is this start's
    leader = leads_calibration(group)
    path = cache_file(served, settings)
    profile = _load(path)
    if profile is not None:
        logger.info("ECOSPEC: reusing calibrated profile %s (%s)", path, profile.summary())
        return path
    if leader:
        return _calibrate_once(settings, served, path, started)
    return _wait(path, started, 2 * settings.calibrate_timeout + WAIT_MARGIN_SECONDS)


def leads_calibration(group) -> bool:
    """Whether this process calibrates for its node: the lowest rank of ``group`` on this
    host, True without a group. A collective over the group's CPU (gloo) group: one
    all-gather of host names."""
    if group is None:
        return True
    hosts = [None] * group.world_size
    torch.distributed.all_gather_object(hosts, socket.gethostname(), group=group.cpu_group)
    return hosts.index(hosts[group.rank_in_group]) == group.rank_in_group


def cache_dir() -> Path:
    """``$SGL_ECOSPEC_CACHE/calibration``, default ``~/.cache/sgl-ecospec/calibration``."""
    return cache_root() / "calibration"


def grid_flags(settings: EcoSpecSettings) -> list[str]:
    """The calibrate command's grid flags of the grid settings that are set (the others: the
    command's defaults)."""
    flags = []
    for name, flag in zip(CALIBRATION_GRID, GRID_FLAGS, strict=True):
        value = getattr(settings, name)
        if isinstance(value, str):
            value = ",".join(str(size) for size in calibration_sizes(name, value))
        if value is not None:
            flags += [flag, str(value)]
    return flags


def cache_file(served: ServedModel, settings: EcoSpecSettings) -> Path:
    """The profile's file in :func:`cache_dir`: named by the model's folder and the device,
    keyed by a hash of everything the fit depends on (module docstring).

    Raises:
        CalibrationFailed: the model path is no local checkpoint directory.
    """
    target = Path(served.model_path)
    if not (target / "config.json").is_file():
        raise CalibrationFailed(
            f"model_path {served.model_path!r} is no local checkpoint directory (no "
            "config.json): the calibrator loads the checkpoint from disk"
        )
    device = device_name(served.device)
    draft = None if served.draft_path is None else Path(served.draft_path)
    key = {
        "model_path": str(target.resolve()),
        "model_config": file_digest(target / "config.json"),
        "draft_path": None if draft is None else str(draft.resolve()),
        "draft_config": None if draft is None else file_digest(draft / "config.json"),
        "device": device,
        "dtype": str(served.dtype),
        "grid": grid_flags(settings),
        "version": plugin_version(),
    }
    digest = key_digest(key)
    return cache_dir() / f"{slug(target.name)}-{slug(device)}-{digest}.json"


def calibrate_command(served: ServedModel, settings: EcoSpecSettings, out: Path) -> list[str]:
    """The child's argv: the calibrate command on ``served``, writing ``out``.

    Raises:
        CalibrationFailed: a served dtype the calibrator does not time.
    """
    dtype = TIMED_DTYPES.get(served.dtype)
    if dtype is None:
        raise CalibrationFailed(
            f"the served dtype {served.dtype} is none the calibrator times (float32, bfloat16; "
            "float16 as bfloat16)"
        )
    argv = [sys.executable, "-m", CALIBRATE_MODULE, "--target", served.model_path]
    argv += ["--draft", served.draft_path or "none", "--device", str(served.device)]
    argv += ["--dtype", dtype]
    if served.device.type == "cpu":  # as this server runs (the command's own default is 1)
        argv += ["--threads", str(torch.get_num_threads())]
    # The server prices verify sets, never a prefill: no prefill line.
    argv += ["--prefill-tokens", "none"]
    return [*argv, *grid_flags(settings), "--out", str(out)]


def run_child(argv: list[str], timeout: float) -> ChildResult:
    """Runs the calibration child to its end, or stops it after ``timeout`` seconds."""
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except subprocess.TimeoutExpired as exc:
        return ChildResult(None, _text(exc.stdout), _text(exc.stderr))
    except OSError as exc:
        raise CalibrationFailed(f"could not start {shlex.join(argv)}: {exc}") from None
    return ChildResult(done.returncode, done.stdout, done.stderr)


def _calibrate_once(
    settings: EcoSpecSettings, served: ServedModel, path: Path, started: float
) -> Path:
    """Calibrates under the node's lock for ``path``, unless another process has written
    the profile meanwhile or failed since ``started``; a failure is recorded for the
    waiting ranks."""
    failed = _failure_file(path)
    with _node_lock(path.with_suffix(".lock"), settings.calibrate_timeout):
        if _settled(
            path,
            failed,
            started,
            "reusing calibrated profile",
            "another process's calibration of this key",
        ):
            return path
        try:
            _run(settings, served, path)
        except CalibrationFailed as exc:
            failed.write_text(json.dumps({"time": time.time(), "error": str(exc)}))
            raise
        failed.unlink(missing_ok=True)
    return path


def _run(settings: EcoSpecSettings, served: ServedModel, path: Path) -> None:
    """Runs the child into a temporary file, checks its profile, moves it to ``path``."""
    timeout = settings.calibrate_timeout
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    argv = calibrate_command(served, settings, partial)
    label = device_name(served.device)
    logger.info(
        "ECOSPEC: calibrating the cost model of %s on %s at startup, in a child process (up "
        "to %.0f s): %s",
        served.model_path,
        label,
        timeout,
        shlex.join(argv),
    )
    started = time.perf_counter()
    try:
        result = run_child(argv, timeout)
        seconds = time.perf_counter() - started
        if result.returncode != 0:
            ended = (
                f"was stopped after {timeout:.0f} s (calibrate_timeout)"
                if result.returncode is None
                else f"exited with status {result.returncode} after {seconds:.1f} s"
            )
            tail = "\n".join(result.stderr.strip().splitlines()[-STDERR_LINES:])
            raise CalibrationFailed(
                f"the calibration child {ended}; the last lines of its stderr:\n{tail}"
            )
        try:
            profile = CalibrationProfile.load(partial)
        except CalibrationFileError as exc:
            raise CalibrationFailed(
                f"the calibration child wrote no usable profile: {exc}"
            ) from None
        os.replace(partial, path)  # the waiting ranks see no partial file
    finally:
        partial.unlink(missing_ok=True)
    logger.info(
        "ECOSPEC: calibrated the cost model on %s in %.1f s: %s (%s)",
        label,
        seconds,
        path,
        profile.summary(),
    )
    logger.info("ECOSPEC calibration fit:\n%s", result.stdout.strip())


def _settled(path: Path, failed: Path, started: float, found: str, calibrator: str) -> bool:
    """True when ``path`` holds a usable profile (logged: ``found`` and it); CalibrationFailed
    when ``calibrator`` recorded a failure in ``failed`` since ``started``; else False."""
    profile = _load(path)
    if profile is not None:
        logger.info("ECOSPEC: %s %s (%s)", found, path, profile.summary())
        return True
    error = _failure_since(failed, started)
    if error is not None:
        raise CalibrationFailed(f"{calibrator} failed: {error}")
    return False


def _wait(path: Path, started: float, timeout: float) -> Path:
    """Waits for the node's leader to write ``path``, or to record a failure."""
    logger.info("ECOSPEC: waiting for this node's calibrating rank to write %s", path)
    failed = _failure_file(path)
    deadline = time.monotonic() + timeout
    while True:
        if _settled(path, failed, started, "calibrated profile", "this node's calibrating rank"):
            return path
        if time.monotonic() > deadline:
            raise CalibrationFailed(
                f"no calibrated profile at {path} after {timeout:.0f} s of waiting for this "
                "node's calibrating rank"
            )
        time.sleep(POLL_SECONDS)


@contextlib.contextmanager
def _node_lock(path: Path, timeout: float):
    """Holds an exclusive ``flock`` on ``path`` (released when this process ends, also by a
    crash), after waiting up to ``timeout`` seconds for another process's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout
    with open(path, "a") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise CalibrationFailed(
                        f"another process held the calibration lock {path} for over {timeout:.0f} s"
                    ) from None
                time.sleep(POLL_SECONDS)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _load(path: Path) -> CalibrationProfile | None:
    """The profile at ``path``, or None: none there (yet), or unreadable (calibrated anew)."""
    try:
        return CalibrationProfile.load(path)
    except CalibrationFileError:
        return None


def _failure_file(path: Path) -> Path:
    return path.with_suffix(".failed")


def _failure_since(failed: Path, started: float) -> str | None:
    """The error recorded in ``failed`` at or after ``started`` (time.time()), or None: no
    record, one of an earlier start, or one being written."""
    try:
        record = json.loads(failed.read_text())
    except (OSError, ValueError):
        return None
    if isinstance(record, dict) and record.get("time", 0) >= started:
        return str(record.get("error"))
    return None


def _text(output: str | bytes | None) -> str:
    """A timed-out child's captured output (bytes from ``subprocess`` even in text mode)."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""
