"""``sgl-ecospec predictor-replay``: expert predictors' recall, memory and prediction time on
recorded verify routing, without decoding again for each predictor.

1. Record (once; the stream file is reused when it exists): the offline engine decodes the
   prompts speculatively with confidence selection, whose verify sets do not depend on any
   predictor, and keeps every verify step's rows: token, parent token (the draft tree's
   parent; for the root, the last verified token before it), the drafter state that
   proposed the row (float16) and the target's routing.
2. Replay: each predictor, cold, predicts a step's rows, is scored on them, then observes
   them, step after step in the recorded order: its online top-K recall over the run, the
   measure ``bench`` reports (overall and per layer).
3. Time: ``predict_topk`` over B = 16 requests x (1 + 36) rows (the default tree's root and
   candidates) drawn from the stream, with the tables the replay left; median of repeats.

Shape legend: T = rows of a step, L = MoE layers, K = experts per token, H = the drafter's
hidden size.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch

from sgl_ecospec.lab.bench import arguments
from sgl_ecospec.lab.bench.runs import batches, open_engine
from sgl_ecospec.lab.command_line import add_command
from sgl_ecospec.lab.config import BenchConfig, with_models
from sgl_ecospec.lab.datasets import DATASETS, load_prompts, render_chat
from sgl_ecospec.ops.bitmaps import bitmap_popcount, topk_to_bitmap
from sgl_ecospec.predictors import (
    AdjacentExpertPredictor,
    ContextExpertPredictor,
    ExpertPredictor,
    LowRankExpertHead,
    OnlineExpertPredictor,
)

HELP = "measure expert predictors' recall, memory and time on recorded verify routing"
DESCRIPTION = (
    "Records every verify step's tokens, parent tokens and routing once (confidence "
    "selection), then replays the stream through each predictor cold, online: recall "
    "(overall and per layer), table memory and prediction time for 16 requests x 37 rows."
)
STREAM_FORMAT = "sgl_ecospec.VerifyStream"
TIMED_BATCH, TIMED_ROWS = 16, 37


def _context(vocab, **kw):
    return lambda L, E, K: ContextExpertPredictor(L, E, K, vocab_size=vocab, **kw)


def _adjacent(vocab, **kw):
    return lambda L, E, K: AdjacentExpertPredictor(L, E, K, vocab_size=vocab, **kw)


def _head(hidden_size, **kw):
    return lambda L, E, K: LowRankExpertHead(hidden_size, L, E, K, **kw)


def variants(vocab_size: int, hidden_size: int | None = None) -> dict:
    """Predictor name -> factory(L, E, K) of every predictor the command measures; the heads
    on the drafter state (trained online from cold, one Adam step per verify step) only
    with ``hidden_size`` (a stream that recorded the states)."""
    pairs = {f"context-pairs{n // 1024}k": n for n in (16384, 65536, 262144)}
    table = {
        "online-4096": lambda L, E, K: OnlineExpertPredictor(L, E, K, num_buckets=4096),
        "online-16384": lambda L, E, K: OnlineExpertPredictor(L, E, K, num_buckets=16384),
        "hashed4096-uint8": _context(None, token_buckets=4096),
        "vocab-uint8": _context(vocab_size),
        "vocab-int16": _context(vocab_size, count_dtype="int16"),
        "vocab-float32": _context(vocab_size, count_dtype="float32"),
        "hashed4096-pairs64k": _context(None, token_buckets=4096, pair_buckets=65536),
    }
    table.update({name: _context(vocab_size, pair_buckets=n) for name, n in pairs.items()})
    for weight in (0.5, 2.0, 4.0):
        table[f"context-pairs64k-w{weight:g}"] = _context(
            vocab_size, pair_buckets=65536, pair_weight=weight
        )
    for weight in (0.25, 0.5, 1.0):
        table[f"adjacent-pairs16k-r{weight:g}"] = _adjacent(
            vocab_size, pair_buckets=16384, recent_weight=weight
        )
    table["adjacent-vocab-r0.5"] = _adjacent(vocab_size)
    table["adjacent-hashed4096-r0.5"] = _adjacent(None, token_buckets=4096)
    if hidden_size is not None:
        for lr in (1e-3, 1e-2):
            table[f"head-online-r64-lr{lr:g}"] = _head(hidden_size, rank=64, lr=lr)
        table["head-online-r64-vocab"] = _head(hidden_size, rank=64, token_buckets=vocab_size)
        table["head-online-r64-state-only"] = _head(hidden_size, rank=64, token_buckets=0)
    return table


class StepRecorder(ExpertPredictor):
    """Predicts with ``inner`` and keeps, on the CPU, each ``observe`` call's rows: tokens
    ``[T]``, parent tokens ``[T]``, drafter states float16 ``[T, H]`` and routing
    ``[T, L, K]``."""

    needs_context = True
    needs_hidden = True

    def __init__(self, inner: ExpertPredictor):
        super().__init__(inner.num_layers, inner.num_experts, inner.top_k)
        self.inner = inner
        self.steps: list[dict] = []

    def predict_topk(self, token_ids, hidden=None, *, validate=False, context_tokens=None):
        return self.inner.predict_topk(token_ids, None, validate=validate)

    def observe(self, token_ids, topk_ids, hidden=None, *, validate=True, context_tokens=None):
        if context_tokens is None or hidden is None:
            raise ValueError(
                "StepRecorder records parent tokens and drafter states: pass context_tokens "
                "[T] and hidden [T, H]"
            )
        self.steps.append(
            {
                "tokens": token_ids.detach().long().cpu(),
                "context": context_tokens.detach().long().cpu(),
                "hidden": hidden.detach().to(torch.float16).cpu(),
                "routing": topk_ids.detach().to(torch.int16).cpu(),
            }
        )
        self.inner.observe(token_ids, topk_ids, validate=validate)


def record(cfg: BenchConfig, engine, prompts: dict) -> dict:
    """Decodes ``prompts`` (name -> prompts) with confidence selection at ``cfg.budget``;
    returns the stream: ``{"format", "config", "shape", "steps"}``."""
    from sgl_ecospec.lab.engine import SpecConfig

    spec = SpecConfig(topk=cfg.topk, num_steps=cfg.steps, budget=cfg.budget)
    shape = (engine.num_layers, engine.num_experts, engine.top_k)
    recorder = StepRecorder(OnlineExpertPredictor(*shape))
    torch.manual_seed(cfg.seed)
    started = time.perf_counter()
    for name, items in prompts.items():
        ids = [render_chat(engine.tokenizer, p.text) for p in items]
        for group in batches(ids, cfg.batch_size):
            engine.generate_speculative(group, cfg.max_new_tokens, spec, predictor=recorder)
            print(
                f"[record] {name}: {len(recorder.steps)} verify steps, "
                f"{time.perf_counter() - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )
    return {
        "format": STREAM_FORMAT,
        "config": {**cfg.to_dict(), "num_prompts": {n: len(p) for n, p in prompts.items()}},
        "shape": {"num_layers": shape[0], "num_experts": shape[1], "top_k": shape[2]},
        "vocab_size": engine.target.config.vocab_size,
        "hidden_size": engine.draft.config.hidden_size,
        "steps": recorder.steps,
    }


def load_stream(path: str) -> dict:
    stream = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(stream, dict) or stream.get("format") != STREAM_FORMAT:
        raise ValueError(f"{path!r} is not a verify stream written by predictor-replay")
    return stream


def _inputs(predictor: ExpertPredictor, step: dict) -> tuple:
    """(hidden or None, keyword arguments) of ``predictor``'s calls on a recorded step."""
    context = {"context_tokens": step["context"]} if predictor.needs_context else {}
    return (step["hidden"].float() if predictor.needs_hidden else None), context


