"""Serving benchmark: one server per algorithm, SGLang's own bench_serving against each.

``bash scripts/bench_serving.sh [options]`` (= ``python -m sgl_ecospec.lab.serving.bench_serving``)
starts a server for each of ``--algorithms`` (none, eagle3, ecospec-confidence, ecospec),
runs ``python -m sglang.bench_serving --backend sglang`` with packaged prompts (MT-Bench or
ShareGPT first turns, written to an offline ShareGPT-format file) at every
``--concurrency``, and prints one table: output throughput (and its ratio to the server
without speculation), mean TPOT, acceptance length (from SGLang's ``/metrics`` counters
before and after the phase), and, for ECOSPEC servers, unique experts per layer per verify
step and predictor recall (from the scheduler's ``EcoSpec:`` log lines of that phase).
With ``--rounds R`` every algorithm is measured R times in turn and the medians reported.

``ecospec-confidence`` is ECOSPEC with ``policy=confidence`` and the utility gate off: EAGLE3's
verify sets in every step (equality tested), measured by the plugin, so its expert count is
EAGLE3's; the ``eagle3`` row is SGLang's own worker, for throughput. ``ecospec`` is ECOSPEC as
an operator gets it (utility gate on; the run's ECOSPEC servers share a gate memory that is
empty at the run's start, so a later round's server starts where the last one settled).

Without a GPU the servers run in the CPU development mode (``scripts/launch_cpu.sh``) on the
small testbed by default. On a GPU pass ``--model-path``, ``--draft-model-path`` and any
server flags in ``--server-args``.
"""

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sgl_ecospec.lab.serving.local_server import (
    LocalServer,
    ServerError,
    counter_fields,
    ecospec_log_summary,
    gpu_present,
)
from sgl_ecospec.lab.serving.predicted import (
    add_predictions,
    describe,
    load_profile,
    predict_from,
)
from sgl_ecospec.lab.serving.prompts import warmup_prompt, write_sharegpt_file
from sgl_ecospec.lab.serving.report import (
    add_speed_ratios,
    combine,
    compare_outputs,
    format_table,
    plot_throughput,
)
from sgl_ecospec.lab.serving.server_memory import resolve_server_mode
from sgl_ecospec.ops.selection import SelectionOptions

