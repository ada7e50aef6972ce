import math

import pytest
import torch
from _util import IMPLS, requires_native
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_ecospec import has_native, select_verify_set, topk_to_bitmap
from sgl_ecospec.ops.bitmaps import bitmap_to_ids
from sgl_ecospec.ops.selection import DEFAULT_EPS, select_verify_set_reference
from sgl_ecospec.placement import expert_rank_map
from sgl_ecospec.synthetic import random_draft_tree


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def experts(*layers, num_experts=8):
    """Bitmaps int64 [L, W] from one list of expert ids per layer."""
    width = max(len(ids) for ids in layers)
    padded = [ids + ids[:1] * (width - len(ids)) for ids in layers]  # repeats set no new bit
    return topk_to_bitmap(torch.tensor(padded), num_experts)


def random_tree(gen, batch, num_nodes, layers, num_experts, top_k, *, tie_levels=0):
    seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
    tree = random_draft_tree(
        batch, num_nodes, layers, num_experts, top_k, seed=seed, tie_levels=tie_levels
    )
    return tree.scores, tree.parents, tree.node_experts, tree.root_experts


def python_greedy(
    scores,
    parents,
    node_experts,
    budget,
    root_experts,
    policy,
    eps,
    share_buffer,
    weights,
    num_experts,
    expert_rank=None,
    num_ranks=1,
    total_weight=0.0,
    step_tokens=1.0,
    step_cost=1.0,
):
    """The selection rule written with Python sets: an independent check of the reference."""
    batch, num_nodes = scores.shape
    layers = node_experts.shape[2]
    sets = [
        [
            [set(bitmap_to_ids(node_experts[b, i, layer], num_experts)) for layer in range(layers)]
            for i in range(num_nodes)
        ]
        for b in range(batch)
    ]
    roots = [
        [
            set(bitmap_to_ids(root_experts[b, layer], num_experts))
            if root_experts is not None
            else set()
            for layer in range(layers)
        ]
        for b in range(batch)
    ]
    buffers = roots
    if share_buffer:
        union = [set().union(*(roots[b][layer] for b in range(batch))) for layer in range(layers)]
        buffers = [union] * batch
    rank = None
    if expert_rank is not None:
        rank = [
            [int(r) for r in (expert_rank if expert_rank.dim() == 1 else expert_rank[layer])]
            for layer in range(layers)
        ]
    # The adaptive account: [tokens, cost] per request, or one shared by the batch.
    requests = batch if share_buffer else 1
    shared_account = [step_tokens * requests, step_cost * requests]
    accounts = [shared_account if share_buffer else [step_tokens, step_cost] for _ in range(batch)]
    chosen = [[] for _ in range(batch)]

    def layer_cost(fresh, buffer, layer):
        if rank is None:
            return len(fresh)
        loads = [sum(rank[layer][e] == r for e in buffer) for r in range(num_ranks)]
        adds = [sum(rank[layer][e] == r for e in fresh) for r in range(num_ranks)]
        rise = max(a + b for a, b in zip(loads, adds, strict=True)) - max(loads)
        return rise + total_weight * (len(fresh) - rise)

    def pick(b):
        best, best_priority, best_cost = -1, None, 0.0
        for i in range(num_nodes):
            p = int(parents[b, i])
            if i in chosen[b] or (p >= 0 and p not in chosen[b]):
                continue
            priority, cost = float(scores[b, i]), 0.0
            if policy != "confidence":
                for layer in range(layers):
                    fresh = sets[b][i][layer] - buffers[b][layer]
                    c = layer_cost(fresh, buffers[b][layer], layer)
                    cost += c if weights is None else float(weights[layer]) * c
                priority = priority / (cost + eps)
            if best < 0 or priority > best_priority:
                best, best_priority, best_cost = i, priority, cost
        if best < 0:
            return
        if policy == "adaptive":
            account = accounts[b]
            if best_priority < account[0] / account[1]:
                return
            account[0] += float(scores[b, best])
            account[1] += best_cost + eps
        chosen[b].append(best)
        for layer in range(layers):
            buffers[b][layer] |= sets[b][best][layer]

    for _ in range(budget):
        for b in range(batch):
            pick(b)
    return [sorted(c) + [-1] * (budget - len(c)) for c in chosen]


# --- the worked example of METHOD.md (EcoSpec Fig. 3, gamma = 2) -------------------------