def replay(predictor: ExpertPredictor, steps: list[dict]) -> dict:
    """Online recall of ``predictor`` over ``steps`` (predict, score, then observe each):
    ``recall`` and ``recall_per_layer`` over every row, and ``rows``."""
    hits = torch.zeros(predictor.num_layers, dtype=torch.float64)
    rows = 0
    for step in steps:
        hidden, context = _inputs(predictor, step)
        routing = step["routing"].long()
        pred = predictor.predict_topk(step["tokens"], hidden, **context)
        found = bitmap_popcount(
            topk_to_bitmap(pred, predictor.num_experts)
            & topk_to_bitmap(routing, predictor.num_experts)
        )
        hits += found.double().sum(0) / predictor.top_k
        rows += routing.shape[0]
        predictor.observe(step["tokens"], routing, hidden, validate=False, **context)
    per_layer = (hits / max(rows, 1)).tolist()
    return {"recall": sum(per_layer) / len(per_layer), "recall_per_layer": per_layer, "rows": rows}


def predict_ms(predictor: ExpertPredictor, steps: list[dict], repeats: int = 50) -> float:
    """Median milliseconds of one ``predict_topk`` over 16 x 37 rows drawn from ``steps``."""
    rows = sum(s["tokens"].shape[0] for s in steps)
    pick = torch.randint(
        0, rows, (TIMED_BATCH * TIMED_ROWS,), generator=torch.Generator().manual_seed(0)
    )
    drawn = {key: torch.cat([s[key] for s in steps])[pick] for key in steps[0]}
    hidden, extra = _inputs(predictor, drawn)
    times = []
    for _ in range(repeats + 5):
        started = time.perf_counter()
        predictor.predict_topk(drawn["tokens"], hidden, **extra)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times[5:])


