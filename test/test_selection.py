import math

import pytest
import torch
from _util import IMPLS, requires_native
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_ecospec import select_verify_set, topk_to_bitmap
from sgl_ecospec.bitmaps import bitmap_to_ids
from sgl_ecospec.selection import select_verify_set_reference
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
    chosen = [[] for _ in range(batch)]

    def pick(b):
        best, best_priority = -1, None
        for i in range(num_nodes):
            p = int(parents[b, i])
            if i in chosen[b] or (p >= 0 and p not in chosen[b]):
                continue
            priority = float(scores[b, i])
            if policy == "ecospec":
                missing = [len(sets[b][i][layer] - buffers[b][layer]) for layer in range(layers)]
                cost = 0.0
                for layer in range(layers):
                    cost += (1.0 if weights is None else float(weights[layer])) * missing[layer]
                priority = priority / (cost + eps)
            if best < 0 or priority > best_priority:
                best, best_priority = i, priority
        if best >= 0:
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

tree_cases = st.fixed_dictionaries(
    {
        "batch": st.integers(0, 4),
        "num_nodes": st.integers(0, 24),
        "layers": st.integers(0, 4),
        "num_experts": st.sampled_from([1, 7, 64, 65, 100, 128, 200]),
        "top_k": st.integers(1, 4),
        "budget": st.integers(0, 30),
        "tie_levels": st.sampled_from([0, 2, 5]),
        "policy": st.sampled_from(["confidence", "ecospec"]),
        "share_buffer": st.booleans(),
        "with_root": st.booleans(),
        "weights": st.sampled_from([None, "ones", "integers", "random"]),
        "eps": st.sampled_from([1e-3, 0.1, 1.0, 7.5]),
        "seed": st.integers(0, 2**31 - 1),
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
    return (scores, parents, node_experts, case["budget"]), kwargs


def assert_valid_selection(out, parents, budget):
    batch, num_nodes = parents.shape
    assert out.shape == (batch, budget) and out.dtype == torch.int64
    for b, row in enumerate(out.tolist()):
        chosen = [i for i in row if i >= 0]
        assert row == chosen + [-1] * (budget - len(chosen)), "padding only at the end"
        assert chosen == sorted(set(chosen)), "ascending, no repeats"
        assert len(chosen) == min(budget, num_nodes), "every reachable node can be chosen"
        for i in chosen:
            p = int(parents[b, i])
            assert p == -1 or p in chosen, "ancestor-closed"


@settings(max_examples=150, deadline=None)
@given(case=tree_cases)
def test_reference_matches_python_sets_and_invariants(case):
    args, kwargs = build_case(case)
    out = select_verify_set(*args, impl="reference", **kwargs)
    assert_valid_selection(out, args[1], args[3])
    expected = python_greedy(
        *args,
        kwargs["root_experts"],
        kwargs["policy"],
        kwargs["eps"],
        kwargs["share_buffer"],
        kwargs["layer_weights"],
        case["num_experts"],
    )
    assert out.tolist() == expected


@requires_native
@settings(max_examples=400, deadline=None)
@given(case=tree_cases)
def test_native_matches_reference(case):
    args, kwargs = build_case(case)
    expected = select_verify_set_reference(*args, **kwargs)
    assert torch.equal(select_verify_set(*args, impl="native", **kwargs), expected)


@requires_native
def test_native_matches_reference_at_serving_shapes():
    gen = torch.Generator().manual_seed(0)
    for layers, num_experts, share in [(94, 128, False), (58, 256, True), (8, 64, True)]:
        scores, parents, node_experts, roots = random_tree(gen, 8, 64, layers, num_experts, 8)
        for policy in ("confidence", "ecospec"):
            kwargs = dict(root_experts=roots, policy=policy, share_buffer=share)
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
