"""The selector and its hooks, against SGLang's own organize_draft_results and
select_top_k_tokens."""

import pytest
import torch
from sglang_ecospec import eps_table, selection
from sglang_ecospec.settings import EcoSpecSettings

from plugin._helpers import (
    PUBLISHED,
    StateEchoPredictor,
    assert_valid_selection,
    draft_tree_through_hooks,
    make_selector,
    sglang_draft_tree,
    spy_on_selection,
)
from sgl_ecospec import step as library_step
from sgl_ecospec.predictors import OnlineExpertPredictor


@pytest.mark.parametrize("batch, steps, ndt", [(1, 3, 6), (3, 4, 8), (2, 1, 3), (5, 2, 10)])
def test_confidence_policy_equals_sglang_organize_draft_results(batch, steps, ndt):
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    original = getattr(organize_draft_results, "__wrapped__", organize_draft_results)
    tree = sglang_draft_tree(batch, 3, steps, seed=batch * 10 + steps)
    want = original(*tree, ndt)
    selector = make_selector("confidence")
    selector.set_roots(torch.arange(batch))
    got = selector.organize(*tree, ndt)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g)


@pytest.mark.parametrize("share_buffer", [True, False])
def test_ecospec_policy_returns_what_sglang_expects(share_buffer):
    tree = sglang_draft_tree(4, 3, 4, seed=3)
    selector = make_selector("ecospec", share_buffer)
    # Teach the predictor some routing so costs differ between tokens.
    tokens = torch.cat(tree[1], 1).flatten()
    gen = torch.Generator().manual_seed(0)
    selector.predictor.observe(tokens, torch.randint(0, 16, (tokens.numel(), 2, 2), generator=gen))
    selector.set_roots(torch.tensor([5, 6, 7, 8]))
    got = selector.organize(*tree, 7)
    assert_valid_selection(tree, got, 7)


def test_ecospec_prefers_the_candidate_that_adds_fewer_experts():
    # One request, topk 2, one step: two children of the root, P = 0.55 and 0.45.
    score_list = [torch.tensor([[[0.55, 0.45]]])]
    token_list = [torch.tensor([[10, 11]])]
    parents_list = [torch.tensor([[-1, 0, 1]])]
    predictor = OnlineExpertPredictor(1, 8, 2, num_buckets=1 << 16)
    # The root (token 1) uses experts {0, 1}; token 10 needs {4, 5}; token 11 shares {0, 1}.
    predictor.observe(torch.tensor([1, 10, 11]), torch.tensor([[[0, 1]], [[4, 5]], [[0, 1]]]))
    for policy, want in [("confidence", 10), ("ecospec", 11)]:
        settings = EcoSpecSettings(policy=policy, log_interval=0, **PUBLISHED)
        selector = selection.EcoSpecSelector(
            settings, predictor, topk=2, num_draft_tokens=2, max_batch=2, device="cpu"
        )
        selector.set_roots(torch.tensor([1]))
        _, _, draft_tokens = selector.organize(score_list, token_list, parents_list, 2)
        assert draft_tokens.tolist() == [[want]]


def test_candidate_parents_follow_sglang_tree_layout():
    # topk 2, 3 steps: parent_list = [-1, 0, 1, a, b] where a, b are step-1 candidates.
    parent_list = torch.tensor([[-1, 0, 1, 3, 4]])
    parents = selection.candidate_parents(parent_list, 2 + 2 * 4, 2)
    assert parents.tolist() == [[-1, -1, 0, 0, 1, 1, 3, 3, 4, 4]]
    assert selection.candidate_parents(torch.empty(2, 0), 3, 3).tolist() == [[-1] * 3] * 2


def test_set_roots_marks_padding_invalid():
    selector = make_selector(max_batch=4)
    selector.set_roots(torch.tensor([3, 4]))
    assert selector.root_valid.tolist() == [True, True, False, False]
    selector.set_roots(None)
    assert not selector.root_valid.any()