def worked_example():
    """t0 (the first verified token) covers E1..E4; t1 (P = 0.53) needs three new experts,
    t2 (P = 0.42) two: S(t1) = 0.53 / 3.1 = 0.17 < S(t2) = 0.42 / 2.1 = 0.20."""
    scores = torch.tensor([[1.0, 0.53, 0.42]])
    parents = torch.tensor([[-1, 0, 0]])
    node_experts = torch.stack(
        [experts([1, 2, 3, 4]), experts([1, 5, 6, 7]), experts([1, 2, 5, 6])]
    )[None]
    return scores, parents, node_experts


@pytest.mark.parametrize("policy, expected", [("ecospec", [[0, 2]]), ("confidence", [[0, 1]])])
def test_worked_example(impl, policy, expected):
    scores, parents, node_experts = worked_example()
    out = select_verify_set(scores, parents, node_experts, 2, policy=policy, eps=0.1, impl=impl)
    assert out.tolist() == expected


@pytest.mark.parametrize("policy, expected", [("ecospec", [[1]]), ("confidence", [[0]])])
def test_worked_example_with_t0_as_root(impl, policy, expected):
    scores, parents, node_experts = worked_example()
    out = select_verify_set(
        scores[:, 1:],
        torch.tensor([[-1, -1]]),
        node_experts[:, 1:],
        1,
        root_experts=node_experts[:, 0],
        policy=policy,
        eps=0.1,
        impl=impl,
    )
    assert out.tolist() == expected


# --- confidence is SGLang's organize_draft_results --------------------------------------


def sglang_draft_tree(batch, topk, steps, seed):
    """Grows a draft tree with SGLang's own select_top_k_tokens and returns its lists plus
    the same tree as (scores [B, N], parents [B, N])."""
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    gen = torch.Generator().manual_seed(seed)
    score_list, token_list, parents_list = [], [], []
    beam_scores = None
    with torch.compiler.set_stance("force_eager"):
        for i in range(steps):
            rows = batch if i == 0 else batch * topk
            probs = torch.rand(rows, topk, generator=gen).sort(-1, descending=True).values
            tokens = torch.randint(0, 1000, (rows, topk), generator=gen)
            _, _, beam_scores, (s, t, p) = select_top_k_tokens(
                i, probs, tokens, None, beam_scores, topk
            )
            score_list.append(s), token_list.append(t), parents_list.append(p)
    scores = torch.cat(score_list, 1).flatten(1)
    parents = torch.full_like(scores, -1, dtype=torch.long)
    for i in range(1, steps):
        beams = parents_list[i - 1][:, 1:] if i == 1 else parents_list[i - 1]
        start = topk + (i - 1) * topk * topk
        parents[:, start : start + topk * topk] = beams.repeat_interleave(topk, 1)
    return (score_list, token_list, parents_list), scores, parents


@pytest.mark.parametrize(
    "batch, topk, steps, num_draft", [(1, 4, 3, 8), (3, 2, 4, 6), (2, 8, 3, 16), (4, 4, 5, 32)]
)
def test_confidence_is_sglang_organize_draft_results(impl, batch, topk, steps, num_draft):
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    lists, scores, parents = sglang_draft_tree(batch, topk, steps, seed=batch * 100 + topk)
    _, expected, _ = organize_draft_results(*lists, num_draft)
    node_experts = torch.zeros((*scores.shape, 1, 1), dtype=torch.long)
    out = select_verify_set(
        scores, parents, node_experts, num_draft - 1, policy="confidence", impl=impl
    )
    assert torch.equal(out, expected)


# --- properties ---------------------------------------------------------------------------

