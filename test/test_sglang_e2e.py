"""End to end on the real SGLang server in CPU development mode (scripts/launch_cpu.sh).

The tiny Qwen2-MoE target and its constructed EAGLE-3 draft (sglang_ecospec.cpu_dev.tiny)
are served twice on a free loopback port: without speculation, then with ECOSPEC (topk 4).
At temperature 0 ECOSPEC must return token for token what the server without speculation
returns, with a mean acceptance length above 1, /server_info must name ECOSPEC, and the
scheduler must log EcoSpec's statistics; the ECOSPEC server runs with --enable-metrics, and
its decode log line and /metrics must carry EcoSpec's statistics with sane values. Servers
are always shut down, even on failure.

About 2-3 minutes on 2 cores. Select with ``-m e2e``, skip with ``-m "not e2e"``.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "scripts" / "launch_cpu.sh"
START_TIMEOUT_S = 300
# One MT-Bench question (writing) and one HumanEval prompt (HumanEval/0's header).
PROMPTS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
    "cultural experiences and must-see attractions.",
    "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: "
    'float) -> bool:\n    """ Check if in given list of numbers, are any two numbers closer '
    'to each other than\n    given threshold.\n    """\n',
]
MAX_NEW_TOKENS = 32
COMMON_ARGS = [
    "--dtype",
    "float32",
    "--max-total-tokens",
    "2048",
    "--max-running-requests",
    "2",
    "--disable-cuda-graph",
    "--skip-server-warmup",
]
ECOSPEC_ARGS = [
    "--attention-backend",
    "triton",
    "--speculative-algorithm",
    "ECOSPEC",
    "--speculative-num-steps",
    "3",
    "--speculative-eagle-topk",
    "4",
    "--speculative-num-draft-tokens",
    "6",
]


def _gpu_present() -> bool:
    smi = shutil.which("nvidia-smi")
    return smi is not None and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


if _gpu_present():
    pytest.skip("the CPU development mode is for machines without a GPU", allow_module_level=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class CpuServer:
    """scripts/launch_cpu.sh in its own process group, stopped (the whole group) on exit."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        command = ["bash", str(LAUNCH), *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    def __enter__(self):
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join([line for line in text if "Ignore import error" not in line][-lines:])

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                pytest.fail(f"server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
        pytest.fail(f"server not ready after {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.load(response)

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return response.read().decode()

    def generate(self, prompt: str) -> dict:
        body = json.dumps(
            {
                "text": prompt,
                "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS},
            }
        ).encode()
        request = urllib.request.Request(
            self.url + "/generate", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
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
        self._log.close()


def prometheus_values(text: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of ``name`` in a /metrics page."""
    pattern = re.compile(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", re.MULTILINE)
    return [(labels, float(value)) for labels, value in pattern.findall(text)]


def assert_ecospec_observability(log_text: str, metrics_text: str, target: Path) -> None:
    """EcoSpec's statistics in SGLang's decode log line and on /metrics, within bounds."""
    config = json.loads((target / "config.json").read_text())
    top_k, num_experts = config["num_experts_per_tok"], config["num_experts"]
    max_accept = int(ECOSPEC_ARGS[ECOSPEC_ARGS.index("--speculative-num-steps") + 1]) + 1
    lines = re.findall(
        r"Decode batch.*accept len: ([\d.]+).*ecospec experts/layer/step: ([\d.]+), "
        r"predictor recall: ([\d.]+)",
        log_text,
    )
    assert lines, "no decode log line with EcoSpec's fields"
    for accept, experts, recall in lines:
        assert 1.0 <= float(accept) <= max_accept and 0.0 <= float(recall) <= 1.0
        assert top_k <= float(experts) <= num_experts
    bounds = {
        "sglang:ecospec_unique_experts_per_layer_step": (top_k, num_experts),
        "sglang:ecospec_predictor_recall": (0.0, 1.0),
        "sglang:ecospec_accept_length": (1.0, max_accept),
        "sglang:ecospec_verify_steps_total": (1.0, float("inf")),
    }
    for name, (low, high) in bounds.items():
        samples = prometheus_values(metrics_text, name)
        assert samples, f"{name} missing from /metrics"
        for labels, value in samples:
            assert 'model_name="' in labels and low <= value <= high, (name, labels, value)


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from sglang_ecospec.cpu_dev import tiny

    folder = tmp_path_factory.mktemp("tiny")
    target = tiny.make_tiny_target(folder / "target")
    draft = tiny.make_tiny_draft(target, folder / "draft")
    return target, draft


@pytest.fixture(scope="module")
def plain_outputs(tiny_models, tmp_path_factory):
    target, _ = tiny_models
    log = tmp_path_factory.mktemp("logs") / "plain.log"
    with CpuServer(["--model-path", str(target), *COMMON_ARGS], log) as server:
        return [server.generate(prompt) for prompt in PROMPTS]


def test_ecospec_matches_plain_decoding_and_accepts_drafts(
    tiny_models, plain_outputs, tmp_path_factory
):
    target, draft = tiny_models
    log = tmp_path_factory.mktemp("logs") / "ecospec.log"
    args = [
        "--model-path",
        str(target),
        *COMMON_ARGS,
        *ECOSPEC_ARGS,
        "--speculative-draft-model-path",
        str(draft),
        "--enable-metrics",
        "--decode-log-interval",
        "4",
    ]
    with CpuServer(args, log, env={"SGLANG_ECOSPEC_LOG_INTERVAL": "2"}) as server:
        outputs = [server.generate(prompt) for prompt in PROMPTS]
        info = server.get("/server_info")
        metrics_text = server.get_text("/metrics")
    assert info["speculative_algorithm"] == "ECOSPEC"
    accept_lengths = []
    for prompt, plain, eco in zip(PROMPTS, plain_outputs, outputs, strict=True):
        assert len(plain["output_ids"]) == MAX_NEW_TOKENS
        assert eco["output_ids"] == plain["output_ids"], prompt
        accept_lengths.append(eco["meta_info"]["spec_accept_length"])
    assert sum(accept_lengths) / len(accept_lengths) > 1.0, accept_lengths
    text = log.read_text(errors="replace")
    assert "ECOSPEC active" in text and "EcoSpec:" in text, server.log_tail()
    assert_ecospec_observability(text, metrics_text, target)
