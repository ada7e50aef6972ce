"""Selection timings of the device check (scripts/gpu_bench.py): ``select_verify_set`` on
draft trees shaped as SGLang's EAGLE trees, per request and with the batch-shared buffer,
with and without expert parallelism, every result compared with the reference.

Shapes: topk 4, 3 draft steps -> N = 4 + 2 x 16 = 36 candidates per request; ndt 8 -> budget
7; 8 experts per token; Qwen3-235B (L = 94, E = 128) and DeepSeek-V3 (L = 58, E = 256);
EP over 8 ranks with SGLang's rank-major placement (rank r holds experts [r E/8, (r+1) E/8)).
Each row gives microseconds per call, medians of CUDA-event timings after warm-up: of an
eager call (the Python API, the launcher and the kernel, as the GPU sees them) and of the
replay of a CUDA graph holding the call (the device time, as inside SGLang's draft graph).
"""

import time

import torch

from sgl_ecospec import select_verify_set
from sgl_ecospec.ops.selection_reference import select_verify_set_reference
from sgl_ecospec.synthetic import DraftTree, random_draft_tree

SHAPES = {"qwen3-235b-a22b": (94, 128), "deepseek-v3": (58, 256)}
TINY_SHAPES = {"tiny": (4, 70)}
EXPERTS_PER_TOKEN = 8
EP_RANKS = 8
# Issue 14: the batch-shared selection at B = 64, ndt 8 must take at most this long, or it
# eats what it saves in the verify pass.
TARGET_US = 30.0
TARGET_BATCH = 64
# (policy, share_buffer, with EP); "adaptive" is priced with step_cost = 20 L.
CONFIGS = [
    ("confidence", False, False),
    ("ecospec", False, False),
    ("ecospec", True, False),
    ("ecospec", True, True),
    ("adaptive", True, True),
]


def sglang_tree(
    batch: int, topk: int, steps: int, layers: int, experts: int, top_k: int, seed: int
) -> DraftTree:
    """A random tree shaped as SGLang's EAGLE draft tree (``select_top_k_tokens``): step 0
    proposes ``topk`` children of the root; step 1 ``topk`` children of each; every later
    step ``topk`` children of each of the previous step's ``topk`` best candidates (highest
    cumulative score, best first). N = topk + (steps - 1) topk^2. Scores are cumulative
    (never rising from parent to child); expert bitmaps as ``random_draft_tree`` draws them
    (skewed popularity)."""
    num_nodes = topk + (steps - 1) * topk * topk
    base = random_draft_tree(batch, num_nodes, layers, experts, top_k, seed=seed)
    gen = torch.Generator().manual_seed(seed)

    def child_probs(*shape):
        return torch.rand(*shape, generator=gen).sort(-1, descending=True).values

    scores = torch.empty(batch, num_nodes)
    parents = torch.full((batch, num_nodes), -1, dtype=torch.long)
    scores[:, :topk] = child_probs(batch, topk)
    beams = torch.arange(topk).expand(batch, topk)  # step 1 expands every step-0 candidate
    previous, start = (0, topk), topk
    for step in range(1, steps):
        if step > 1:
            first, count = previous
            beams = scores[:, first : first + count].topk(topk, dim=1).indices + first
        block = scores.gather(1, beams)[:, :, None] * child_probs(batch, topk, topk)
        scores[:, start : start + topk * topk] = block.flatten(1)
        parents[:, start : start + topk * topk] = beams.repeat_interleave(topk, 1)
        previous, start = (start, topk * topk), start + topk * topk
    return DraftTree(scores, parents, base.node_experts, base.root_experts)