def test_organize_hook_defers_to_sglang_when_inactive_or_at_another_width():
    calls = []

    def original(*args):
        calls.append(args)
        return "sglang"

    selection.slot.activate(None)
    assert selection.organize_hook(original, [1], [2], [3], 4) == "sglang"
    selector = make_selector(ndt=4)
    selection.slot.activate(selector)
    try:
        tree = sglang_draft_tree(1, 3, 2, seed=1)
        assert selection.organize_hook(original, *tree, 4)[1].shape == (1, 3)
        # Another width (the utility gate's narrow level, 2 draft tokens): SGLang's own.
        assert selection.organize_hook(original, *tree, 2) == "sglang"
    finally:
        selection.slot.activate(None)
    assert len(calls) == 2


def test_auto_eps_is_looked_up_by_batch_size(monkeypatch):
    calls = spy_on_selection(monkeypatch)
    table = eps_table.EpsTable(batches=(1, 2, 4), eps=(0.01, 0.02, 0.5))
    predictor = OnlineExpertPredictor(2, 16, 2, num_buckets=64)
    settings = EcoSpecSettings(eps="auto", profile="qwen3-30b-a3b", hardware="h200", **PUBLISHED)
    selector = selection.EcoSpecSelector(
        settings, predictor, topk=3, num_draft_tokens=5, max_batch=8, device="cpu", eps_table=table
    )
    for batch in (1, 3, 5):
        tree = sglang_draft_tree(batch, 3, 2, seed=batch)
        selector.set_roots(torch.arange(batch))
        assert_valid_selection(tree, selector.organize(*tree, 5), 5)
    assert [call["eps"] for call in calls] == [0.01, 0.02, 0.5]
    assert "expert_rank" not in calls[0]  # no EP placement: plain expert counts
    with pytest.raises(ValueError, match="eps_table is required"):
        selection.EcoSpecSelector(
            settings, predictor, topk=3, num_draft_tokens=5, max_batch=8, device="cpu"
        )
    assert eps_table.bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert eps_table.bucket_sizes(1) == [1]


def test_head_gets_the_draft_state_that_proposed_each_candidate():
    batch, topk, steps, ndt = 2, 3, 3, 5
    predictor = StateEchoPredictor(2, 16, 2, num_buckets=64)
    settings = EcoSpecSettings(policy="confidence", log_interval=0)
    selector = selection.EcoSpecSelector(
        settings, predictor, topk=topk, num_draft_tokens=ndt, max_batch=4, device="cpu"
    )
    selection.slot.activate(selector)
    try:
        selector.set_roots(torch.tensor([7, 8]))
        lists, proposers = draft_tree_through_hooks(batch, topk, steps, 3)
        _, index, _ = selection.organize_hook(None, *lists, ndt)
    finally:
        selection.slot.activate(None)
    # One predict_topk call over the root-first rows: each request's root reads its own
    # state (0 and 1); check the candidates' through the recorded verify rows.
    assert predictor.seen.view(batch, -1)[:, 0].tolist() == [0.0, 1.0]
    chosen = proposers.gather(1, index)  # [B, D - 1]: the state behind each chosen node
    rows = selector.verify_topk[: batch * ndt].view(batch, ndt, 2, 2)
    assert rows[:, 0, 0, 0].tolist() == [0, 1]  # roots
    assert torch.equal(rows[:, 1:, 0, 0].long(), chosen.long() % 16)


def recall_weighted_selector(predictor, **settings):
    selector = selection.EcoSpecSelector(
        EcoSpecSettings(recall_weighted_cost=True, min_score=0.0, log_interval=0, **settings),
        predictor,
        topk=3,
        num_draft_tokens=7,
        max_batch=4,
        device="cpu",
    )
    assert selector.live_recall is predictor.live_recall  # the library's, attached once
    return selector


