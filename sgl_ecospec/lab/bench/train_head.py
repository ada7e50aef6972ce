"""The ``sgl-ecospec train-head`` command: trains a :class:`LowRankExpertHead` on real routing.

1. Record: the offline engine decodes training prompts speculatively (confidence selection,
   the tree of the run) with the online predictor; every verify row's token, the draft
   state behind it (the root's own, or the state that proposed the candidate) and the
   target's real top-K routing are kept. The online predictor's recall on those rows,
   measured before it learnt from each step, is the baseline.
2. Train: ``train_expert_head`` on the recorded triples; the last rows (later prompts) are
   held out, and an online count table fitted on the same training rows is measured on
   them too, the baseline the head has to beat.
3. Write the head (``LowRankExpertHead.save``): ``sgl-ecospec bench --predictor head
   --predictor-file FILE`` evaluates it on other prompts, and the SGLang plugin serves with
   it (``SGLANG_ECOSPEC_PREDICTOR=head``, ``SGLANG_ECOSPEC_PREDICTOR_FILE=FILE``).

Training prompts default to ShareGPT, which the benchmark's datasets (MT-Bench, HumanEval,
GSM8K) do not overlap.

Shape legend: T = recorded verify rows, L = MoE layers, K = experts per token, H = draft
hidden size.
"""

import argparse
import json
import sys
import time

import torch

from sgl_ecospec.lab.bench import arguments
from sgl_ecospec.lab.bench.runs import open_engine
from sgl_ecospec.lab.command_line import add_command
from sgl_ecospec.lab.config import TrainHeadConfig, with_models
from sgl_ecospec.lab.datasets import DATASETS, load_prompts, render_chat
from sgl_ecospec.predictors import (
    ExpertPredictor,
    LowRankExpertHead,
    OnlineExpertPredictor,
    train_expert_head,
)

HELP = "train the context-aware expert predictor (LowRankExpertHead) on real routing"
DESCRIPTION = (
    "Records (token, draft state, routing) of every verified token while the offline engine "
    "decodes training prompts, trains a LowRankExpertHead on them and writes it for "
    "`sgl-ecospec bench --predictor head` and the SGLang plugin."
)


class RoutingRecorder(ExpertPredictor):
    """An :class:`ExpertPredictor` that predicts with ``inner`` and keeps, on the CPU, every
    (token, draft state, routing) triple it is asked to observe before passing it on."""

    needs_hidden = True  # so the engine hands over the draft states

    def __init__(self, inner: ExpertPredictor):
        super().__init__(inner.num_layers, inner.num_experts, inner.top_k)
        self.inner = inner
        self.tokens: list[torch.Tensor] = []  # int64 [t]
        self.hidden: list[torch.Tensor] = []  # float32 [t, H]
        self.routing: list[torch.Tensor] = []  # int64 [t, L, K]

    def predict_topk(self, token_ids, hidden=None, *, validate=False):
        return self.inner.predict_topk(
            token_ids, hidden if self.inner.needs_hidden else None, validate=validate
        )

    def observe(self, token_ids, topk_ids, hidden=None, *, validate=True):
        if hidden is None:
            raise ValueError("RoutingRecorder records draft states: pass hidden [T, H]")
        self.tokens.append(token_ids.detach().long().cpu())
        self.hidden.append(hidden.detach().float().cpu())
        self.routing.append(topk_ids.detach().long().cpu())
        self.inner.observe(token_ids, topk_ids, hidden, validate=validate)

    def recorded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens ``[T]``, hidden ``[T, H]``, routing ``[T, L, K]``) recorded so far."""
        if not self.tokens:
            raise ValueError("nothing was recorded: no verify step ran")
        return torch.cat(self.tokens), torch.cat(self.hidden), torch.cat(self.routing)


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Registers ``train-head`` on ``subparsers``."""
    parser = add_command(subparsers, "train-head", run, HELP, DESCRIPTION)
    data = parser.add_argument_group("training prompts")
    data.add_argument(
        "--dataset",
        default="sharegpt",
        help=f"comma-separated: {', '.join(DATASETS)} or .jsonl paths (default: sharegpt)",
    )
    data.add_argument("--num-prompts", type=int, default=64, help="prompts per dataset")
    data.add_argument("--seed", type=int, default=0, help="picks the prompts and the split")
    arguments.add_decoding_group(parser, batch_size=4)
    head = parser.add_argument_group("head")
    head.add_argument("--rank", type=int, default=64, help="bottleneck width")
    head.add_argument(
        "--token-buckets", type=int, default=4096, help="hashed token embedding rows (0: none)"
    )
    head.add_argument("--epochs", type=int, default=10)
    head.add_argument("--lr", type=float, default=3e-3)
    head.add_argument("--val-fraction", type=float, default=0.1, help="share held out")
    arguments.add_model_arguments(parser)
    out = parser.add_argument_group("output")
    out.add_argument("--out", required=True, metavar="FILE", help="where the head is written")
    out.add_argument("--json", metavar="FILE", help="write the training report as JSON")
    out.add_argument(
        "--save-table",
        metavar="FILE",
        help="also write the online count table learnt while recording: the same prompts as "
        "a warm start for --predictor online, to compare the head with",
    )
    return parser