TREE_CASE_FIELDS = {
    "batch": st.integers(0, 4),
    "num_nodes": st.integers(0, 24),
    "layers": st.integers(0, 4),
    "num_experts": st.sampled_from([1, 7, 64, 65, 100, 128, 200]),
    "top_k": st.integers(1, 4),
    "budget": st.integers(0, 30),
    "tie_levels": st.sampled_from([0, 2, 5]),
    "policy": st.sampled_from(["confidence", "ecospec", "adaptive"]),
    "share_buffer": st.booleans(),
    "with_root": st.booleans(),
    "weights": st.sampled_from([None, "ones", "integers", "random"]),
    "eps": st.sampled_from([1e-3, 0.1, 1.0, 7.5]),
    # EP placement: none, one map for every layer, or one per layer; R = 300 has more
    # ranks than experts.
    "placement": st.sampled_from([None, "shared", "per_layer"]),
    "num_ranks": st.sampled_from([1, 2, 3, 8, 300]),
    "total_weight": st.sampled_from([None, 0.0, 0.3, 1.0]),
    "step_tokens": st.sampled_from([0.0, 1.0, 2.5]),
    "step_cost": st.sampled_from([0.05, 3.0, 40.0, 1e6]),
    "seed": st.integers(0, 2**31 - 1),
}
tree_cases = st.fixed_dictionaries(TREE_CASE_FIELDS)
# Trees big enough that the EP cost changes the choice often (most draws of tree_cases
# are small or single-rank, where it rarely does).
ep_cases = st.fixed_dictionaries(
    {
        **TREE_CASE_FIELDS,
        "batch": st.integers(1, 3),
        "num_nodes": st.integers(10, 40),
        "layers": st.integers(1, 5),
        "num_experts": st.sampled_from([16, 65, 128]),
        "top_k": st.integers(2, 8),
        "budget": st.integers(4, 20),
        "tie_levels": st.just(0),
        "policy": st.sampled_from(["ecospec", "adaptive"]),
        "with_root": st.just(True),
        "eps": st.sampled_from([1e-3, 0.1, 1.0]),
        "placement": st.sampled_from(["shared", "per_layer"]),
        "num_ranks": st.sampled_from([2, 3, 4, 8]),
        "total_weight": st.sampled_from([None, 0.0, 0.3]),
    }
)


def build_case(case):
    gen = torch.Generator().manual_seed(case["seed"])
    scores, parents, node_experts, roots = random_tree(
        gen,
        case["batch"],
        case["num_nodes"],
        case["layers"],
        case["num_experts"],
        case["top_k"],
        tie_levels=case["tie_levels"],
    )
    weights = {
        None: None,
        "ones": torch.ones(case["layers"]),
        "integers": torch.randint(0, 3, (case["layers"],), generator=gen).float(),
        "random": torch.rand(case["layers"], generator=gen),
    }[case["weights"]]
    kwargs = dict(
        root_experts=roots if case["with_root"] else None,
        policy=case["policy"],
        eps=case["eps"],
        share_buffer=case["share_buffer"],
        layer_weights=weights,
    )
    if case["placement"] is not None:
        shape = [case["num_experts"]]
        if case["placement"] == "per_layer":
            shape.insert(0, case["layers"])
        kwargs.update(
            expert_rank=torch.randint(
                0, case["num_ranks"], shape, generator=gen, dtype=torch.int32
            ),
            num_ranks=case["num_ranks"],
            total_weight=case["total_weight"],
        )
    if case["policy"] == "adaptive":
        kwargs.update(step_tokens=case["step_tokens"], step_cost=case["step_cost"])
    return (scores, parents, node_experts, case["budget"]), kwargs


def assert_valid_selection(out, parents, budget, *, full=True):
    batch, num_nodes = parents.shape
    assert out.shape == (batch, budget) and out.dtype == torch.int64
    for b, row in enumerate(out.tolist()):
        chosen = [i for i in row if i >= 0]
        assert row == chosen + [-1] * (budget - len(chosen)), "padding only at the end"
        assert chosen == sorted(set(chosen)), "ascending, no repeats"
        if full:
            assert len(chosen) == min(budget, num_nodes), "every reachable node can be chosen"
        for i in chosen:
            p = int(parents[b, i])
            assert p == -1 or p in chosen, "ancestor-closed"


def python_greedy_for(case, args, kwargs):
    """python_greedy on a case of build_case, with the API's defaults filled in."""
    placement = {}
    if "expert_rank" in kwargs:
        total_weight = kwargs["total_weight"]
        placement = dict(
            expert_rank=kwargs["expert_rank"],
            num_ranks=kwargs["num_ranks"],
            total_weight=1 / kwargs["num_ranks"] if total_weight is None else total_weight,
        )
    return python_greedy(
        *args,
        kwargs["root_experts"],
        kwargs["policy"],
        kwargs["eps"],
        kwargs["share_buffer"],
        kwargs["layer_weights"],
        case["num_experts"],
        step_tokens=kwargs.get("step_tokens", 1.0),
        step_cost=kwargs.get("step_cost", 1.0),
        **placement,
    )


@settings(max_examples=150, deadline=None)
@given(case=tree_cases)
def test_reference_matches_python_sets_and_invariants(case):
    args, kwargs = build_case(case)
    out = select_verify_set(*args, impl="reference", **kwargs)
    assert_valid_selection(out, args[1], args[3], full=case["policy"] != "adaptive")
    assert out.tolist() == python_greedy_for(case, args, kwargs)