def test_recall_weighted_cost_falls_from_ecospec_to_confidence_with_the_trust():
    """The example above: at trust 1 the recall-weighted cost is EcoSpec's (token 11 adds
    no expert), at trust 0 (a cold predictor) it trusts no prediction: confidence's 10."""
    score_list = [torch.tensor([[[0.55, 0.45]]])]
    token_list = [torch.tensor([[10, 11]])]
    parents_list = [torch.tensor([[-1, 0, 1]])]
    predictor = OnlineExpertPredictor(1, 8, 2, num_buckets=1 << 16)
    predictor.observe(torch.tensor([1, 10, 11]), torch.tensor([[[0, 1]], [[4, 5]], [[0, 1]]]))
    settings = EcoSpecSettings(recall_weighted_cost=True, log_interval=0)
    selector = selection.EcoSpecSelector(
        settings, predictor, topk=2, num_draft_tokens=2, max_batch=2, device="cpu"
    )
    live = selector.live_recall
    live.novel.fill_(1.5)  # as measured: what a verified candidate really brings
    for trust, want in [(1.0, 11), (0.47, 11), (0.07, 10), (0.0, 10)]:
        live.trust.fill_(trust)
        selector.set_roots(torch.tensor([1]))
        _, _, draft_tokens = selector.organize(score_list, token_list, parents_list, 2)
        assert draft_tokens.tolist() == [[want]], trust


def test_recall_weighted_cost_is_the_librarys_rule_without_a_host_read(monkeypatch):
    """On SGLang trees the plugin's verify sets are those of the offline engine's rule
    (``LiveRecall.weigh`` with ``host_eps``: layer weights w_l, eps raised by the
    unpredicted cost of the step's buffer, a host read): the plugin folds that eps into the
    layer weights on the device. At trust 1 the plain EcoSpec selection."""
    calls = []
    real = library_step.select_verify_set

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(library_step, "select_verify_set", spy)
    predictor = OnlineExpertPredictor(3, 16, 2, num_buckets=64)
    tree = sglang_draft_tree(4, 3, 4, seed=5)
    tokens = torch.cat(tree[1], 1).flatten()
    gen = torch.Generator().manual_seed(1)
    predictor.observe(tokens, torch.randint(0, 16, (tokens.numel(), 3, 2), generator=gen))
    selector = recall_weighted_selector(predictor, eps=0.5)
    plain = selection.EcoSpecSelector(
        EcoSpecSettings(eps=0.5, log_interval=0, **PUBLISHED),
        predictor,
        topk=3,
        num_draft_tokens=7,
        max_batch=4,
        device="cpu",
    )
    roots = torch.tensor([5, 6, 7, 8])
    for trust in ([0.89, 0.43, 0.09], [0.54, 0.0, 0.2], [1.0, 1.0, 1.0]):
        live = selector.live_recall
        live.trust.copy_(torch.tensor(trust))
        selector.set_roots(roots)
        calls.clear()
        got = selector.organize(*tree, 7)
        assert_valid_selection(tree, got, 7)
        ((args, kwargs),) = calls
        options, weights = selector.live_recall.weigh(selector.options_for(4), None, host_eps=True)
        assert kwargs["options"].eps == selector.options_for(4).eps  # nothing read on the host
        library = {**kwargs, "options": options, "layer_weights": weights}
        assert torch.equal(got[1], real(*args, **library))
    plain.set_roots(roots)
    calls.clear()
    assert torch.equal(plain.organize(*tree, 7)[1], got[1])  # trust 1: plain EcoSpec
    assert calls[0][1]["layer_weights"] is None


def test_min_score_leaves_copies_in_the_fixed_width_verify():
    # Two children of the root, P = 0.55 and 0.45; with the floor 0.5 only token 10 is
    # verified, and the second of SGLang's fixed slots repeats it (marked a copy).
    score_list = [torch.tensor([[[0.55, 0.45]]])]
    token_list = [torch.tensor([[10, 11]])]
    parents_list = [torch.tensor([[-1, 0, 1]])]
    predictor = OnlineExpertPredictor(1, 8, 2, num_buckets=1 << 16)
    for min_score, want, copies in [(0.0, [10, 11], [False] * 3), (0.5, [10, 10], [0, 0, 1])]:
        settings = EcoSpecSettings(min_score=min_score, log_interval=0)
        selector = selection.EcoSpecSelector(
            settings, predictor, topk=2, num_draft_tokens=3, max_batch=2, device="cpu"
        )
        assert (selector.copy_rows is not None) == (min_score > 0)
        selector.set_roots(torch.tensor([1]))
        _, _, draft_tokens = selector.organize(score_list, token_list, parents_list, 3)
        assert draft_tokens.tolist() == [want]
        if selector.copy_rows is not None:
            assert selector.copy_rows[0].tolist() == [bool(c) for c in copies]
