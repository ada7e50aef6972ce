"""End to end on the real SGLang server in CPU development mode (scripts/launch_cpu.sh).

The small testbed (8-layer MoEfied SmolLM2, 64 experts top-8, with its trained EAGLE-3
draft; built on first use, docs/testbed.md) is served on free loopback ports five times at
temperature 0, with the same speculative settings (topk 4, 3 steps, 6 draft tokens): without
speculation; with EAGLE3; with ECOSPEC under ``policy=confidence`` (SGLang's ranking through
the plugin, which measures the experts EAGLE3's verify sets touch); with ECOSPEC; with ECOSPEC
predicting experts with a head trained by ``sgl-ecospec train-head``. Asserted:

1. every speculative server returns token for token what the server without speculation
   returns;
2. ECOSPEC's mean acceptance length is above 1, and ECOSPEC-confidence accepts exactly what
   EAGLE3 accepts (same verify sets);
3. ECOSPEC's unique experts per layer per verify step are below EAGLE3's (measured through
   ECOSPEC-confidence);
4. /server_info names ECOSPEC; the ECOSPEC server runs with --enable-metrics, and its decode
   log line and /metrics carry EcoSpec's statistics with sane values;
5. with the trained head: lossless, drafts accepted, and its recall well above chance;
6. with the utility gate (on by default; off in the runs above) and its narrow level (one
   drafted token per request; ``gate_narrow``, on by default): lossless, and on this CPU,
   where speculation is slower than plain decoding, the gate decodes plainly after its first
   measurements, says so in the log and on /metrics (with its steps per level counted);
7. with ``SGLANG_ECOSPEC_CALIBRATE=on``: the server calibrates the cost model on this CPU at
   startup (a tiny grid), logs the fit and prices with it, lossless;
8. the README's CPU server command, with exactly its arguments (a free port for its port),
   starts (the launcher adds what the CPU needs and says so) and answers.

Servers are always shut down, even on failure. About 8 minutes on 2 cores, plus 86 s for 8.
(2026-12-04, beside a testbed build). Select with ``-m e2e``, skip with ``-m "not e2e"``.
"""

import json
import re
import shlex
from pathlib import Path

import pytest

from sgl_ecospec.lab.serving.local_server import (
    LocalServer,
    ServerError,
    ecospec_log_summary,
    gpu_present,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# One MT-Bench question (writing) and one HumanEval prompt (HumanEval/0's header), sent as
# chat-rendered text.
PROMPTS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
    "cultural experiences and must-see attractions.",
    "from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: "
    'float) -> bool:\n    """ Check if in given list of numbers, are any two numbers closer '
    'to each other than\n    given threshold.\n    """\n',
]
MAX_NEW_TOKENS = 32
# The runs that test speculation itself: the utility gate would turn it off on this CPU.
NO_GATE = {"SGLANG_ECOSPEC_GATE": "0"}
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
SPEC_ARGS = [
    "--attention-backend",
    "triton",
    "--speculative-num-steps",
    "3",
    "--speculative-eagle-topk",
    "4",
    "--speculative-num-draft-tokens",
    "6",
]

README = Path(__file__).resolve().parents[2] / "README.md"

if gpu_present():
    pytest.skip("the CPU development mode is for machines without a GPU", allow_module_level=True)


def serve(args: list[str], prompts: list[str], log: Path, env: dict | None = None):
    """Generates every prompt on a fresh server; returns (outputs, server info, /metrics
    text or None, log text)."""
    try:
        with LocalServer(args, log, env=env, cpu=True, start_timeout_s=600) as server:
            outputs = [server.generate(prompt, MAX_NEW_TOKENS) for prompt in prompts]
            info = server.get("/server_info")
            metrics = server.get_text("/metrics") if "--enable-metrics" in args else None
    except ServerError as exc:
        pytest.fail(str(exc))
    return outputs, info, metrics, log.read_text(errors="replace")