@requires_native
@settings(max_examples=400, deadline=None)
@given(case=tree_cases)
def test_native_matches_reference(case):
    args, kwargs = build_case(case)
    expected = select_verify_set_reference(*args, **kwargs)
    assert torch.equal(select_verify_set(*args, impl="native", **kwargs), expected)


@settings(max_examples=60, deadline=None)
@given(case=ep_cases)
def test_ep_cost_on_larger_trees(case):
    args, kwargs = build_case(case)
    expected = select_verify_set_reference(*args, **kwargs)
    assert expected.tolist() == python_greedy_for(case, args, kwargs)
    if has_native():
        assert torch.equal(select_verify_set(*args, impl="native", **kwargs), expected)


@requires_native
def test_native_matches_reference_at_serving_shapes():
    gen = torch.Generator().manual_seed(0)
    for layers, num_experts, share in [(94, 128, False), (58, 256, True), (8, 64, True)]:
        scores, parents, node_experts, roots = random_tree(gen, 8, 64, layers, num_experts, 8)
        # EP 8 with EPLB-style placement: every layer its own map.
        rank = torch.randint(0, 8, (layers, num_experts), generator=gen)
        for policy, placement in [
            ("confidence", {}),
            ("ecospec", {}),
            ("ecospec", dict(expert_rank=rank)),
            ("adaptive", dict(expert_rank=rank, step_cost=400.0)),
        ]:
            kwargs = dict(root_experts=roots, policy=policy, share_buffer=share, **placement)
            expected = select_verify_set_reference(scores, parents, node_experts, 16, **kwargs)
            got = select_verify_set(scores, parents, node_experts, 16, impl="native", **kwargs)
            assert torch.equal(got, expected)


def test_huge_eps_ranks_by_confidence(impl):
    gen = torch.Generator().manual_seed(3)
    scores, parents, node_experts, roots = random_tree(gen, 4, 40, 6, 128, 8)
    confidence = select_verify_set(
        scores, parents, node_experts, 10, policy="confidence", impl=impl
    )
    ecospec = select_verify_set(
        scores, parents, node_experts, 10, root_experts=roots, eps=1e12, impl=impl
    )
    assert torch.equal(ecospec, confidence)


def test_shared_buffer_reuses_other_requests_experts(impl):
    # Request 1's candidates: node 0 (P = 0.6) needs experts {5, 6}; node 1 (P = 0.5) needs
    # {1, 2}, which request 0's root already loads. Only the shared buffer sees that.
    scores = torch.tensor([[0.9, 0.1], [0.6, 0.5]])
    parents = torch.full((2, 2), -1)
    node_experts = torch.stack(
        [
            torch.stack([experts([1, 2]), experts([3, 4])]),
            torch.stack([experts([5, 6]), experts([1, 2])]),
        ]
    )
    roots = torch.stack([experts([1, 2]), experts([7])])
    own = select_verify_set(scores, parents, node_experts, 1, root_experts=roots, impl=impl)
    shared = select_verify_set(
        scores, parents, node_experts, 1, root_experts=roots, share_buffer=True, impl=impl
    )
    assert own.tolist() == [[0], [0]]
    assert shared.tolist() == [[0], [1]]


def test_shared_buffer_gives_every_request_its_budget(impl):
    gen = torch.Generator().manual_seed(5)
    scores, parents, node_experts, roots = random_tree(gen, 6, 20, 4, 64, 4)
    scores[0] *= 1000  # one request with far higher scores must not starve the others
    out = select_verify_set(
        scores, parents, node_experts, 7, root_experts=roots, share_buffer=True, impl=impl
    )
    assert (out >= 0).sum(1).tolist() == [7] * 6


# --- expert parallelism --------------------------------------------------------------------


