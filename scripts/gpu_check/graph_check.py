"""The CUDA-graph checks of the device check's correctness stage (correctness.py): captures
the selection op, the online predictor's prediction, the whole selection step and the
verify-MoE kernel (bf16, its bitmap into a persistent buffer) once each, then changes their
persistent inputs in place (new scores, parents, bitmaps, placement, tokens, predictor
tables, hidden states and routing with padded rows), replays, and compares every replay with
an eager call on the new state, and the selection and the MoE with their references (the
MoE within a bf16 tolerance). On the CPU (a dry run) "replay" calls the function again: that
checks this module's logic, not graph capture.
"""

import torch
from common import graph_of
from selection_cases import rank_major_placement, selection_kwargs, sglang_tree

from sgl_ecospec import select_verify_set
from sgl_ecospec.ops.selection import SelectionOptions
from sgl_ecospec.ops.selection_reference import select_verify_set_reference
from sgl_ecospec.ops.verify_moe import verify_moe, verify_moe_reference
from sgl_ecospec.predictors.online import OnlineExpertPredictor
from sgl_ecospec.step import Placement, select_step


class Captured:
    """``fn()`` (returning a tensor or a tuple of tensors) captured once in a CUDA graph;
    ``replay()`` reruns the graph and returns copies of its outputs. On the CPU ``replay``
    calls ``fn`` again: that checks this script's logic, not graph capture."""

    def __init__(self, fn, device: torch.device):
        self.fn, self.graph = fn, None
        if device.type == "cuda":
            self.graph, self.outputs = graph_of(fn)

    def replay(self):
        if self.graph is None:
            return _clone(self.fn())
        self.graph.replay()
        return _clone(self.outputs)


def _clone(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs.clone()
    return tuple(o.clone() for o in outputs)


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a.cpu(), b.cpu())
    return all(_equal(x, y) for x, y in zip(a, b, strict=True))


def _fill(buffers: dict, values: dict) -> None:
    """Writes ``values`` into the persistent ``buffers`` in place (same shapes)."""
    for name, value in values.items():
        buffers[name].copy_(value)


def _tree_values(batch, topk, steps, layers, experts, seed) -> dict:
    tree = sglang_tree(batch, topk, steps, layers, experts, 8, seed=seed)
    return dict(
        scores=tree.scores,
        parents=tree.parents,
        node_experts=tree.node_experts,
        root_experts=tree.root_experts,
    )


def _placement(layers, experts, ranks, seed) -> torch.Tensor:
    """A rank-major placement with experts shuffled within each layer (as EPLB moves them)."""
    gen = torch.Generator().manual_seed(seed)
    base = rank_major_placement(layers, experts, ranks)
    order = torch.stack([torch.randperm(experts, generator=gen) for _ in range(layers)])
    return base.gather(1, order)


def check_selection(device, shape, trials: int) -> list[dict]:
    """The selection op of every configuration, captured once, replayed on new trees."""
    batch, topk, steps, layers, experts, budget, ranks = shape
    results = []
    for policy, shared, ep in [
        ("ecospec", False, False),
        ("ecospec", True, False),
        ("ecospec", True, True),
        ("adaptive", True, True),
        ("confidence", True, False),
    ]:
        kwargs = selection_kwargs(policy, shared, ep, layers, experts, ranks)
        values = _tree_values(batch, topk, steps, layers, experts, seed=0)
        if ep:
            values["expert_rank"] = kwargs.pop("expert_rank")
        buffers = {k: v.to(device) for k, v in values.items()}

        def select(buffers=buffers, kwargs=kwargs):
            return select_verify_set(
                buffers["scores"],
                buffers["parents"],
                buffers["node_experts"],
                budget,
                root_experts=buffers["root_experts"],
                expert_rank=buffers.get("expert_rank"),
                validate=False,
                **kwargs,
            )

        captured = Captured(select, device)
        first, ok, changed = captured.replay(), True, False
        for trial in range(1, trials + 1):
            new = _tree_values(batch, topk, steps, layers, experts, seed=trial)
            if ep:
                new["expert_rank"] = _placement(layers, experts, ranks, seed=trial)
            _fill(buffers, new)
            replayed, eager = captured.replay(), select()
            cpu = {k: v for k, v in new.items() if k not in ("scores", "parents", "node_experts")}
            expected = select_verify_set_reference(
                new["scores"], new["parents"], new["node_experts"], budget, **cpu, **kwargs
            )
            ok &= _equal(replayed, eager) and _equal(replayed, expected)
            changed |= not _equal(replayed, first)
        name = f"select {policy} shared={shared} ep={ep}"
        results.append(dict(check=name, ok=ok, inputs_changed_output=changed))
    return results