def rank_major_placement(layers: int, experts: int, ranks: int) -> torch.Tensor:
    """int64 ``[L, E]``: expert e on rank e * R // E (SGLang's default layout)."""
    return (torch.arange(experts) * ranks // experts).expand(layers, experts).contiguous()


def selection_kwargs(policy, shared, ep, layers, experts, ranks=EP_RANKS) -> dict:
    kwargs = dict(policy=policy, share_buffer=shared)
    if ep:
        kwargs.update(expert_rank=rank_major_placement(layers, experts, ranks), num_ranks=ranks)
    if policy == "adaptive":
        kwargs["step_cost"] = 20.0 * layers
    return kwargs


def event_median_us(fn, repeats: int, warmup: int = 5) -> float:
    """Median microseconds of ``fn()`` between two CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def cpu_median_us(fn, repeats: int) -> float:
    """Median microseconds of ``fn()`` by the host clock, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return sorted(times)[len(times) // 2]


def graph_of(fn):
    """``fn`` captured once in a CUDA graph (after warm-up on a side stream); returns the
    graph, whose replay reruns ``fn`` on the same buffers."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def bench_selection(device: torch.device, batches, repeats: int, tiny: bool) -> list[dict]:
    """One row per (shapes, config, batch): times and whether the op equals the reference."""
    topk, steps, budget = (2, 2, 3) if tiny else (4, 3, 7)
    ranks = 2 if tiny else EP_RANKS
    rows = []
    for model, (layers, experts) in (TINY_SHAPES if tiny else SHAPES).items():
        for batch in batches:
            tree = sglang_tree(batch, topk, steps, layers, experts, EXPERTS_PER_TOKEN, seed=batch)
            cpu_args = (tree.scores, tree.parents, tree.node_experts, budget)
            dev_args = [t.to(device) for t in cpu_args[:3]] + [budget]
            roots = tree.root_experts.to(device)
            for policy, shared, ep in CONFIGS:
                kwargs = selection_kwargs(policy, shared, ep, layers, experts, ranks)
                on_device = {
                    k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
                }

                def run(on_device=on_device, dev_args=dev_args, roots=roots):
                    return select_verify_set(
                        *dev_args, root_experts=roots, validate=False, **on_device
                    )

                expected = select_verify_set_reference(
                    *cpu_args, root_experts=tree.root_experts, **kwargs
                )
                matches = bool(torch.equal(run().cpu(), expected))
                if device.type == "cuda":
                    eager = event_median_us(run, repeats)
                    graph = graph_of(run)
                    replay = event_median_us(graph.replay, repeats)
                else:
                    eager, replay = cpu_median_us(run, repeats), None
                row = dict(
                    model=model,
                    layers=layers,
                    num_experts=experts,
                    candidates=tree.scores.shape[1],
                    budget=budget,
                    batch=batch,
                    policy=policy,
                    share_buffer=shared,
                    ep_ranks=ranks if ep else None,
                    eager_us=eager,
                    graph_us=replay,
                    matches_reference=matches,
                )
                rows.append(row)
                graph_text = "-" if replay is None else f"{replay:9.1f}"
                print(
                    f"select {model:16} {policy:10} shared={shared!s:5} ep={ep!s:5} "
                    f"B={batch:3} eager {eager:9.1f} us graph {graph_text} us "
                    f"matches={matches}",
                    flush=True,
                )
    return rows


def target_verdict(rows: list[dict]) -> str:
    """The issue-14 target on the shared-buffer rows at B = 64 (graph replay times)."""
    shared = [
        r
        for r in rows
        if r["share_buffer"] and r["batch"] == TARGET_BATCH and r["graph_us"] is not None
    ]
    if not shared:
        return f"not measured (needs a GPU and B = {TARGET_BATCH})"
    worst = max(shared, key=lambda r: r["graph_us"])
    met = all(r["graph_us"] <= TARGET_US for r in shared)
    return (
        f"{'met' if met else 'NOT met'}: slowest shared-buffer row at B = {TARGET_BATCH} is "
        f"{worst['model']} {worst['policy']}{' EP' if worst['ep_ranks'] else ''}, "
        f"{worst['graph_us']:.1f} us per call"
    )


def markdown(rows: list[dict]) -> list[str]:
    """The selection section of the device check's table."""
    first = rows[0] if rows else dict(candidates="?", budget="?")
    lines = [
        f"## Selection (SGLang-shaped trees: N = {first['candidates']} candidates, budget "
        f"{first['budget']}, {EXPERTS_PER_TOKEN} experts per token; EP: rank-major placement)",
        "",
        f"Target (issue 14): the batch-shared selection at B = {TARGET_BATCH}, ndt 8, in at most "
        f"{TARGET_US:.0f} us per call (graph replay): {target_verdict(rows)}.",
        "",
        "| shapes | policy | shared | EP ranks | B | eager (us) | graph replay (us) | "
        "equals reference |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        graph = "-" if r["graph_us"] is None else f"{r['graph_us']:.1f}"
        lines.append(
            f"| {r['model']} | {r['policy']} | {r['share_buffer']} | {r['ep_ranks'] or '-'} | "
            f"{r['batch']} | {r['eager_us']:.1f} | {graph} | {r['matches_reference']} |"
        )
    return lines