def test_ep_cost_prefers_the_idle_rank(impl):
    # Two ranks, experts 0-3 on rank 0 and 4-7 on rank 1; the root loads 0 and 1 (rank 0
    # is the busiest with 2). Node 0 (P = 0.5) adds expert 2: the busiest rank rises to 3.
    # Node 1 (P = 0.4) adds experts 4 and 5 on the idle rank: the peak stays 2.
    scores = torch.tensor([[0.5, 0.4]])
    parents = torch.tensor([[-1, -1]])
    node_experts = torch.stack([experts([2]), experts([4, 5])])[None]
    roots = experts([0, 1])[None]
    rank = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    kwargs = dict(root_experts=roots, eps=0.1, impl=impl)
    plain = select_verify_set(scores, parents, node_experts, 1, **kwargs)
    ep = select_verify_set(
        scores, parents, node_experts, 1, expert_rank=rank, total_weight=0.0, **kwargs
    )
    assert plain.tolist() == [[0]]  # 0.5 / 1.1 > 0.4 / 2.1
    assert ep.tolist() == [[1]]  # 0.4 / 0.1 > 0.5 / 1.1
    # The total term: node 1 now costs 0 + tw x 2 = 1 and node 0 costs 1 + tw x 0 = 1,
    # so with tw = 0.5 the higher P wins again.
    half = select_verify_set(
        scores, parents, node_experts, 1, expert_rank=rank, total_weight=0.5, **kwargs
    )
    assert half.tolist() == [[0]]


@pytest.mark.parametrize("total_weight", [None, 0.0, 0.3, 1.0])
@pytest.mark.parametrize("share_buffer", [False, True])
@pytest.mark.parametrize("policy", ["ecospec", "adaptive"])
def test_one_rank_is_plain_ecospec(impl, total_weight, share_buffer, policy):
    # With R = 1 the busiest rank holds every expert: the rise is the new experts and the
    # total term (fresh - rise) is 0, so the cost is the plain one bit for bit.
    gen = torch.Generator().manual_seed(11)
    scores, parents, node_experts, roots = random_tree(gen, 4, 30, 5, 100, 6)
    kwargs = dict(
        root_experts=roots,
        policy=policy,
        share_buffer=share_buffer,
        layer_weights=torch.rand(5, generator=gen),
        step_cost=200.0,
        impl=impl,
    )
    plain = select_verify_set(scores, parents, node_experts, 12, **kwargs)
    one_rank = select_verify_set(
        scores,
        parents,
        node_experts,
        12,
        expert_rank=torch.zeros(5, 100, dtype=torch.long),
        total_weight=total_weight,
        **kwargs,
    )
    assert torch.equal(one_rank, plain)


def test_total_weight_one_ignores_the_placement(impl):
    # tw = 1 prices every fresh expert alike, wherever it lives: plain EcoSpec.
    gen = torch.Generator().manual_seed(12)
    scores, parents, node_experts, roots = random_tree(gen, 3, 40, 4, 256, 8)
    rank = torch.randint(0, 8, (4, 256), generator=gen)
    plain = select_verify_set(scores, parents, node_experts, 10, root_experts=roots, impl=impl)
    ep = select_verify_set(
        scores,
        parents,
        node_experts,
        10,
        root_experts=roots,
        expert_rank=rank,
        total_weight=1.0,
        impl=impl,
    )
    assert torch.equal(ep, plain)


def test_ep_edge_cases(impl):
    gen = torch.Generator().manual_seed(13)
    # E = 65 (not a multiple of 64), more ranks than experts, budget larger than the tree.
    scores, parents, node_experts, roots = random_tree(gen, 2, 6, 3, 65, 4)
    rank = torch.randint(0, 200, (65,), generator=gen)
    out = select_verify_set(
        scores, parents, node_experts, 9, root_experts=roots, expert_rank=rank, impl=impl
    )
    assert_valid_selection(out, parents, 9)
    assert torch.equal(
        out,
        select_verify_set_reference(
            scores, parents, node_experts, 9, root_experts=roots, expert_rank=rank
        ),
    )
    # Empty frontier, and all-zero probabilities (lowest index first).
    empty = select_verify_set(
        torch.zeros(2, 0),
        torch.zeros(2, 0, dtype=torch.long),
        torch.zeros(2, 0, 3, 2, dtype=torch.long),
        2,
        expert_rank=torch.zeros(100, dtype=torch.long),
        num_ranks=4,
        impl=impl,
    )
    assert empty.tolist() == [[-1, -1]] * 2
    zeros = select_verify_set(
        torch.zeros(1, 5),
        torch.tensor([[-1, -1, 0, 2, 1]]),
        node_experts[:1, :5],
        3,
        expert_rank=rank,
        impl=impl,
    )
    assert zeros.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("share_buffer", [False, True])
