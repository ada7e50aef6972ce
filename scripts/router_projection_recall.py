"""How well the target's own routers predict a draft candidate's experts (issue 16's "router
projection"), measured offline on the full testbed.

A candidate's input to MoE layer l is unknown until it is verified, but its token and the
tokens before it are, and so is the input to layer l of the last verified token (the
anchor: the plugin sees it at every verify step). Each layer's router logits are fitted
(ridge regression, float32) on these features from ShareGPT text the benchmark never sees:

- ``token``: the candidate's embedding alone;
- ``root``: plus the parent's input to layer l (the parent was verified: a verify step's
  first row, its root);
- ``depth1``: plus the parent's embedding and the grandparent's input to layer l (a child
  of the root: its parent is being verified in the same pass);
- ``depth2``: plus the two parents' embeddings and the input to layer l three tokens back.

Each is measured alone and mixed with a per-token count table learnt online from a cold
start in stream order (``+table``: the softmax of the fitted logits plus ``--table-weight``
times the token's normalised counts; the table alone, with the fitted ``token`` logits for
tokens not seen yet, is ``table``). Recall is top-K recall against the true routing on the
greedy continuations of MT-Bench and HumanEval prompts (teacher forced; prompt rows are not
scored). The fitted token part is a ``[V, L, E]`` table, the anchor part ``[L, H, E]``
applied once per request and step; the script times that prediction for 16 x 36 candidates.

    .venv/bin/python scripts/router_projection_recall.py --json results/router_projection.json
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sgl_ecospec.lab.config import testbed_models
from sgl_ecospec.lab.datasets import load_prompts, render_chat
from sgl_ecospec.lab.testbed.assets import sharegpt_conversations
from sgl_ecospec.lab.testbed.data import render
from sgl_ecospec.predictors import topk_recall

# ShareGPT conversations from here on are in no testbed slice (calibration 0-800, evaluation
# 800-1200, the draft's 1200-2400) and in no benchmark.
TRAIN_START = 2400
FEATURES = ("token", "root", "depth1", "depth2")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Capture:
    """Runs the target teacher forced and keeps each MoE layer's router input and routing.

    Shapes: T = tokens, L = MoE layers, H = hidden size, K = experts per token."""

    def __init__(self, path: str):
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        layers = self.model.model.layers
        dense = [i for i, layer in enumerate(layers) if not hasattr(layer.mlp, "gate")]
        if dense:
            raise ValueError(
                f"{path!r}: layers {dense} have no MoE router (mlp.gate); this script measures "
                "targets whose every layer is MoE, such as the testbed's"
            )
        self.gates = [layer.mlp.gate for layer in layers]
        self.top_k = self.model.config.num_experts_per_tok
        self._seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, gate in enumerate(self.gates):
            gate.register_forward_hook(self._hook(i))

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            x = inputs[0].reshape(-1, inputs[0].shape[-1])
            self._seen[layer] = (x.half(), output[2].reshape(-1, output[2].shape[-1]))

        return hook

    @torch.no_grad()
    def run(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """float16 router inputs ``[T, L, H]`` and int64 routing ``[T, L, K]`` of ``ids``."""
        self.model(input_ids=torch.tensor([ids]))
        layers = range(len(self.gates))
        x = torch.stack([self._seen[i][0] for i in layers], 1)
        return x, torch.stack([self._seen[i][1].long() for i in layers], 1)

    @torch.no_grad()
    def continuation(self, ids: list[int], new_tokens: int) -> list[int]:
        out = self.model.generate(
            torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, top_p=None
        )
        return out[0].tolist()


def collect(capture: Capture, sequences, first_scored) -> dict:
    """Concatenates the sequences' captures; ``scored`` bool ``[T]`` marks the rows measured
    (``first_scored[i]`` on, and at least 3 rows into the sequence so every feature has its
    earlier tokens)."""
    xs, routes, tokens, scored = [], [], [], []
    for n, (ids, first) in enumerate(zip(sequences, first_scored, strict=True)):
        x, r = capture.run(ids)
        xs.append(x)
        routes.append(r)
        tokens.append(torch.tensor(ids))
        scored.append(torch.arange(len(ids)) >= max(3, first))
        if (n + 1) % 20 == 0:
            log(f"  {n + 1}/{len(sequences)} sequences")
    return {
        "x": torch.cat(xs),
        "routing": torch.cat(routes),
        "tokens": torch.cat(tokens),
        "rows": torch.cat(scored).nonzero().squeeze(1),
    }


def features(data: dict, embed: torch.Tensor, layer: int, kind: str) -> torch.Tensor:
    """float32 ``[R, F]``: the features of the scored rows (last column: 1, the bias)."""
    rows, tokens, x = data["rows"], data["tokens"], data["x"]
    parts = [embed[tokens[rows]]]
    back = {"token": 0, "root": 1, "depth1": 2, "depth2": 3}[kind]
    parts += [embed[tokens[rows - d]] for d in range(1, back)]
    if back:
        parts.append(x[rows - back, layer].float())
    parts.append(torch.ones(len(rows), 1))
    return torch.cat(parts, 1)


def recall_of(scores: torch.Tensor, routing: torch.Tensor, k: int) -> float:
    """:func:`topk_recall` of the top-k of ``scores`` float ``[R, E]`` against ``routing``
    int64 ``[R, K]`` (one layer's rows)."""
    pred = scores.topk(k, 1).indices
    return topk_recall(pred[:, None], routing[:, None], scores.shape[1])


def online_table(tokens: torch.Tensor, routing: torch.Tensor, num_experts: int):
    """Each row's token's routing counts over its earlier rows in stream order (a cold
    table updated after every row): float32 ``[R, E]``, and bool ``[R]`` where the token was
    seen before."""
    hot = torch.zeros(len(tokens), num_experts).scatter_(1, routing, 1.0)
    order = torch.sort(tokens, stable=True).indices
    sorted_hot = hot[order]
    running = sorted_hot.cumsum(0) - sorted_hot
    group = tokens[order]
    starts = torch.ones(len(group), dtype=torch.bool)
    starts[1:] = group[1:] != group[:-1]
    first = torch.cummax(torch.where(starts, torch.arange(len(group)), 0), 0).values
    running -= running[first]
    counts = torch.empty_like(running)
    counts[order] = running
    return counts, counts.sum(1) > 0


def time_prediction(num_layers: int, num_experts: int, hidden: int, vocab: int, k: int) -> float:
    """Median ms to predict 16 requests x 36 candidates: gather the fitted token logits
    (float16 ``[V, L, E]``), add each request's anchor logits (float32 ``[H] @ [L, H, E]``),
    top-k over E."""
    token_table = torch.randn(vocab, num_layers, num_experts).half()
    anchor_proj = torch.randn(num_layers, hidden, num_experts)
    anchors = torch.randn(16, hidden)
    candidates = torch.randint(0, vocab, (16, 36))

    def predict():
        per_request = torch.einsum("bh,lhe->ble", anchors, anchor_proj)
        logits = token_table[candidates].float() + per_request[:, None]
        return logits.topk(k, -1).indices

    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        predict()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="target checkpoint (default: the full testbed's)")
    parser.add_argument("--train-tokens", type=int, default=60000)
    parser.add_argument("--eval-prompts", type=int, default=16, help="per dataset")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--ridge", type=float, default=1.0)
    parser.add_argument("--table-weight", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if min(args.train_tokens, args.eval_prompts, args.new_tokens) < 1 or args.ridge <= 0:
        parser.error("--train-tokens, --eval-prompts, --new-tokens and --ridge must be > 0")
    if args.table_weight < 0:
        parser.error(f"--table-weight must be >= 0, got {args.table_weight}")
    torch.set_num_threads(args.threads)
    target = args.target or testbed_models(small=False)[0]
    capture = Capture(target)
    embed = capture.model.get_input_embeddings().weight.detach()
    routers = [gate.weight.detach().float() for gate in capture.gates]  # [E, H] each
    k = capture.top_k

    log(f"capturing ShareGPT from conversation {TRAIN_START} until {args.train_tokens} tokens")
    train_ids, total = [], 0
    for conversation in sharegpt_conversations(TRAIN_START + 4 * args.train_tokens // 256)[
        TRAIN_START:
    ]:
        if total >= args.train_tokens:
            break
        ids = render(capture.tokenizer, conversation)[:512]
        if len(ids) >= 16:
            train_ids.append(ids)
            total += len(ids)
    train = collect(capture, train_ids, [0] * len(train_ids))
    log(f"generating {args.new_tokens} tokens for {2 * args.eval_prompts} held-out prompts")
    eval_ids, starts = [], []
    for dataset in ("mt-bench", "humaneval"):
        for prompt in load_prompts(dataset, num_prompts=args.eval_prompts, seed=0):
            ids = render_chat(capture.tokenizer, prompt.text)
            eval_ids.append(capture.continuation(ids, args.new_tokens))
            starts.append(len(ids))
    held = collect(capture, eval_ids, starts)
    num_layers, num_experts = len(routers), routers[0].shape[0]
    recall: dict[str, list[float]] = {}
    for layer in range(num_layers):
        true = held["routing"][held["rows"], layer]
        counts, seen = online_table(held["tokens"][held["rows"]], true, num_experts)
        table = counts / counts.sum(1, keepdim=True).clamp_min(1)
        logits_train = train["x"][train["rows"], layer].float() @ routers[layer].T
        for kind in FEATURES:
            f_train = features(train, embed, layer, kind)
            gram = f_train.T @ f_train + args.ridge * torch.eye(f_train.shape[1])
            weights = torch.linalg.solve(gram, f_train.T @ logits_train)
            fitted = (features(held, embed, layer, kind) @ weights).softmax(1)
            mixed = fitted + args.table_weight * table
            recall.setdefault(kind, []).append(recall_of(fitted, true, k))
            recall.setdefault(f"{kind}+table", []).append(recall_of(mixed, true, k))
            if kind == "token":
                alone = torch.where(seen[:, None], table, fitted * 1e-3)
                recall.setdefault("table", []).append(recall_of(alone, true, k))
        log(f"  layer {layer}: " + ", ".join(f"{n} {v[-1]:.3f}" for n, v in recall.items()))

    hidden, vocab = embed.shape[1], embed.shape[0]
    result = {
        "target": target,
        "train_tokens": int(len(train["rows"])),
        "eval_rows": int(len(held["rows"])),
        "ridge": args.ridge,
        "table_weight": args.table_weight,
        "recall": {n: sum(v) / len(v) for n, v in recall.items()},
        "recall_per_layer": recall,
        "token_table_mib": vocab * num_layers * num_experts * 2 / 2**20,
        "anchor_projection_mib": num_layers * hidden * num_experts * 4 / 2**20,
        "predict_ms_16x36": time_prediction(num_layers, num_experts, hidden, vocab, k),
        "machine": platform.node(),
        "threads": args.threads,
    }
    groups = {"0": slice(0, 1), "1-9": slice(1, 10), "10-19": slice(10, 20), "20+": slice(20, None)}
    groups = {name: s for name, s in groups.items() if range(num_layers)[s]}
    print(f"| predictor | recall | {' | '.join('layers ' + g for g in groups)} |")
    print("|---|---|" + "---|" * len(groups))
    for name, values in recall.items():
        parts = " | ".join(f"{sum(values[s]) / len(values[s]):.3f}" for s in groups.values())
        print(f"| {name} | {result['recall'][name]:.3f} | {parts} |")
    print(
        f"train rows {result['train_tokens']}, held-out rows {result['eval_rows']}; token table "
        f"{result['token_table_mib']:.0f} MiB, anchor projection "
        f"{result['anchor_projection_mib']:.1f} MiB; prediction 16 x 36: "
        f"{result['predict_ms_16x36']:.2f} ms"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