def prometheus_values(text: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of ``name`` in a /metrics page."""
    pattern = re.compile(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", re.MULTILINE)
    return [(labels, float(value)) for labels, value in pattern.findall(text)]


def assert_ecospec_observability(log_text: str, metrics_text: str, target: Path) -> None:
    """EcoSpec's statistics in SGLang's decode log line and on /metrics, within bounds."""
    config = json.loads((target / "config.json").read_text())
    top_k, num_experts = config["num_experts_per_tok"], config["num_experts"]
    max_accept = int(SPEC_ARGS[SPEC_ARGS.index("--speculative-num-steps") + 1]) + 1
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
def models() -> tuple[Path, Path]:
    from sgl_ecospec.lab.config import testbed_models

    target, draft = testbed_models(small=True)
    return Path(target), Path(draft)


@pytest.fixture(scope="module")
def prompts(models) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models[0])
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        for text in PROMPTS
    ]


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="module")
def plain_outputs(models, prompts, logs):
    outputs, _, _, _ = serve(
        ["--model-path", str(models[0]), *COMMON_ARGS], prompts, logs / "plain.log"
    )
    for output in outputs:
        assert len(output["output_ids"]) == MAX_NEW_TOKENS
    return outputs


def spec_args(models, algorithm: str) -> list[str]:
    target, draft = models
    return [
        "--model-path",
        str(target),
        *COMMON_ARGS,
        *SPEC_ARGS,
        "--speculative-algorithm",
        algorithm,
        "--speculative-draft-model-path",
        str(draft),
    ]


def assert_lossless(outputs: list[dict], plain_outputs: list[dict]) -> list[float]:
    """Asserts token-for-token equality; returns each request's acceptance length."""
    for prompt, plain, output in zip(PROMPTS, plain_outputs, outputs, strict=True):
        assert output["output_ids"] == plain["output_ids"], prompt
    return [output["meta_info"]["spec_accept_length"] for output in outputs]


@pytest.fixture(scope="module")
def eagle3_run(models, prompts, plain_outputs, logs):
    """EAGLE3's acceptance (SGLang's worker) and its experts (ECOSPEC, policy confidence)."""
    outputs, _, _, _ = serve(spec_args(models, "EAGLE3"), prompts, logs / "eagle3.log")
    eagle3_accept = assert_lossless(outputs, plain_outputs)
    outputs, _, _, text = serve(
        spec_args(models, "ECOSPEC"),
        prompts,
        logs / "ecospec-confidence.log",
        env={"SGLANG_ECOSPEC_POLICY": "confidence", "SGLANG_ECOSPEC_LOG_INTERVAL": "1", **NO_GATE},
    )
    confidence_accept = assert_lossless(outputs, plain_outputs)
    return eagle3_accept, confidence_accept, ecospec_log_summary(text)


def test_confidence_policy_reproduces_eagle3(eagle3_run):
    eagle3_accept, confidence_accept, stats = eagle3_run
    assert confidence_accept == eagle3_accept
    assert stats["verify_steps"] > 0


def test_ecospec_is_lossless_accepts_drafts_and_loads_fewer_experts(
    models, prompts, plain_outputs, eagle3_run, logs
):
    target, _ = models
    args = [*spec_args(models, "ECOSPEC"), "--enable-metrics", "--decode-log-interval", "4"]
    outputs, info, metrics_text, text = serve(
        args, prompts, logs / "ecospec.log", env={"SGLANG_ECOSPEC_LOG_INTERVAL": "1", **NO_GATE}
    )
    assert info["speculative_algorithm"] == "ECOSPEC"
    accept_lengths = assert_lossless(outputs, plain_outputs)
    assert sum(accept_lengths) / len(accept_lengths) > 1.0, accept_lengths
    assert "ECOSPEC active" in text and "EcoSpec:" in text
    ecospec = ecospec_log_summary(text)
    eagle3 = eagle3_run[2]
    assert ecospec["experts_per_layer_step"] < eagle3["experts_per_layer_step"], (ecospec, eagle3)
    assert_ecospec_observability(text, metrics_text, target)


@pytest.fixture(scope="module")
def head_file(models, tmp_path_factory) -> tuple[Path, dict]:
    """A LowRankExpertHead trained by ``sgl-ecospec train-head`` on ShareGPT prompts decoded
    by the offline engine on the same testbed; (file, training report)."""
    from sgl_ecospec.lab.cli import main

    root = tmp_path_factory.mktemp("head")
    path, report = root / "head.pt", root / "train.json"
    target, draft = models
    argv = ["train-head", "--target", str(target), "--draft", str(draft), "--num-prompts", "16"]
    argv += ["--max-new-tokens", "32", "--out", str(path), "--json", str(report)]
    assert main(argv) == 0
    return path, json.loads(report.read_text())


def test_ecospec_serves_a_trained_head(models, prompts, plain_outputs, head_file, logs):
    path, report = head_file
    env = {
        "SGLANG_ECOSPEC_PREDICTOR": "head",
        "SGLANG_ECOSPEC_PREDICTOR_FILE": str(path),
        "SGLANG_ECOSPEC_LOG_INTERVAL": "1",
        **NO_GATE,
    }
    outputs, _, _, text = serve(spec_args(models, "ECOSPEC"), prompts, logs / "head.log", env=env)
    accept_lengths = assert_lossless(outputs, plain_outputs)
    assert sum(accept_lengths) / len(accept_lengths) > 1.0, accept_lengths
    assert "predictor head" in text
    stats = ecospec_log_summary(text)
    # The head predicts well above chance (top-8 of 64: 0.125) on the served prompts, as it
    # did on its held-out training prompts.
    assert stats["verify_steps"] > 0 and stats["predictor_recall"] > 0.3, stats
    assert report["val_recall"] > 0.3, report["val_recall"]


def test_utility_gate_decodes_plainly_where_speculation_loses(
    models, prompts, plain_outputs, logs, tmp_path
):
    args = [*spec_args(models, "ECOSPEC"), "--enable-metrics", "--decode-log-interval", "4"]
    # Probes as often as the interval allows (budget 1): they re-enter speculation from the
    # stale draft state of requests whose prefill skipped the draft model, still lossless.
    env = {
        "SGLANG_ECOSPEC_GATE_MIN_SAMPLES": "3",
        "SGLANG_ECOSPEC_GATE_PROBE_INTERVAL": "16",
        "SGLANG_ECOSPEC_GATE_PROBE_BUDGET": "1",
        "SGLANG_ECOSPEC_GATE_NARROW": "1",
        "SGLANG_ECOSPEC_GATE_MEMORY": str(tmp_path / "gate-memory"),
    }
    outputs, _, metrics_text, text = serve(args, prompts, logs / "gate.log", env=env)
    assert_lossless(outputs, plain_outputs)
    assert "EcoSpec gate on" in text
    assert re.search(r"EcoSpec gate: batch sizes 1 decode plainly: .*utility 0\.\d\d", text)
    assert "the batch a prefill joins decodes plainly: prefills skip the draft model" in text
    # A fresh bucket measures the configured tree, the narrow level (one draft step, two
    # draft tokens) and plain decoding; probes re-enter speculation.
    assert "steps 3 -> 1, draft_tokens 6 -> 2" in text and "steps 1 -> 0" in text
    assert "steps 0 -> 3" in text
    # The exported state is the last one logged: closed, unless the scrape came after a
    # probe that measured speculation paying (plain steps timed slow on a loaded machine).
    states = re.findall(r"EcoSpec gate: batch sizes 1 (speculate|decode plainly):", text)
    expected = 1.0 if states[-1] == "speculate" else 0.0
    samples = prometheus_values(metrics_text, "sglang:ecospec_gate_open")
    assert samples and all('batch_sizes="1"' in labels and v == expected for labels, v in samples)
    for kind in ("plain", "narrow", "tree"):  # each level ran (the narrow one: measured)
        counted = prometheus_values(metrics_text, f"sglang:ecospec_gate_{kind}_steps_total")
        assert counted and counted[0][1] >= 1, (kind, counted)

    # A restarted server starts from the last one's decisions: no start-up measurement.
    outputs, _, _, text = serve(args, prompts, logs / "gate-restarted.log", env=env)
    assert_lossless(outputs, plain_outputs)
    lines = re.findall(r"EcoSpec gate: batch sizes 1 (speculate|decode plainly):(.*)", text)
    assert lines and lines[0][0] == states[-1] and "restored from" in lines[0][1]


@pytest.fixture(scope="module")
def cpu_profile(models, tmp_path_factory) -> Path:
    """A calibration profile of the served testbed on this CPU (`sgl-ecospec calibrate`, a
    small grid), the cost model policy "adaptive" sizes its verify sets with."""
    from sgl_ecospec.lab.cli import main

    target, draft = models
    path = tmp_path_factory.mktemp("calibration") / "cpu.json"
    argv = ["calibrate", "--target", str(target), "--draft", str(draft), "--out", str(path)]
    argv += ["--batch-sizes", "1,2", "--tokens", "1,4", "--unique-experts", "8,32"]
    assert main([*argv, "--repeats", "2"]) == 0
    return path


def test_adaptive_sizes_each_step_in_the_fixed_width_verify(
    models, prompts, plain_outputs, cpu_profile, logs
):
    env = {
        "SGLANG_ECOSPEC_POLICY": "adaptive",
        "SGLANG_ECOSPEC_EPS": "auto",
        "SGLANG_ECOSPEC_PROFILE": str(cpu_profile),
        "SGLANG_ECOSPEC_LOG_INTERVAL": "1",
        **NO_GATE,
    }
    outputs, _, _, text = serve(spec_args(models, "ECOSPEC"), prompts, logs / "adaptive.log", env)
    assert_lossless(outputs, plain_outputs)
    assert "ECOSPEC adaptive step cost per request" in text
    assert "ECOSPEC adaptive cost of a request's first candidate" in text
    copies = [
        (int(total), int(differ))
        for total, differ in re.findall(r"slot copies (\d+) \(routed differently (\d+)\)", text)
    ]
    assert copies, "no EcoSpec: line with the copy check"
    total, differ = copies[-1]  # running totals
    # Some steps verified fewer nodes than the width (copies filled the rest), and every
    # copy's captured routing equals its original's: the copies loaded no expert.
    assert total > 0 and differ == 0, copies[-1]


def test_ecospec_calibrates_its_cost_model_at_startup(
    models, prompts, plain_outputs, logs, tmp_path_factory
):
    env = {
        "SGLANG_ECOSPEC_EPS": "auto",
        "SGLANG_ECOSPEC_CALIBRATE": "on",
        "SGLANG_ECOSPEC_CALIBRATE_BATCH_SIZES": "1,2",
        "SGLANG_ECOSPEC_CALIBRATE_TOKENS": "1,2",
        "SGLANG_ECOSPEC_CALIBRATE_UNIQUE_EXPERTS": "8,16",
        "SGLANG_ECOSPEC_CALIBRATE_REPEATS": "1",
        "SGL_ECOSPEC_CACHE": str(tmp_path_factory.mktemp("cache")),  # a fresh calibration
        **NO_GATE,
    }
    args = spec_args(models, "ECOSPEC")
    outputs, _, _, text = serve(args, prompts, logs / "calibrate.log", env)
    assert_lossless(outputs, plain_outputs)
    assert "ECOSPEC: calibrating the cost model of" in text
    calibrated = r"ECOSPEC: calibrated the cost model on cpu.* in [\d.]+ s: .*residual rms"
    assert re.search(calibrated, text)
    assert "ECOSPEC calibration fit:" in text and "residuals: rms" in text
    assert re.search(r"ECOSPEC cost model: calibrated profile \S+/calibration/\S+\.json", text)
    assert "prior (fallback" not in text and "startup calibration failed" not in text


def readme_cpu_server_args(target: Path, draft: Path) -> list[str]:
    """The arguments of the README's ``bash scripts/launch_cpu.sh`` command, its ``$target``
    and ``$draft`` set to the testbed's, without ``--host 127.0.0.1 --port P`` (LocalServer
    passes them with a free loopback port)."""
    command = re.search(
        r"^bash scripts/launch_cpu\.sh (.*?[^\\])$", README.read_text(), re.S | re.M
    )
    assert command, "the README shows no `bash scripts/launch_cpu.sh` command"
    names = {"$target": str(target), "$draft": str(draft)}
    words = [names.get(word, word) for word in shlex.split(command[1].replace("\\\n", " "))]
    host, port = words.index("--host"), words.index("--port")
    assert words[host + 1] == "127.0.0.1" and words[port + 1].isdigit(), words
    return [word for i, word in enumerate(words) if i not in {host, host + 1, port, port + 1}]


def test_the_readme_cpu_server_starts_and_answers(models, prompts, logs):
    args = readme_cpu_server_args(*models)
    assert "--disable-cuda-graph" not in args  # what the launcher must add itself
    outputs, info, _, text = serve(args, prompts[:1], logs / "readme.log")
    assert info["speculative_algorithm"] == "ECOSPEC"
    assert "[launch_cpu] adding --disable-decode-cuda-graph" in text
    (output,) = outputs
    assert output["output_ids"] and output["text"].strip(), output