ALGORITHMS = ("none", "eagle3", "ecospec-confidence", "ecospec")
GATE_MEMORY_ENV = "SGLANG_ECOSPEC_GATE_MEMORY"
DATASETS = ("mt-bench", "sharegpt")
TESTBEDS = ("small", "full", "bandwidth")
SERVER_MODES = ("auto", "together", "one-at-a-time")
# What the CPU development mode needs (docs/sglang.md); the memory pool is host RAM.
CPU_SERVER_ARGS = (
    "--dtype float32 --max-total-tokens 8192 --disable-cuda-graph --skip-server-warmup "
    "--attention-backend triton"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="scripts/bench_serving.sh",
        description="Throughput, TPOT, acceptance length and unique experts per verify step "
        "of SGLang servers without speculation, with EAGLE3 and with ECOSPEC.",
    )
    parser.add_argument("--model-path", help="target model (default: --testbed's)")
    parser.add_argument("--draft-model-path", help="EAGLE-3 draft (default: the testbed's)")
    parser.add_argument(
        "--testbed",
        choices=TESTBEDS,
        default="small",
        help="without --model-path: which testbed (built on first use); 'bandwidth' has "
        "routed experts that weigh what Qwen3-235B-A22B's do (docs/testbed.md)",
    )
    parser.add_argument(
        "--servers",
        choices=SERVER_MODES,
        default="auto",
        help="'together': every algorithm's server up at once; 'one-at-a-time': each "
        "started for its turn of each round; 'auto': together when their memory fits",
    )
    parser.add_argument("--plot", metavar="PNG", help="plot tok/s against concurrency")
    parser.add_argument(
        "--profile",
        metavar="FILE",
        help="a calibration profile (sgl-ecospec calibrate --out FILE) of the served target on "
        "this device: each phase's TPOT predicted next to the measured one",
    )
    parser.add_argument(
        "--predict-from",
        metavar="JSON",
        help="with --profile: price the phases of an earlier run's --json file, start no server",
    )
    parser.add_argument(
        "--server-step",
        metavar="JSON",
        help="with --profile: a plain server's run (--algorithms none --json FILE, other "
        "prompts, this machine); what SGLang adds to the forward per step is priced from it",
    )
    parser.add_argument(
        "--algorithms",
        default=",".join(ALGORITHMS),
        help=f"comma-separated, from {', '.join(ALGORITHMS)}",
    )
    parser.add_argument("--dataset", choices=DATASETS, default="mt-bench")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per concurrency")
    parser.add_argument("--output-len", type=int, default=32, help="new tokens per request")
    parser.add_argument("--concurrency", default="1,4", help="comma-separated concurrencies")
    parser.add_argument("--num-steps", type=int, default=3, help="--speculative-num-steps")
    parser.add_argument("--topk", type=int, default=4, help="--speculative-eagle-topk")
    parser.add_argument(
        "--num-draft-tokens", type=int, default=5, help="--speculative-num-draft-tokens"
    )
    parser.add_argument("--eps", type=float, help="EcoSpec eps (SGLANG_ECOSPEC_EPS)")
    parser.add_argument(
        "--ecospec-setting",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an EcoSpec setting of the ECOSPEC servers (SGLANG_ECOSPEC_<NAME>, docs/sglang.md, "
        "'Settings'; the server checks it at startup), e.g. policy=adaptive; repeatable",
    )
    parser.add_argument(
        "--server-args",
        default=None,
        help=f"extra server flags (default on CPU: {CPU_SERVER_ARGS!r})",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt subset and order")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every algorithm this many times in turn and report the medians "
        "(a machine whose speed drifts, e.g. a shared CPU)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the runs as JSON")
    parser.add_argument("--log-dir", help="keep server and client logs here")
    return parser


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must list integers >= 1, got {text!r}")
    return values


def _settings(pairs: list[str]) -> dict[str, str]:
    """``--ecospec-setting NAME=VALUE`` flags as {name: value}; ValueError on a malformed one
    (the names and values are the server's to check)."""
    settings = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip().lower()
        if not sep or not name or not name.replace("_", "").isalnum():
            raise ValueError(f"--ecospec-setting must be NAME=VALUE, got {pair!r}")
        if name in settings:
            raise ValueError(f"--ecospec-setting sets {name!r} twice")
        settings[name] = value.strip()
    return settings


def validate(args: argparse.Namespace) -> dict:
    """The run's configuration; ValueError on invalid arguments (before any server starts)."""
    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown or not algorithms:
        raise ValueError(
            f"unknown --algorithms {unknown or args.algorithms!r}; valid: {ALGORITHMS}"
        )
    if len(set(algorithms)) != len(algorithms):
        raise ValueError(f"--algorithms lists one twice: {args.algorithms!r}")
    for flag in ("num_prompts", "output_len", "num_steps", "topk", "num_draft_tokens", "rounds"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.output_len < 4:
        raise ValueError(f"--output-len must be >= 4 (sglang.bench_serving), got {args.output_len}")
    if args.eps is not None:
        try:
            SelectionOptions(eps=args.eps)
        except ValueError as exc:
            raise ValueError(f"--{exc}") from None
    if (args.model_path is None) != (args.draft_model_path is None) and any(
        a != "none" for a in algorithms
    ):
        raise ValueError("give both --model-path and --draft-model-path, or neither (testbed)")
    settings = _settings(args.ecospec_setting)
    if args.eps is not None and "eps" in settings:
        raise ValueError("eps given twice: --eps and --ecospec-setting eps=")
    cpu = not gpu_present()
    server_args = args.server_args
    if server_args is None:
        server_args = CPU_SERVER_ARGS if cpu else ""
    return {
        "algorithms": algorithms,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "output_len": args.output_len,
        "concurrency": _ints(args.concurrency, "--concurrency"),
        "num_steps": args.num_steps,
        "topk": args.topk,
        "num_draft_tokens": args.num_draft_tokens,
        "eps": args.eps,
        "ecospec_settings": settings,
        "server_args": shlex.split(server_args),
        "seed": args.seed,
        "rounds": args.rounds,
        "servers": args.servers,
        "testbed": args.testbed if args.model_path is None else None,
        "cpu": cpu,
        "model_path": args.model_path,
        "draft_model_path": args.draft_model_path,
    }


def testbed_paths(testbed: str) -> tuple[str, str]:
    """(target, draft) directories of a testbed, built first when not cached."""
    if testbed == "bandwidth":
        from sgl_ecospec.lab.testbed import bandwidth

        out = bandwidth.build(force=False)
        return str(out / "target"), str(out / "draft")
    from sgl_ecospec.lab.config import testbed_models

    return testbed_models(small=testbed == "small")


def server_launch(cfg: dict, algorithm: str) -> tuple[list[str], dict]:
    """(server arguments, extra environment) of one algorithm's server."""
    args = ["--model-path", cfg["model_path"], *cfg["server_args"]]
    # Metrics on every server alike: the phase's acceptance length comes from its counters.
    args += ["--max-running-requests", str(max(cfg["concurrency"])), "--enable-metrics"]
    args += ["--sleep-on-idle"]  # the servers wait side by side (run)
    env = {}
    if algorithm != "none":
        name = "EAGLE3" if algorithm == "eagle3" else "ECOSPEC"
        args += [
            "--speculative-algorithm",
            name,
            "--speculative-draft-model-path",
            cfg["draft_model_path"],
            "--speculative-num-steps",
            str(cfg["num_steps"]),
            "--speculative-eagle-topk",
            str(cfg["topk"]),
            "--speculative-num-draft-tokens",
            str(cfg["num_draft_tokens"]),
        ]
    if algorithm.startswith("ecospec"):
        env["SGLANG_ECOSPEC_LOG_INTERVAL"] = "4"
        if cfg["eps"] is not None:
            env["SGLANG_ECOSPEC_EPS"] = str(cfg["eps"])
        # ECOSPEC as an operator gets it: the server's defaults and the settings given.
        for name, value in cfg.get("ecospec_settings", {}).items():
            env[f"SGLANG_ECOSPEC_{name.upper()}"] = value
        if algorithm == "ecospec-confidence":  # EAGLE3's verify sets in every step
            env.update(SGLANG_ECOSPEC_POLICY="confidence", SGLANG_ECOSPEC_GATE="0")
            env.pop("SGLANG_ECOSPEC_EPS", None)
    return args, env


def run_client(cfg: dict, server: LocalServer, dataset_file: Path, concurrency: int, out: Path):
    """One ``sglang.bench_serving`` run; returns its result record (the JSONL line)."""
    command = [
        sys.executable,
        "-m",
        "sglang.bench_serving",
        "--backend",
        "sglang",
        "--host",
        "127.0.0.1",
        "--port",
        str(server.port),
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(dataset_file),
        "--num-prompts",
        str(cfg["num_prompts"]),
        "--sharegpt-output-len",
        str(cfg["output_len"]),
        "--tokenizer",
        cfg["model_path"],
        "--max-concurrency",
        str(concurrency),
        "--seed",
        str(cfg["seed"]),
        "--output-file",
        str(out),
        "--disable-tqdm",
        "--output-details",  # the generated texts, compared with the plain server's
        # run() warms the server up before it marks the log: bench_serving's own warmup
        # request would land inside the measured window (a batch of one at any concurrency).
        "--warmup-requests",
        "0",
    ]
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode != 0 or not out.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"sglang.bench_serving failed ({done.returncode}):\n{tail}")
    return json.loads(out.read_text().strip().splitlines()[-1])


def measure(
    cfg: dict, server: LocalServer, algorithm: str, concurrency: int, dataset_file, out, warmup
):
    """One phase: a warmup request (``warmup``, :func:`warmup_prompt`), then
    ``sglang.bench_serving`` at ``concurrency``; the phase's record (throughput and latencies
    from the client, acceptance from the server's counters, EcoSpec's statistics from its log
    lines of the phase)."""
    server.generate(warmup, 4)
    offset = server.log_size()
    counters = server.metrics()
    t0 = time.monotonic()
    result = run_client(cfg, server, dataset_file, concurrency, out)
    phase_log = server.log_text(offset)
    counted = counter_fields(counters, server.metrics(), result.get("completed") or 0)
    stats = ecospec_log_summary(phase_log)
    return {
        "algorithm": algorithm,
        "concurrency": concurrency,
        "completed": result.get("completed"),
        "output_throughput": result.get("output_throughput"),
        "mean_tpot_ms": result.get("mean_tpot_ms"),
        "median_tpot_ms": result.get("median_tpot_ms"),
        "mean_ttft_ms": result.get("mean_ttft_ms"),
        "mean_input_len": (result.get("total_input_tokens") or 0) / max(1, result["completed"]),
        **counted,
        "experts_per_layer_step": stats["experts_per_layer_step"],
        "predictor_recall": stats["predictor_recall"],
        "verify_steps_logged": stats["verify_steps"],
        "spec_accept_length": stats["spec_accept_length"],
        "wall_seconds": time.monotonic() - t0,
        "generated_texts": result.get("generated_texts"),
    }


@contextlib.contextmanager
def started_server(cfg: dict, work: Path, algorithm: str, log_name: str, log=print):
    """One algorithm's server, up until the block ends (stopped even on errors)."""
    args, env = server_launch(cfg, algorithm)
    mode = "CPU mode" if cfg["cpu"] else "GPU"
    log(f"[bench_serving] {algorithm}: starting server ({mode})")
    start = time.monotonic()
    with LocalServer(args, work / log_name, env=env, cpu=cfg["cpu"]) as server:
        log(f"[bench_serving] {algorithm}: ready after {time.monotonic() - start:.0f} s")
        yield server


def round_order(algorithms: list[str], round_: int) -> list[str]:
    """The algorithms in the order round ``round_`` (from 1) measures them (:func:`run`)."""
    shift = (round_ - 1) % len(algorithms)
    return algorithms[shift:] + algorithms[:shift]


def run(cfg: dict, work: Path, log=print) -> list[dict]:
    """Every algorithm at every concurrency, ``cfg["rounds"]`` times over; one record per
    (algorithm, concurrency) (:func:`combine`), its outputs compared with the plain server's.

    Each round measures every algorithm in turn, and each round starts one algorithm later
    than the last (round 2 of none, eagle3, ecospec runs eagle3, ecospec, none), so neither
    a drift of the machine's speed nor a place in the round favours one algorithm.
    With ``cfg["servers"] == "together"`` all servers start first and sleep while idle
    (``--sleep-on-idle``: an idle scheduler otherwise spins a core); with "one-at-a-time"
    each algorithm's server starts for its turn of each round and stops after it (models of
    which only one copy fits in memory)."""
    dataset_file = work / f"{cfg['dataset']}.json"
    if "gate_memory" not in cfg["ecospec_settings"] and GATE_MEMORY_ENV not in os.environ:
        memory = work / "gate-memory"  # the run's own (module docstring)
        shutil.rmtree(memory, ignore_errors=True)
        cfg["ecospec_settings"]["gate_memory"] = str(memory)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg["model_path"])
    write_sharegpt_file(cfg["dataset"], cfg["num_prompts"], cfg["seed"], dataset_file, tokenizer)
    warmup = warmup_prompt(tokenizer)
    measured: dict[tuple[str, int], list[dict]] = {}
    with contextlib.ExitStack() as servers_up:
        servers = {}
        if cfg["servers"] == "together":
            for algorithm in cfg["algorithms"]:
                server = started_server(cfg, work, algorithm, f"server-{algorithm}.log", log)
                servers[algorithm] = servers_up.enter_context(server)
        for round_ in range(1, cfg["rounds"] + 1):
            for algorithm in round_order(cfg["algorithms"], round_):
                if algorithm in servers:
                    turn = contextlib.nullcontext(servers[algorithm])
                else:
                    name = f"server-{algorithm}-r{round_}.log"
                    turn = started_server(cfg, work, algorithm, name, log)
                with turn as server:
                    for concurrency in cfg["concurrency"]:
                        out = work / f"client-{algorithm}-c{concurrency}-r{round_}.jsonl"
                        record = measure(
                            cfg, server, algorithm, concurrency, dataset_file, out, warmup
                        )
                        measured.setdefault((algorithm, concurrency), []).append(record)
                        log(
                            f"[bench_serving] round {round_}/{cfg['rounds']} {algorithm} "
                            f"c={concurrency}: {record['output_throughput']:.2f} tok/s "
                            f"({record['wall_seconds']:.0f} s)"
                        )
    runs = [combine(records) for records in measured.values()]
    add_speed_ratios(runs)
    compare_outputs(runs, measured)
    return runs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.predict_from:
        if not args.profile:
            print("bench_serving: error: --predict-from needs --profile FILE", file=sys.stderr)
            return 2
        return predict_from(args.predict_from, args.profile, args.server_step)
    if args.server_step and not args.profile:
        print("bench_serving: error: --server-step needs --profile FILE", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so every started server is stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        cfg = validate(args)
        if cfg["model_path"] is None:
            print(f"[bench_serving] using the {cfg['testbed']} testbed (built on first use)")
            cfg["model_path"], cfg["draft_model_path"] = testbed_paths(cfg["testbed"])
        for key in ("model_path", "draft_model_path"):
            if cfg[key] is not None and not Path(cfg[key]).exists():
                raise FileNotFoundError(f"--{key.replace('_', '-')} {cfg[key]!r} does not exist")
        cfg["servers"] = resolve_server_mode(cfg, print)
        pricing = load_profile(args.profile, args.server_step) if args.profile else None
    except (ValueError, FileNotFoundError) as exc:
        print(f"bench_serving: error: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="ecospec-bench-serving-") as tmp:
        work = Path(args.log_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        try:
            runs = run(cfg, work, log=lambda s: print(s, flush=True))
        except (ServerError, RuntimeError) as exc:
            print(f"bench_serving: error: {exc}", file=sys.stderr)
            return 1
    print()
    if pricing is not None:
        add_predictions(runs, cfg, pricing)
        print(describe(pricing))
    print(format_table(runs))
    if args.plot:
        name = Path(cfg["model_path"]).parent.name + "/" + Path(cfg["model_path"]).name
        plot_throughput(runs, Path(args.plot), f"sglang.bench_serving, {name}")
        print(f"[bench_serving] plot: {args.plot}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"config": cfg, "runs": runs}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