def test_ep_cost_with_many_fresh_experts_per_layer(share_buffer):
    # Nodes that add more than 16 experts on more than 16 ranks in one layer: the native
    # ops' per-rank tally overflows and they count rank by rank instead.
    gen = torch.Generator().manual_seed(17)
    scores, parents, node_experts, roots = random_tree(gen, 3, 25, 3, 200, 48)
    for ranks in (64, 300):
        rank = torch.randint(0, ranks, (3, 200), generator=gen)
        kwargs = dict(
            root_experts=roots, expert_rank=rank, total_weight=0.0, share_buffer=share_buffer
        )
        expected = select_verify_set_reference(scores, parents, node_experts, 10, **kwargs)
        assert expected.tolist() == python_greedy(
            scores,
            parents,
            node_experts,
            10,
            roots,
            "ecospec",
            DEFAULT_EPS,
            share_buffer,
            None,
            200,
            expert_rank=rank,
            num_ranks=ranks,
            total_weight=0.0,
        )
        if has_native():
            native = select_verify_set(scores, parents, node_experts, 10, impl="native", **kwargs)
            assert torch.equal(native, expected)


def test_num_ranks_defaults_to_the_highest_rank_plus_one(impl):
    gen = torch.Generator().manual_seed(14)
    scores, parents, node_experts, roots = random_tree(gen, 2, 20, 3, 64, 4)
    rank = torch.randint(0, 4, (3, 64), generator=gen)
    rank[0, 0] = 5
    kwargs = dict(root_experts=roots, expert_rank=rank, impl=impl)
    assert torch.equal(
        select_verify_set(scores, parents, node_experts, 6, **kwargs),
        select_verify_set(
            scores, parents, node_experts, 6, num_ranks=6, total_weight=1 / 6, **kwargs
        ),
    )


def test_expert_rank_map_follows_sglang_layout():
    from sglang.srt.eplb.expert_location import _compute_gpu_id_of_physical_expert

    gen = torch.Generator().manual_seed(15)
    # 128 logical experts plus 32 redundant slots over 8 ranks: 20 slots per rank.
    physical = torch.randint(0, 160, (5, 128), generator=gen)
    ranks = expert_rank_map(physical, 160, 8)
    assert ranks.dtype == torch.int64 and ranks.shape == (5, 128)
    assert ranks.tolist() == [
        [_compute_gpu_id_of_physical_expert(int(p), 20) for p in row] for row in physical
    ]
    with pytest.raises(ValueError, match="multiple of ep_size"):
        expert_rank_map(physical, 161, 8)
    with pytest.raises(ValueError, match=r"slot -1, outside \[0, 160\)"):
        expert_rank_map(torch.tensor([0, -1]), 160, 8)


# --- adaptive budget -------------------------------------------------------------------------


def test_adaptive_stops_when_the_next_node_lowers_the_rate(impl):
    # A chain; each node adds one new expert and eps = 1, so priorities are P / 2:
    # 0.45, 0.25, 0.05. The step starts at 1 token for cost 4 (rate 0.25): node 0 pays
    # (0.45 >= 0.25) and lifts the rate to 1.9 / 6 = 0.317, which node 1 (0.25) misses.
    scores = torch.tensor([[0.9, 0.5, 0.1]])
    parents = torch.tensor([[-1, 0, 1]])
    node_experts = torch.stack([experts([1]), experts([2]), experts([3])])[None]
    kwargs = dict(policy="adaptive", eps=1.0, impl=impl)
    out = select_verify_set(scores, parents, node_experts, 3, step_cost=4.0, **kwargs)
    assert out.tolist() == [[0, -1, -1]]
    # A costlier step (rate 1 / 20) makes nodes 0 and 1 pay: (1 + 1.4) / 24 = 0.1 > 0.05.
    out = select_verify_set(scores, parents, node_experts, 3, step_cost=20.0, **kwargs)
    assert out.tolist() == [[0, 1, -1]]
    # A cheap step (rate 1 / 0.5 = 2) verifies nothing: speculation does not pay.
    out = select_verify_set(scores, parents, node_experts, 3, step_cost=0.5, **kwargs)
    assert out.tolist() == [[-1, -1, -1]]


