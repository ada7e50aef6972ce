"""The selection cases of the device check (scripts/gpu_check.sh): draft trees shaped as
SGLang's EAGLE trees, per request and with the batch-shared buffer, with and without expert
parallelism, and the op under test: the CUDA kernel on a GPU, or its own source under the CPU
emulation (test/ops/cuda_emulator.h) in a dry run.

Shapes: topk 4, 3 draft steps -> N = 4 + 2 x 16 = 36 candidates per request; ndt 8 -> budget
7; 8 experts per token; Qwen3-235B (L = 94, E = 128) and DeepSeek-V3 (L = 58, E = 256);
EP over 8 ranks with SGLang's rank-major placement (rank r holds experts [r E/8, (r+1) E/8)).
"""

import tempfile
from pathlib import Path

import common
import torch

from sgl_ecospec import select_verify_set
from sgl_ecospec.synthetic import DraftTree, random_draft_tree

SHAPES = {"qwen3-235b-a22b": (94, 128), "deepseek-v3": (58, 256)}
TINY_SHAPES = {"tiny": (4, 70)}
EXPERTS_PER_TOKEN = 8
EP_RANKS = 8
# The batch-shared selection at B = 64, ndt 8 must take at most this long (graph replay), or
# it eats what it saves in the verify pass. round_sync is the mode built for it; turn by turn
# (B x budget dependent turns) is timed beside it.
TARGET_US = 30.0
TARGET_BATCH = 64
# The expert buffers: one per request (False), one for the batch turn by turn (True), or one
# for the batch with round_sync ("rounds").
BUFFERS = (False, True, "rounds")
# (policy, buffer, with EP); "adaptive" is priced with step_cost = 20 L.
CONFIGS = [
    ("confidence", False, False),
    ("ecospec", False, False),
    ("ecospec", True, False),
    ("ecospec", True, True),
    ("adaptive", True, True),
    ("ecospec", "rounds", False),
    ("ecospec", "rounds", True),
    ("adaptive", "rounds", True),
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


def buffer_kwargs(shared: bool | str) -> dict:
    """The op's keywords for one of :data:`BUFFERS`."""
    return dict(share_buffer=bool(shared), round_sync=shared == "rounds")


def selection_kwargs(policy, shared, ep, layers, experts, ranks=EP_RANKS) -> dict:
    kwargs = dict(policy=policy, **buffer_kwargs(shared))
    if ep:
        kwargs.update(expert_rank=rank_major_placement(layers, experts, ranks), num_ranks=ranks)
    if policy == "adaptive":
        kwargs["step_cost"] = 20.0 * layers
    return kwargs


def on_device(kwargs: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}


class KernelUnderTest:
    """``select_verify_set``'s CUDA kernel: on the GPU through the op, or in a dry run its
    own source compiled against the CPU emulation (built once). Called like the op on CPU
    tensors (``impl="native"`` on the CPU is the C++ op, the comparison's other side)."""

    def __init__(self, device: torch.device):
        self.device, self.emulation = device, None
        if device.type == "cpu":
            common.use_test_helpers()
            from _emulated import build, select_emulated

            # Removed with this object (the library stays loaded from memory).
            self._folder = tempfile.TemporaryDirectory(prefix="gpu_check_emu_")
            self.emulation = build(Path(self._folder.name))
            if self.emulation is None:
                raise SystemExit("the dry run needs a C++ compiler for the CUDA emulation")
            self._select_emulated = select_emulated

    def __call__(self, scores, parents, node_experts, budget, **kwargs) -> torch.Tensor:
        """int64 ``[B, budget]`` on the CPU."""
        if self.emulation is not None:
            kwargs.pop("validate", None)
            return self._select_emulated(
                self.emulation, scores, parents, node_experts, budget, **kwargs
            )[0]
        tensors = (t.to(self.device) for t in (scores, parents, node_experts))
        return select_verify_set(
            *tensors, budget, impl="native", **on_device(kwargs, self.device)
        ).cpu()


def cpu_op(scores, parents, node_experts, budget, **kwargs) -> torch.Tensor:
    """The C++ CPU op: the fast side of every comparison (equal to the reference, tested in
    every CI run)."""
    return select_verify_set(scores, parents, node_experts, budget, impl="native", **kwargs)


def target_verdict(rows: list[dict]) -> str:
    """The target on the round_sync rows at B = 64 (graph replay times), and the slowest
    turn-by-turn row beside it."""
    timed = [r for r in rows if r["batch"] == TARGET_BATCH and r["graph_us"] is not None]
    rounds = [r for r in timed if r["buffer"] == "rounds"]
    if not rounds:
        return f"not measured (needs a GPU and B = {TARGET_BATCH})"

    def slowest(group):
        worst = max(group, key=lambda r: r["graph_us"])
        ep = " EP" if worst["ep_ranks"] else ""
        return f"{worst['model']} {worst['policy']}{ep}, {worst['graph_us']:.1f} us per call"

    met = all(r["graph_us"] <= TARGET_US for r in rounds)
    verdict = f"{'met' if met else 'NOT met'}: slowest round_sync row at B = {TARGET_BATCH} is "
    verdict += slowest(rounds)
    turns = [r for r in timed if r["buffer"] is True]
    return verdict + (f"; turn by turn: {slowest(turns)}" if turns else "")


BUFFER_NAMES = {False: "per request", True: "shared, turns", "rounds": "shared, rounds"}


def markdown(rows: list[dict]) -> list[str]:
    """The selection section of the device check's table."""
    first = rows[0] if rows else dict(candidates="?", budget="?")
    lines = [
        f"## Selection (SGLang-shaped trees: N = {first['candidates']} candidates, budget "
        f"{first['budget']}, {EXPERTS_PER_TOKEN} experts per token; EP: rank-major placement)",
        "",
        f"Target: the batch-shared selection (round_sync) at B = {TARGET_BATCH}, ndt 8, in at "
        f"most {TARGET_US:.0f} us per call (graph replay): {target_verdict(rows)}.",
        "",
        "| shapes | policy | buffer | EP ranks | B | eager (us) | graph replay (us) | "
        "equals the C++ op |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        graph = "-" if r["graph_us"] is None else f"{r['graph_us']:.1f}"
        lines.append(
            f"| {r['model']} | {r['policy']} | {BUFFER_NAMES[r['buffer']]} | "
            f"{r['ep_ranks'] or '-'} | {r['batch']} | {r['eager_us']:.1f} | {graph} | "
            f"{r['matches_cpu_op']} |"
        )
    return lines
