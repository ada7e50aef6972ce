"""A local SGLang server process for tests and benchmarks, always shut down.

On a machine without a GPU the server runs in the CPU development mode
(``scripts/launch_cpu.sh``, docs/sglang.md); with a GPU it is the plain
``python -m sglang.launch_server``. The server gets its own process group, so stopping it
stops the scheduler and detokenizer processes too, and its output goes to a log file that
callers read by offset (e.g. the ``EcoSpec:`` lines of one benchmark phase).
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
LAUNCH_CPU = REPO_ROOT / "scripts" / "launch_cpu.sh"

# algorithm.py logs one such line per ``log_interval`` verify steps.
_ECOSPEC_LINE = re.compile(
    r"EcoSpec: (?P<steps>\d+) verify steps, unique experts/layer/step (?P<experts>[\d.]+), "
    r"predictor recall (?P<recall>[\d.]+)(?P<rest>[^\n]*)"
)
_ACCEPT_FIELD = re.compile(r"acceptance length (?P<accept>[\d.]+)")


# One sample of a Prometheus text exposition: name, optional labels, value.
_METRIC_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][\w:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)")


class ServerError(RuntimeError):
    """The server exited, or did not become ready in time (the message has its log tail)."""


def gpu_present() -> bool:
    """True when ``nvidia-smi -L`` lists a GPU."""
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_command(cpu: bool) -> list[str]:
    """The command that starts a server; SGLang's arguments follow it."""
    if not cpu:
        return [sys.executable, "-m", "sglang.launch_server"]
    if not LAUNCH_CPU.is_file():
        raise FileNotFoundError(
            f"the CPU development mode needs {LAUNCH_CPU} (a source checkout of sgl-ecospec); "
            "on a GPU machine pass cpu=False"
        )
    return ["bash", str(LAUNCH_CPU)]


def ecospec_log_summary(text: str) -> dict:
    """Totals of the ``EcoSpec:`` log lines in ``text``.

    Returns ``{"verify_steps", "experts_per_layer_step", "predictor_recall",
    "spec_accept_length"}``: the step count, and the step-weighted means of the lines (None
    when no line is present); the last is the acceptance length of the logged (EcoSpec's
    speculative) verify steps, over the lines that report one.
    """
    steps, experts, recall = 0, 0.0, 0.0
    accept_steps, accept = 0, 0.0
    for match in _ECOSPEC_LINE.finditer(text):
        n = int(match["steps"])
        steps += n
        experts += n * float(match["experts"])
        recall += n * float(match["recall"])
        field = _ACCEPT_FIELD.search(match["rest"])
        if field is not None:
            accept_steps += n
            accept += n * float(field["accept"])
    return {
        "verify_steps": steps,
        "experts_per_layer_step": experts / steps if steps else None,
        "predictor_recall": recall / steps if steps else None,
        "spec_accept_length": accept / accept_steps if accept_steps else None,
    }


def metric_totals(text: str) -> dict[str, float]:
    """Each metric's sum over its label sets, from a Prometheus text exposition (what
    ``/metrics`` serves with ``--enable-metrics``)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _METRIC_SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        totals[match["name"]] = totals.get(match["name"], 0.0) + value
    return totals


GENERATED = "sglang:generation_tokens_total"
VERIFY_CALLS = "sglang:spec_verify_calls_total"


def accept_length_between(before: dict, after: dict, requests: int) -> float | None:
    """Acceptance length over a window from SGLang's counters (:func:`metric_totals` at its
    start and end, every request of the window finished): tokens per request per verify
    step, the prefill's first token of each of ``requests`` requests excluded. None without
    verify steps (a server without speculation)."""
    verify = after.get(VERIFY_CALLS, 0.0) - before.get(VERIFY_CALLS, 0.0)
    if verify <= 0:
        return None
    generated = after.get(GENERATED, 0.0) - before.get(GENERATED, 0.0)
    return (generated - requests) / verify


# ECOSPEC's utility gate: decode steps per level (python/sglang_ecospec/gate.py).
GATE_STEP_KINDS = ("plain", "narrow", "tree")


def gate_steps_between(before: dict, after: dict) -> dict[str, int] | None:
    """Decode steps per level of ECOSPEC's gate over a window (:func:`metric_totals` at its
    start and end): ``{"plain", "narrow", "tree"}``; None from a server without the gate's
    counters or without a step in the window."""
    steps = {
        kind: round(after.get(name, 0.0) - before.get(name, 0.0))
        for kind in GATE_STEP_KINDS
        for name in [f"sglang:ecospec_gate_{kind}_steps_total"]
    }
    return steps if sum(steps.values()) > 0 else None


def counter_fields(before: dict, after: dict, requests: int) -> dict:
    """A phase's record fields from the server's counters at its start and end:
    ``accept_length`` (:func:`accept_length_between`) and ``gate_steps``
    (:func:`gate_steps_between`)."""
    return {
        "accept_length": accept_length_between(before, after, requests),
        "gate_steps": gate_steps_between(before, after),
    }


class LocalServer:
    """``with LocalServer(args, log_path) as server:`` starts, waits for /health, stops.

    Args:
        args: SGLang server arguments (without ``--host``/``--port``, which are chosen here).
        log_path: file that receives the server's stdout and stderr.
        env: extra environment variables (e.g. ``SGLANG_ECOSPEC_*`` settings).
        cpu: CPU development mode; None picks it when no GPU is present.
        start_timeout_s: seconds to wait for /health.
    """

    def __init__(
        self,
        args: list[str],
        log_path: str | Path,
        *,
        env: dict | None = None,
        cpu: bool | None = None,
        start_timeout_s: float = 600.0,
    ):
        self.cpu = (not gpu_present()) if cpu is None else cpu
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.start_timeout_s = start_timeout_s
        self._log = open(self.log_path, "w")
        command = [*launch_command(self.cpu), *args, "--host", "127.0.0.1"]
        self.process = subprocess.Popen(
            [*command, "--port", str(self.port)],
            cwd=REPO_ROOT if self.cpu else None,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def __enter__(self) -> "LocalServer":
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_text(self, start: int = 0) -> str:
        """The log from byte offset ``start`` on."""
        with open(self.log_path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")

    def log_size(self) -> int:
        """The log's current size in bytes (an offset for :meth:`log_text`)."""
        self._log.flush()
        return self.log_path.stat().st_size

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_text().splitlines()
        return "\n".join([line for line in text if "Ignore import error" not in line][-lines:])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(
                    f"server exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
        raise ServerError(
            f"server not ready after {self.start_timeout_s:.0f} s:\n{self.log_tail()}"
        )

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.load(response)

    def metrics(self) -> dict[str, float]:
        """:func:`metric_totals` of the server's ``/metrics`` (``--enable-metrics``)."""
        return metric_totals(self.get_text("/metrics"))

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return response.read().decode()

    def generate(self, prompt: str, max_new_tokens: int) -> dict:
        """Greedy /generate of ``max_new_tokens`` tokens."""
        body = json.dumps(
            {
                "text": prompt,
                "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
            }
        ).encode()
        request = urllib.request.Request(
            self.url + "/generate", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=1800) as response:
            return json.load(response)

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.process.wait(timeout=30)
        if not self._log.closed:
            self._log.close()