def memory_bytes(predictor: ExpertPredictor) -> int:
    """Bytes of the predictor's tables (every tensor attribute) or, for a module (a head),
    its parameters and buffers (its optimiser's state not counted)."""
    if isinstance(predictor, torch.nn.Module):
        tensors = [*predictor.parameters(), *predictor.buffers()]
    else:
        tensors = [v for v in vars(predictor).values() if isinstance(v, torch.Tensor)]
    return sum(v.numel() * v.element_size() for v in tensors)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``predictor-replay`` on ``subparsers``."""
    parser = add_command(subparsers, "predictor-replay", run, HELP, DESCRIPTION)
    parser.add_argument(
        "--stream", required=True, metavar="FILE", help="recorded stream (written when missing)"
    )
    parser.add_argument("--variants", help="comma-separated predictor names (default: all)")
    data = parser.add_argument_group("recording")
    data.add_argument(
        "--dataset", default="mt-bench,humaneval", help=f"comma-separated: {', '.join(DATASETS)}"
    )
    data.add_argument("--num-prompts", type=int, default=4, help="prompts per dataset")
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--max-new-tokens", type=int, default=48)
    data.add_argument("--batch-size", type=int, default=1)
    arguments.add_tree_arguments(data)
    arguments.add_model_arguments(parser)
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    return parser


def run(args: argparse.Namespace) -> int:
    """The ``predictor-replay`` command."""
    if not os.path.isfile(args.stream):
        cfg = BenchConfig(
            datasets=tuple(d.strip() for d in args.dataset.split(",") if d.strip()),
            num_prompts=args.num_prompts,
            seed=args.seed,
            max_new_tokens=args.max_new_tokens,
            batch_size=args.batch_size,
            topk=args.topk,
            steps=args.steps,
            budget=args.budget,
            policies=("confidence",),
            target=args.target,
            draft=args.draft,
            small=args.small,
            device=args.device,
            dtype=args.dtype,
        )
        prompts = {
            n: load_prompts(n, num_prompts=cfg.num_prompts, seed=cfg.seed) for n in cfg.datasets
        }
        cfg = with_models(cfg, build_testbed=True)
        torch.save(record(cfg, open_engine(cfg, "predictor replay"), prompts), args.stream)
    stream = load_stream(args.stream)
    shape = stream["shape"]
    table = variants(stream["vocab_size"], stream.get("hidden_size"))
    names = list(table) if not args.variants else [n.strip() for n in args.variants.split(",")]
    unknown = [n for n in names if n not in table]
    heads = [n for n in unknown if n.startswith("head-")]
    if heads and stream.get("hidden_size") is None:
        raise ValueError(
            f"{args.stream!r} was recorded without the drafter states the heads read: delete it "
            "(or pass another --stream) to record it again"
        )
    if unknown:
        raise ValueError(f"unknown --variants {unknown}; valid: {', '.join(table)}")
    results = {}
    print(f"{'predictor':28} {'recall':>6} {'MiB':>8} {'ms/pred':>8}")
    for name in names:
        predictor = table[name](shape["num_layers"], shape["num_experts"], shape["top_k"])
        started = time.perf_counter()
        result = replay(predictor, stream["steps"])
        result["replay_seconds"] = time.perf_counter() - started
        result["memory_bytes"] = memory_bytes(predictor)
        result["predict_ms"] = predict_ms(predictor, stream["steps"])
        results[name] = result
        print(
            f"{name:28} {result['recall']:6.3f} {result['memory_bytes'] / 2**20:8.1f} "
            f"{result['predict_ms']:8.3f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "stream": stream["config"],
                    "rows": results[names[0]]["rows"],
                    "predictors": results,
                },
                f,
                indent=2,
            )
    return 0