def record(cfg: TrainHeadConfig, engine, prompts: list) -> tuple[RoutingRecorder, float]:
    """Decodes ``prompts`` speculatively (confidence selection) and records every verify row;
    returns the recorder and the online predictor's recall over those rows."""
    from sgl_ecospec.lab.engine import SpecConfig

    spec = SpecConfig(topk=cfg.topk, num_steps=cfg.steps, budget=cfg.budget)
    online = OnlineExpertPredictor(
        engine.num_layers, engine.num_experts, engine.top_k, device=cfg.device
    )
    recorder = RoutingRecorder(online)
    ids = [render_chat(engine.tokenizer, p.text) for p in prompts]
    batches = [ids[i : i + cfg.batch_size] for i in range(0, len(ids), cfg.batch_size)]
    started = time.perf_counter()
    recalls = []  # (recall, verified rows) per batch
    for number, batch in enumerate(batches, 1):
        result = engine.generate_speculative(batch, cfg.max_new_tokens, spec, recorder)
        rows = sum(step.verified_tokens for step in result.steps)
        recalls.append((result.predictor_recall or 0.0, rows))
        print(
            f"recording: batch {number}/{len(batches)}, {sum(n for _, n in recalls)} verify "
            f"rows, {time.perf_counter() - started:.0f} s",
            file=sys.stderr,
            flush=True,
        )
    total = sum(n for _, n in recalls)
    if not total:
        raise ValueError("no verify step ran: give longer --max-new-tokens or more prompts")
    return recorder, sum(r * n for r, n in recalls) / total


def table_recall(engine, tokens, routing, val_fraction: float) -> float:
    """Recall on the held-out rows of an online count table that observed the training rows:
    the baseline the head has to beat, on the head's split."""
    cut = tokens.shape[0] - int(tokens.shape[0] * val_fraction)
    table = OnlineExpertPredictor(engine.num_layers, engine.num_experts, engine.top_k)
    table.observe(tokens[:cut], routing[:cut])
    return table.recall(tokens[cut:], routing[cut:])


def run(args: argparse.Namespace) -> int:
    """The ``train-head`` command."""
    cfg = TrainHeadConfig.from_args(args)
    prompts = []
    for name in cfg.datasets:
        prompts += load_prompts(name, num_prompts=cfg.num_prompts, seed=cfg.seed)
    cfg = with_models(cfg, build_testbed=True)
    engine = open_engine(cfg, "train-head")
    torch.manual_seed(cfg.seed)
    recorder, online_recall = record(cfg, engine, prompts)
    tokens, hidden, routing = recorder.recorded()
    head = LowRankExpertHead(
        hidden.shape[1],
        engine.num_layers,
        engine.num_experts,
        engine.top_k,
        rank=cfg.rank,
        token_buckets=cfg.token_buckets,
    )
    history = train_expert_head(
        head,
        hidden,
        routing,
        tokens,
        epochs=cfg.epochs,
        lr=cfg.lr,
        val_fraction=cfg.val_fraction,
        holdout="last",
        seed=cfg.seed,
    )
    head.save(cfg.out)
    if cfg.save_table:
        recorder.inner.save(cfg.save_table)
    report = {
        "config": cfg.to_dict(),
        "recorded_rows": int(tokens.shape[0]),
        "online_recall": online_recall,
        "online_table_val_recall": table_recall(engine, tokens, routing, cfg.val_fraction),
        "history": history,
        "val_recall": history[-1]["val_recall"],
    }
    print(
        f"recorded {report['recorded_rows']} verify rows; held-out recall (last "
        f"{cfg.val_fraction:.0%} of the rows, later prompts): head "
        f"{report['val_recall']:.3f}, online count table fitted on the same rows "
        f"{report['online_table_val_recall']:.3f} (while decoding: {online_recall:.3f}); "
        f"wrote {cfg.out}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
