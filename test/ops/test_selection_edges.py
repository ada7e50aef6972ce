"""select_verify_set: the adaptive policy, degenerate trees and argument errors."""

import math

import pytest
import torch
from _selection import experts, random_tree

from sgl_ecospec import select_verify_set
from sgl_ecospec.ops.options import SelectionOptions


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


@pytest.mark.parametrize("policy", ["confidence", "ecospec", "adaptive"])
def test_min_score_never_takes_a_node_below_the_floor(impl, policy):
    # Nodes 0 -> 1 -> 2 a chain, node 3 a second child of the root. Node 3 adds no expert,
    # so ecospec ranks it first (0.06 / 0.01 against 0.7 / 1.01) without a floor; at the
    # floor 0.1 it is never taken, node 1 (exactly 0.1) is, and node 2 below it is cut with
    # the rest of the chain.
    scores = torch.tensor([[0.7, 0.1, 0.08, 0.06]])
    parents = torch.tensor([[-1, 0, 1, -1]])
    no_expert = torch.zeros_like(experts([1]))
    node_experts = torch.stack([experts([1]), experts([2]), experts([3]), no_expert])[None]
    kwargs = dict(policy=policy, eps=0.01, step_cost=1e6, impl=impl)
    free = select_verify_set(scores, parents, node_experts, 4, **kwargs)
    assert free.tolist() == [[0, 1, 2, 3]]
    floored = select_verify_set(scores, parents, node_experts, 4, min_score=0.1, **kwargs)
    assert floored.tolist() == [[0, 1, -1, -1]]
    if policy == "ecospec":
        first = select_verify_set(scores, parents, node_experts, 1, **kwargs)
        assert first.tolist() == [[3]]
        # The floor does not stop the set at a node below it: the next one above is taken.
        first = select_verify_set(scores, parents, node_experts, 1, min_score=0.07, **kwargs)
        assert first.tolist() == [[0]]


@pytest.mark.parametrize("share_buffer", [False, True])
def test_adaptive_prices_each_candidate_by_how_many_its_request_took(impl, share_buffer):
    # Chains with no predicted experts: a candidate costs eps + candidate_cost x decay^k,
    # k = candidates its request took. Request 0: 0.6 / 1.001 pays against the start rate
    # 1 / 2 (tokens 1.6, cost 3.001); its second, 0.5 / 0.501, and third, 0.4 / 0.251, pay
    # too. A flat cost (decay 1) prices the second at 0.5 / 1.001 < 1.6 / 3.001: it stops.
    scores = torch.tensor([[0.6, 0.5, 0.4], [0.3, 0.29, 0.28]])
    parents = torch.tensor([[-1, 0, 1], [-1, 0, 1]])
    node_experts = torch.zeros(2, 3, 1, 1, dtype=torch.int64)
    kwargs = dict(policy="adaptive", eps=1e-3, step_cost=2.0, candidate_cost=1.0, impl=impl)
    falling = select_verify_set(scores, parents, node_experts, 3, candidate_decay=0.5, **kwargs)
    flat = select_verify_set(scores, parents, node_experts, 3, candidate_decay=1.0, **kwargs)
    # Request 1's first candidate (0.3 / 1.001) never pays, so its price never falls: a
    # request that declined is not offered its first candidate again at a later one's price.
    assert falling.tolist()[1] == flat.tolist()[1] == [-1, -1, -1]
    if not share_buffer:
        assert falling.tolist()[0] == [0, 1, 2] and flat.tolist()[0] == [0, -1, -1]
    kwargs["share_buffer"] = share_buffer
    out = select_verify_set(scores, parents, node_experts, 3, candidate_decay=0.5, **kwargs)
    assert out.tolist()[1] == [-1, -1, -1] and out.tolist()[0][0] == 0


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
        (dict(min_score=-0.5), ValueError, "min_score must be >= 0"),
        (dict(min_score=math.nan), ValueError, "min_score must be finite"),
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
        (dict(options=SelectionOptions(), eps=0.2), TypeError, "either as options= or as keywords"),
        (dict(options={"eps": 0.2}), TypeError, "options must be a SelectionOptions"),
        (dict(epsilon=0.2), TypeError, r"unknown selection option\(s\) \['epsilon'\]"),
        (dict(round_sync=True), ValueError, "round_sync=True needs share_buffer=True"),
        (
            dict(options=SelectionOptions(share_buffer=True), round_sync=1),
            TypeError,
            "either as options= or as keywords",
        ),
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


def test_options_and_keywords_select_alike(impl):
    scores, parents = torch.tensor([[1.0, 0.53, 0.42]]), torch.tensor([[-1, 0, 0]])
    node_experts = torch.stack(
        [experts([1, 2, 3, 4]), experts([1, 5, 6, 7]), experts([1, 2, 5, 6])]
    )
    for keywords in (dict(eps=0.1), dict(policy="confidence"), dict(eps=0.1, min_score=0.5)):
        by_keywords = select_verify_set(
            scores, parents, node_experts[None], 2, impl=impl, **keywords
        )
        options = SelectionOptions(**keywords)
        by_options = select_verify_set(
            scores, parents, node_experts[None], 2, impl=impl, options=options
        )
        assert torch.equal(by_keywords, by_options)
    # The paper's example: ecospec takes t2, confidence t1, a floor of 0.5 t1 alone.
    assert by_options.tolist() == [[0, 1]]


def test_round_sync_picks_against_the_round_start(impl):
    # Request 0 ranks x (0.5, expert 1) over y (0.4, expert 2); request 1 ranks u (0.5,
    # expert 3) over v (0.4, expert 1) on an empty buffer. Turn by turn, request 1 sees x's
    # expert 1 already loaded and takes v (0.4 / 0.1 against 0.5 / 1.1); with round_sync both
    # pick against the round's start, so request 1 takes u.
    scores = torch.tensor([[0.5, 0.4], [0.5, 0.4]])
    parents = torch.full((2, 2), -1)
    node_experts = torch.stack(
        [torch.stack([experts([1]), experts([2])]), torch.stack([experts([3]), experts([1])])]
    )
    kwargs = dict(policy="ecospec", eps=0.1, share_buffer=True, impl=impl)
    turns = select_verify_set(scores, parents, node_experts, 1, **kwargs)
    rounds = select_verify_set(scores, parents, node_experts, 1, round_sync=True, **kwargs)
    assert turns.tolist() == [[0], [1]]
    assert rounds.tolist() == [[0], [0]]
    # Round 2 starts from experts {1, 3}: request 0's y (expert 2) and request 1's v (expert 1,
    # loaded) are all that is left, so both rules end with every node.
    rounds = select_verify_set(scores, parents, node_experts, 2, round_sync=True, **kwargs)
    assert rounds.tolist() == [[0, 1], [0, 1]]