def check_predictor(device, shape, trials: int) -> list[dict]:
    """The online predictor's prediction and the whole selection step, captured once each,
    replayed after the tables learn new routing and the tokens change in place."""
    batch, topk, steps, layers, experts, budget, ranks = shape
    gen = torch.Generator().manual_seed(7)
    predictor = OnlineExpertPredictor(
        layers, experts, 8, num_buckets=512, halve_every=2, device=device
    )

    def learn():
        tokens = torch.randint(0, 5000, (256,), generator=gen)
        routing = torch.randint(0, experts, (256, layers, 8), generator=gen)
        predictor.observe(tokens.to(device), routing.to(device), validate=False)

    learn()
    nodes = topk + (steps - 1) * topk * topk
    tokens = torch.randint(0, 5000, (batch, 1 + nodes), generator=gen).to(device)
    values = _tree_values(batch, topk, steps, layers, experts, seed=0)
    tree = {k: v.to(device) for k, v in values.items()}
    placement = Placement(_placement(layers, experts, ranks, seed=0).to(device), ranks)
    options = SelectionOptions(policy="ecospec", share_buffer=True)

    def predict():
        flat = tokens.flatten()
        return predictor.predict_topk(flat), predictor.predict_bitmaps(flat)

    def step():
        s = select_step(
            predictor, tokens, tree["scores"], tree["parents"], budget, options, placement=placement
        )
        return s.selected, s.verify_predicted

    results = []
    for name, fn in [("predict_topk + predict_bitmaps", predict), ("select_step", step)]:
        captured = Captured(fn, device)
        first, ok, changed = captured.replay(), True, False
        for trial in range(1, trials + 1):
            learn()  # new counts in the tables, in place (and aging every second call)
            tokens.copy_(torch.randint(0, 5000, tokens.shape, generator=gen))
            new = _tree_values(batch, topk, steps, layers, experts, seed=100 + trial)
            _fill(tree, {k: new[k] for k in ("scores", "parents")})
            placement.expert_rank.copy_(_placement(layers, experts, ranks, seed=trial))
            replayed = captured.replay()
            ok &= _equal(replayed, fn())
            changed |= not _equal(replayed, first)
        results.append(dict(check=name, ok=ok, inputs_changed_output=changed))
    return results


def verify_moe_tolerance(dtype: torch.dtype) -> float:
    """Largest accepted max |kernel - reference| / max |reference| of ``verify_moe``: the
    kernel and the reference both accumulate in float32, so a 16-bit output differs by the
    final rounding, at most one ulp (2^-7 of a bf16 value); 2e-2 leaves about 2.5 ulps."""
    return 1e-4 if dtype == torch.float32 else 2e-2


def _moe_routing(tokens, experts, top_k, padded, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 ``[T, K]``, weights float32 ``[T, K]``): distinct experts per token, the
    last ``padded`` rows -1 as SGLang pads a graph batch (their weights are unused)."""
    device = gen.device
    scores = torch.rand(tokens, experts, generator=gen, device=device)
    weights, ids = scores.topk(top_k, dim=1)
    ids[tokens - padded :] = -1
    return ids.int(), weights / weights.sum(1, keepdim=True)


def check_verify_moe(device, tiny: bool, trials: int) -> list[dict]:
    """``verify_moe`` captured once on persistent hidden states, routing and bitmap buffer
    (bf16 on a GPU; float32 on the CPU, where the reference or Triton's interpreter runs),
    replayed after new tokens and routing (padded rows included) are written in place."""
    if tiny:
        tokens, hidden, inter, experts, top_k, dtype = 6, 64, 32, 70, 4, torch.float32
    else:  # a Qwen3-30B-A3B MoE layer, one verify of B = 4 requests x 8 tokens
        tokens, hidden, inter, experts, top_k, dtype = 32, 2048, 768, 128, 8, torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    w13 = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, scale=inter**-0.5)
    x = randn(tokens, hidden)
    ids, weights = _moe_routing(tokens, experts, top_k, 0, gen)
    bitmap = torch.zeros((experts + 63) // 64, dtype=torch.int64, device=device)
    impl = "triton" if device.type == "cuda" else "auto"

    def moe():
        return verify_moe(x, w13, w2, ids, weights, bitmap_out=bitmap, impl=impl)

    captured = Captured(moe, device)
    first, ok, changed, error = captured.replay(), True, False, 0.0
    for trial in range(1, trials + 1):
        padded = trial % 3  # 1, 2, 0 padded rows
        new_ids, new_weights = _moe_routing(tokens, experts, top_k, padded, gen)
        _fill(
            dict(x=x, ids=ids, weights=weights),
            dict(x=randn(tokens, hidden), ids=new_ids, weights=new_weights),
        )
        replayed = captured.replay()  # (output [T, H], the bitmap buffer after the replay)
        eager = moe()
        ref, ref_bitmap = verify_moe_reference(x, w13, w2, ids, weights)
        trial_error = float(
            (replayed[0].float() - ref.float()).abs().max() / ref.float().abs().max()
        )
        error = max(error, trial_error)
        ok &= _equal(replayed, eager) and _equal(replayed[1], ref_bitmap)
        ok &= bool((replayed[0][tokens - padded :] == 0).all())
        changed |= not _equal(replayed, first)
    tolerance = verify_moe_tolerance(dtype)
    name = f"verify_moe {str(dtype).removeprefix('torch.')} T={tokens} E={experts} K={top_k}"
    return [
        dict(
            check=name,
            ok=ok and error <= tolerance,
            inputs_changed_output=changed,
            rel_error=error,
            tolerance=tolerance,
        )
    ]


def run_checks(device: torch.device, tiny: bool, trials: int = 3) -> list[dict]:
    # (B, topk, steps, L, E, budget, EP ranks)
    shape = (3, 2, 2, 4, 70, 3, 2) if tiny else (16, 4, 3, 94, 128, 7, 8)
    results = check_selection(device, shape, trials) + check_predictor(device, shape, trials)
    results += check_verify_moe(device, tiny, trials)
    for r in results:
        status = "ok" if r["ok"] and r["inputs_changed_output"] else "MISMATCH"
        print(f"graph {r['check']:40} {status}", flush=True)
    return results


def failures(results: list[dict]) -> list[dict]:
    """Failed checks: a replay that differs from the eager call or the reference, or one
    that never changed with its inputs (a graph reading stale buffers)."""
    return [r for r in results if not (r["ok"] and r["inputs_changed_output"])]