def test_adaptive_takes_a_prefix_of_ecospec_order(impl):
    # Adaptive only stops early: per request, its set is EcoSpec's set at a smaller budget,
    # and a costlier step (lower starting rate) never takes fewer nodes.
    gen = torch.Generator().manual_seed(16)
    scores, parents, node_experts, roots = random_tree(gen, 6, 30, 4, 128, 8)
    rank = torch.randint(0, 4, (128,), generator=gen)
    previous = torch.zeros(6, dtype=torch.long)
    for step_cost in (1.0, 30.0, 100.0, 300.0, 1e9):
        kwargs = dict(root_experts=roots, expert_rank=rank, eps=0.5, impl=impl)
        out = select_verify_set(
            scores, parents, node_experts, 12, policy="adaptive", step_cost=step_cost, **kwargs
        )
        taken = (out >= 0).sum(1)
        assert (taken >= previous).all()
        previous = taken
        for b in range(6):
            prefix = select_verify_set(
                scores[b : b + 1],
                parents[b : b + 1],
                node_experts[b : b + 1],
                int(taken[b]),
                **{**kwargs, "root_experts": roots[b : b + 1]},
            )
            assert out[b, : int(taken[b])].tolist() == prefix[0].tolist()
    assert previous.tolist() == [12] * 6  # a step with a rate near 0 takes the budget


def test_adaptive_with_zero_scores_takes_nothing(impl):
    out = select_verify_set(
        torch.zeros(2, 4),
        torch.full((2, 4), -1),
        torch.zeros((2, 4, 1, 1), dtype=torch.long),
        3,
        policy="adaptive",
        step_cost=1e9,
        impl=impl,
    )
    assert out.tolist() == [[-1, -1, -1]] * 2


def test_adaptive_shared_account_covers_the_batch(impl):
    # One account for the step: request 0's good node lifts the rate that request 1's
    # node must meet. Alone, request 1's node (priority 0.3 / 1.1 = 0.27) beats the
    # starting rate 1 / 4; after request 0 takes P = 0.9, the rate is 2.9 / 9.1 = 0.32.
    scores = torch.tensor([[0.9], [0.3]])
    parents = torch.full((2, 1), -1)
    node_experts = torch.stack([experts([1])[None], experts([2])[None]])
    kwargs = dict(policy="adaptive", eps=0.1, step_cost=4.0, impl=impl)
    own = select_verify_set(scores, parents, node_experts, 1, **kwargs)
    shared = select_verify_set(scores, parents, node_experts, 1, share_buffer=True, **kwargs)
    assert own.tolist() == [[0], [0]]
    assert shared.tolist() == [[0], [-1]]


# --- edge cases ---------------------------------------------------------------------------


def test_budget_larger_than_tree_pads(impl):
    scores = torch.tensor([[0.5, 0.4, 0.3]])
    parents = torch.tensor([[-1, 0, 1]])
    node_experts = torch.zeros((1, 3, 2, 1), dtype=torch.long)
    out = select_verify_set(scores, parents, node_experts, 5, impl=impl)
    assert out.tolist() == [[0, 1, 2, -1, -1]]


def test_empty_tree_and_zero_budget(impl):
    empty = select_verify_set(
        torch.zeros(2, 0),
        torch.zeros(2, 0, dtype=torch.long),
        torch.zeros(2, 0, 3, 2, dtype=torch.long),
        3,
        impl=impl,
    )
    assert empty.tolist() == [[-1, -1, -1]] * 2
    gen = torch.Generator().manual_seed(1)
    scores, parents, node_experts, _ = random_tree(gen, 2, 5, 1, 8, 2)
    assert select_verify_set(scores, parents, node_experts, 0, impl=impl).shape == (2, 0)
    no_batch = select_verify_set(
        torch.zeros(0, 4),
        torch.zeros(0, 4, dtype=torch.long),
        torch.zeros(0, 4, 1, 1, dtype=torch.long),
        2,
        impl=impl,
    )
    assert no_batch.shape == (0, 2)


@pytest.mark.parametrize("policy", ["confidence", "ecospec"])
def test_all_zero_scores_take_lowest_indices_first(impl, policy):
    # Every priority is 0, so each step takes the lowest-index frontier node.
    parents = torch.tensor([[-1, -1, 0, 2, 1]])
    out = select_verify_set(
        torch.zeros(1, 5),
        parents,
        torch.zeros((1, 5, 1, 1), dtype=torch.long),
        3,
        policy=policy,
        impl=impl,
    )
    assert out.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize(
    "bad, message",
    [
        (float("nan"), "NaN"),
        (-0.5, "probabilities >= 0"),
    ],
)
def test_bad_scores(bad, message):
    scores = torch.tensor([[0.5, bad]])
    with pytest.raises(ValueError, match=message):
        select_verify_set(
            scores, torch.tensor([[-1, 0]]), torch.zeros((1, 2, 1, 1), dtype=torch.long), 1
        )


