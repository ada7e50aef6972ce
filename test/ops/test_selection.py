import pytest
import torch
from _selection import assert_valid_selection, experts, python_greedy, random_tree
from _util import requires_native
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_ecospec import has_native, select_verify_set
from sgl_ecospec.ops.selection import select_verify_set_reference


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
    "round_sync": st.booleans(),  # with share_buffer only
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
    # A request's k-th candidate's scheduled cost: none, or falling (decay < 1) or flat.
    "candidate_cost": st.sampled_from([0.0, 0.0, 2.0, 30.0]),
    "candidate_decay": st.sampled_from([1.0, 0.6, 0.1, 0.0]),
    # The score floor: none (most draws), or one that cuts some subtrees or nearly all.
    "min_score": st.sampled_from([0.0, 0.0, 0.0, 0.05, 0.3, 0.9]),
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
        round_sync=case["share_buffer"] and case.get("round_sync", False),
        layer_weights=weights,
        candidate_cost=case["candidate_cost"],
        candidate_decay=case["candidate_decay"],
        min_score=case["min_score"],
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


@settings(max_examples=150, deadline=None)
@given(case=tree_cases)
def test_reference_matches_python_sets_and_invariants(case):
    args, kwargs = build_case(case)
    out = select_verify_set(*args, impl="reference", **kwargs)
    full = case["policy"] != "adaptive" and case["min_score"] == 0
    assert_valid_selection(out, args[1], args[3], full=full)
    assert out.tolist() == python_greedy(*args, case["num_experts"], **kwargs)


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
    assert expected.tolist() == python_greedy(*args, case["num_experts"], **kwargs)
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