@pytest.mark.parametrize(
    "parents, message",
    [
        ([[-1, 2]], r"parents\[0, 1\] = 2 is outside \[-1, 2\)"),
        ([[-2, -1]], r"parents\[0, 0\] = -2"),
        ([[1, 0]], "cycle"),
        ([[-1, 1]], "cycle"),
    ],
)
def test_bad_parents(parents, message):
    with pytest.raises(ValueError, match=message):
        select_verify_set(
            torch.tensor([[0.5, 0.4]]),
            torch.tensor(parents),
            torch.zeros((1, 2, 1, 1), dtype=torch.long),
            1,
        )


def test_cycles_are_never_selected_without_validation(impl):
    # Nodes 1 and 2 point at each other: unreachable from the root.
    parents = torch.tensor([[-1, 2, 1, 0]])
    out = select_verify_set(
        torch.tensor([[0.1, 0.9, 0.9, 0.05]]),
        parents,
        torch.zeros((1, 4, 1, 1), dtype=torch.long),
        4,
        validate=False,
        impl=impl,
    )
    assert out.tolist() == [[0, 3, -1, -1]]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(policy="fastest"), ValueError, "policy must be one of"),
        (dict(eps=0.0), ValueError, "eps must be finite and > 0"),
        (dict(eps=math.inf), ValueError, "eps must be finite"),
        (dict(budget=-1), ValueError, "budget must be >= 0"),
        (dict(budget=2.0), TypeError, "budget must be an int"),
        (dict(scores=torch.zeros(1, 3)), ValueError, r"parents must have shape \(1, 3\)"),
        (dict(node_experts=torch.zeros(1, 2, 3)), ValueError, "node_experts must have 4 dims"),
        (dict(node_experts=torch.zeros(1, 2, 1, 1, dtype=torch.int32)), TypeError, "int64"),
        (
            dict(root_experts=torch.zeros(1, 2, 1, dtype=torch.long)),
            ValueError,
            r"root_experts must have shape \(1, 1, 1\)",
        ),
        (dict(layer_weights=torch.ones(2)), ValueError, r"layer_weights must have shape \(1,\)"),
        (dict(layer_weights=torch.tensor([-1.0])), ValueError, "finite and >= 0"),
        (dict(parents=torch.tensor([[-1.0, 0.0]])), TypeError, "parents must have dtype"),
        (dict(impl="gpu"), ValueError, "impl must be one of"),
        (dict(num_ranks=2), ValueError, "num_ranks needs expert_rank"),
        (dict(total_weight=0.5), ValueError, "total_weight needs expert_rank"),
        (dict(expert_rank=torch.zeros(8)), TypeError, "expert_rank must have dtype"),
        (dict(expert_rank=torch.zeros(2, 8, dtype=torch.long)), ValueError, r"\[E\] or \[L, E\]"),
        (dict(expert_rank=torch.zeros(65, dtype=torch.long)), ValueError, "W = ceil"),
        (
            dict(expert_rank=torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]), num_ranks=3),
            ValueError,
            r"expert_rank\[3\] = 3 is outside",
        ),
        (
            dict(expert_rank=torch.zeros(8, dtype=torch.long), num_ranks=0),
            ValueError,
            "num_ranks must be >= 1",
        ),
        (
            dict(expert_rank=torch.zeros(8, dtype=torch.long), total_weight=1.5),
            ValueError,
            r"total_weight must lie in \[0, 1\]",
        ),
        (dict(policy="adaptive"), ValueError, "needs step_cost"),
        (dict(policy="adaptive", step_cost=0.0), ValueError, "step_cost must be finite and > 0"),
        (
            dict(policy="adaptive", step_cost=1.0, step_tokens=-1.0),
            ValueError,
            "step_tokens must be >= 0",
        ),
        (dict(policy="adaptive", step_cost=math.nan), ValueError, "step_cost must be finite"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    args = dict(
        scores=torch.tensor([[0.5, 0.4]]),
        parents=torch.tensor([[-1, 0]]),
        node_experts=torch.zeros((1, 2, 1, 1), dtype=torch.long),
        budget=1,
    )
    args.update(kwargs)
    with pytest.raises(error, match=message):
        select_verify_set(
            args.pop("scores"),
            args.pop("parents"),
            args.pop("node_experts"),
            args.pop("budget"),
            **args,
        )
