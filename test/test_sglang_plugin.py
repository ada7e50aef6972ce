"""The SGLang plugin's pieces, without a server: settings, selection (against SGLang's own
organize_draft_results), routing capture, statistics in the decode log line and Prometheus
metrics, registration, the CPU-mode ops and tree-mask fix."""

import json
import logging
import math
import os
import subprocess
import sys
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest
import torch
from sglang_ecospec import ep_placement, eps_table, metrics, routing, selection
from sglang_ecospec.settings import EcoSpecSettings, EcoSpecSettingsError
from sglang_ecospec_cpu import ops

from sgl_ecospec import step as library_step
from sgl_ecospec.predictors import OnlineExpertPredictor

# --- settings -------------------------------------------------------------------------------


def test_settings_defaults_and_env_overrides(tmp_path):
    assert EcoSpecSettings.from_env({}) == EcoSpecSettings()
    config = tmp_path / "ecospec.json"
    config.write_text(json.dumps({"eps": 0.5, "policy": "confidence", "log_interval": 7}))
    settings = EcoSpecSettings.from_env(
        {
            "SGLANG_ECOSPEC_CONFIG": str(config),
            "SGLANG_ECOSPEC_EPS": "0.25",  # the variable wins over the file
            "SGLANG_ECOSPEC_SHARE_BUFFER": "false",
            "SGLANG_ECOSPEC_PREDICTOR_FILE": "none",
            "OTHER": "ignored",
        }
    )
    assert settings.eps == 0.25 and settings.policy == "confidence"
    assert settings.share_buffer is False and settings.log_interval == 7
    assert settings.predictor_file is None


@pytest.mark.parametrize(
    "env, message",
    [
        ({"SGLANG_ECOSPEC_EPSILON": "1"}, "unknown EcoSpec setting SGLANG_ECOSPEC_EPSILON"),
        ({"SGLANG_ECOSPEC_EPS": "0"}, "eps must be"),
        ({"SGLANG_ECOSPEC_EPS": "nan"}, "eps must be"),
        ({"SGLANG_ECOSPEC_LEARN": "maybe"}, "not a valid bool"),
        ({"SGLANG_ECOSPEC_POLICY": "fastest"}, "policy must be one of"),
        ({"SGLANG_ECOSPEC_PREDICTOR": "oracle"}, "predictor must be one of"),
        ({"SGLANG_ECOSPEC_PREDICTOR_FILE": "/no/such/file"}, "does not exist"),
        ({"SGLANG_ECOSPEC_NUM_BUCKETS": "0"}, "num_buckets"),
        ({"SGLANG_ECOSPEC_CONFIG": "/no/such.json"}, "no such file"),
        ({"SGLANG_ECOSPEC_POLICY": "adaptive"}, "fixed per step.*--adaptive-config"),
        ({"SGLANG_ECOSPEC_EPS": "fast"}, "eps must be a finite number > 0 or 'auto'"),
        ({"SGLANG_ECOSPEC_EPS": "auto"}, "eps='auto' needs profile and hardware"),
        (
            {"SGLANG_ECOSPEC_EPS": "auto", "SGLANG_ECOSPEC_PROFILE": "qwen3-235b-a22b"},
            "eps='auto' needs hardware: hardware: its GPUs \\(one of h100, h200",
        ),
        (
            {
                "SGLANG_ECOSPEC_EPS": "auto",
                "SGLANG_ECOSPEC_PROFILE": "llama",
                "SGLANG_ECOSPEC_HARDWARE": "h200",
            },
            "unknown model 'llama'; valid: qwen3-235b-a22b, qwen3-30b-a3b",
        ),
        (
            {
                "SGLANG_ECOSPEC_EPS": "auto",
                "SGLANG_ECOSPEC_PROFILE": "qwen3-30b-a3b",
                "SGLANG_ECOSPEC_HARDWARE": "tpu",
            },
            "unknown hardware 'tpu'",
        ),
        (
            {"SGLANG_ECOSPEC_HARDWARE": "h200"},
            "hardware set but eps = 0.1: .* only with eps='auto'",
        ),
        ({"SGLANG_ECOSPEC_TOTAL_WEIGHT": "1.5"}, "total_weight must lie in"),
        ({"SGLANG_ECOSPEC_EP_COST": "2"}, "not a valid bool"),
    ],
)
def test_settings_errors_name_the_problem(env, message):
    with pytest.raises(EcoSpecSettingsError, match=message):
        EcoSpecSettings.from_env(env)


def test_settings_eps_auto_and_ep_fields(tmp_path):
    settings = EcoSpecSettings.from_env(
        {
            "SGLANG_ECOSPEC_EPS": "auto",
            "SGLANG_ECOSPEC_PROFILE": "qwen3-30b-a3b",
            "SGLANG_ECOSPEC_HARDWARE": "8xh200",
            "SGLANG_ECOSPEC_EP_COST": "false",
            "SGLANG_ECOSPEC_TOTAL_WEIGHT": "0.25",
        }
    )
    assert settings.eps_auto and settings.hardware == "8xh200"
    assert settings.ep_cost is False and settings.total_weight == 0.25
    assert not EcoSpecSettings().eps_auto and EcoSpecSettings().ep_cost
    config = tmp_path / "ecospec.json"
    config.write_text(json.dumps({"eps": "auto", "profile": "deepseek-v3", "hardware": "h100"}))
    assert EcoSpecSettings.from_env({"SGLANG_ECOSPEC_CONFIG": str(config)}).eps_auto
    config.write_text(json.dumps({"eps": 2}))  # a JSON int is a number
    assert EcoSpecSettings.from_env({"SGLANG_ECOSPEC_CONFIG": str(config)}).eps == 2
    config.write_text(json.dumps({"eps": [1]}))
    with pytest.raises(EcoSpecSettingsError, match="'eps' .* must be float or str"):
        EcoSpecSettings.from_env({"SGLANG_ECOSPEC_CONFIG": str(config)})


def test_settings_file_rejects_unknown_keys_and_wrong_types(tmp_path):
    config = tmp_path / "bad.json"
    config.write_text(json.dumps({"epsilon": 1.0}))
    with pytest.raises(EcoSpecSettingsError, match="unknown EcoSpec settings"):
        EcoSpecSettings.from_env({"SGLANG_ECOSPEC_CONFIG": str(config)})
    config.write_text(json.dumps({"share_buffer": "yes"}))
    with pytest.raises(EcoSpecSettingsError, match="must be bool"):
        EcoSpecSettings.from_env({"SGLANG_ECOSPEC_CONFIG": str(config)})


# --- selection ------------------------------------------------------------------------------


def sglang_draft_tree(batch, topk, steps, seed, vocab=1000):
    """score_list, token_list, parents_list exactly as EagleDraftWorker.draft_forward builds
    them, from SGLang's own select_top_k_tokens and random draft distributions."""
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    gen = torch.Generator().manual_seed(seed)
    hidden = torch.zeros(batch, 4)
    rows = batch
    scores = None
    score_list, token_list, parents_list = [], [], []
    for i in range(steps):
        probs = torch.rand(rows, vocab, generator=gen).pow(6)
        probs = probs / probs.sum(-1, keepdim=True)
        topk_p, topk_index = probs.topk(topk, dim=-1)
        _, hidden, scores, tree_info = select_top_k_tokens(
            i, topk_p, topk_index, hidden, scores, topk
        )
        score_list.append(tree_info[0])
        token_list.append(tree_info[1])
        parents_list.append(tree_info[2])
        rows = batch * topk
        hidden = torch.zeros(rows, 4)
    return score_list, token_list, parents_list


def make_selector(policy="confidence", share_buffer=True, num_experts=16, max_batch=8, ndt=8):
    predictor = OnlineExpertPredictor(2, num_experts, 2, num_buckets=64)
    settings = EcoSpecSettings(policy=policy, share_buffer=share_buffer, log_interval=0)
    return selection.EcoSpecSelector(
        settings, predictor, topk=3, num_draft_tokens=ndt, max_batch=max_batch, device="cpu"
    )


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


def assert_valid_selection(tree, got, ndt, topk=3):
    score_list, token_list, parents_list = tree
    parent_list, index, draft_tokens = got
    tokens = torch.cat(token_list, 1)
    batch, num_candidates = tokens.shape
    assert index.shape == draft_tokens.shape == (batch, ndt - 1)
    assert torch.equal(draft_tokens, tokens.gather(1, index))
    parents = selection.candidate_parents(parent_list, num_candidates, topk)
    for b in range(batch):
        chosen = index[b].tolist()
        assert chosen == sorted(set(chosen)) and 0 <= min(chosen) and max(chosen) < num_candidates
        for c in chosen:  # ancestor-closed
            assert parents[b, c] == -1 or int(parents[b, c]) in chosen


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
        settings = EcoSpecSettings(policy=policy, log_interval=0)
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


def test_organize_hook_defers_to_sglang_when_inactive():
    calls = []

    def original(*args):
        calls.append(args)
        return "sglang"

    selection.activate(None)
    assert selection.organize_hook(original, [1], [2], [3], 4) == "sglang"
    selector = make_selector()
    selection.activate(selector)
    try:
        tree = sglang_draft_tree(1, 3, 2, seed=1)
        assert selection.organize_hook(original, *tree, 4)[1].shape == (1, 3)
    finally:
        selection.activate(None)
    assert len(calls) == 1


def spy_on_selection(monkeypatch):
    """Records the keyword arguments of every select_verify_set call the selector makes."""
    calls = []
    real = library_step.select_verify_set

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(library_step, "select_verify_set", spy)
    return calls


def test_auto_eps_is_looked_up_by_batch_size(monkeypatch):
    calls = spy_on_selection(monkeypatch)
    table = eps_table.EpsTable(batches=(1, 2, 4), eps=(0.01, 0.02, 0.5))
    predictor = OnlineExpertPredictor(2, 16, 2, num_buckets=64)
    settings = EcoSpecSettings(eps="auto", profile="qwen3-30b-a3b", hardware="h200")
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


# --- expert parallelism -----------------------------------------------------------------------


def fake_expert_location(physical_to_logical, ep_size, dispatch=None):
    """SGLang's ExpertLocationMetadata for a ``[layers, P]`` physical -> logical map (each
    logical expert's replicas listed by ascending slot, as SGLang lists them)."""
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata

    p2l = torch.tensor(physical_to_logical)
    layers, slots = p2l.shape
    experts = int(p2l.max()) + 1
    l2p = torch.full((layers, experts, slots), -1, dtype=torch.int64)
    for layer in range(layers):
        for logical in range(experts):
            replicas = (p2l[layer] == logical).nonzero().flatten()
            l2p[layer, logical, : replicas.numel()] = replicas
    return ExpertLocationMetadata(
        physical_to_logical_map=p2l,
        physical_to_logical_map_cpu=p2l.clone(),
        logical_to_all_physical_map=l2p,
        logical_to_all_physical_map_cpu=l2p.clone(),
        logical_to_all_physical_map_num_valid=(l2p != -1).sum(-1),
        ep_size=ep_size,
        logical_to_rank_dispatch_physical_map=None if dispatch is None else torch.tensor(dispatch),
    )


def test_placement_is_expert_rank_map_of_sglang_metadata():
    from sgl_ecospec.placement import expert_rank_map

    # 3 layers, 8 logical experts + 4 redundant slots over 3 ranks (4 slots each).
    gen = torch.Generator().manual_seed(0)
    p2l = torch.stack(
        [
            torch.cat([torch.randperm(8, generator=gen), torch.randint(0, 8, (4,), generator=gen)])
            for _ in range(3)
        ]
    )
    # This rank's dispatch choice: the last replica of each logical expert.
    dispatch = torch.stack(
        [
            torch.tensor([int((p2l[layer] == e).nonzero().max()) for e in range(8)])
            for layer in range(3)
        ]
    )
    metadata = fake_expert_location(p2l.tolist(), 3, dispatch.tolist())
    moe_layers = [0, 2]
    for owns_batch, slots in [
        (True, dispatch[moe_layers]),
        (False, metadata.logical_to_all_physical_map[moe_layers, :, 0]),
    ]:
        layout = ep_placement.EPLayout(ep_size=3, metadata=metadata, owns_batch=owns_batch)
        placement = ep_placement.ExpertPlacement(layout, moe_layers, 8, "cpu")
        assert placement.num_ranks == 3
        assert torch.equal(placement.expert_rank, expert_rank_map(slots, 12, 3))
    # The two maps differ here, so the rule matters.
    assert not torch.equal(
        dispatch[moe_layers], metadata.logical_to_all_physical_map[moe_layers, :, 0]
    )
    # Dynamic dispatch (no per-rank map): the first replica even for a batch of its own.
    dynamic = fake_expert_location(p2l.tolist(), 3)
    layout = ep_placement.EPLayout(ep_size=3, metadata=dynamic, owns_batch=True)
    placement = ep_placement.ExpertPlacement(layout, moe_layers, 8, "cpu")
    want = expert_rank_map(dynamic.logical_to_all_physical_map[moe_layers, :, 0], 12, 3)
    assert torch.equal(placement.expert_rank, want)
    # No metadata: SGLang's plain layout, expert e in slot e.
    plain = ep_placement.ExpertPlacement(ep_placement.EPLayout(ep_size=4), [1, 3], 8, "cpu")
    assert plain.expert_rank.tolist() == [[0, 0, 1, 1, 2, 2, 3, 3]] * 2


@pytest.mark.parametrize(
    "layout, layers, experts, message",
    [
        (ep_placement.EPLayout(ep_size=1), [0], 8, "needs ep_size > 1"),
        (ep_placement.EPLayout(ep_size=3), [0], 8, "do not split over ep_size 3"),
        ("metadata", [0], 16, "8 logical experts per layer, the predictor 16"),
        ("metadata", [0, 5], 8, "MoE layer 5 is outside"),
    ],
)
def test_placement_rejects_metadata_of_another_model(layout, layers, experts, message):
    if layout == "metadata":
        metadata = fake_expert_location([list(range(8))] * 2, 2)
        layout = ep_placement.EPLayout(ep_size=2, metadata=metadata)
    with pytest.raises(ValueError, match=message):
        ep_placement.ExpertPlacement(layout, layers, experts, "cpu")


def test_ep_cost_follows_the_busiest_rank_and_eplb_updates(monkeypatch):
    calls = spy_on_selection(monkeypatch)
    # Target layer 1 is the one MoE layer; 8 experts on 2 ranks (slots 0-3 on rank 0).
    # Layer 0 puts every expert elsewhere, so reading the wrong layer changes the answer.
    metadata = fake_expert_location([[4, 5, 6, 7, 0, 1, 2, 3], list(range(8))], 2)
    layout = ep_placement.EPLayout(ep_size=2, metadata=metadata)
    predictor = OnlineExpertPredictor(1, 8, 2, num_buckets=1 << 16)
    # Root (token 1) uses {0, 1}: rank 0 holds 2 experts, rank 1 none. Token 10 (P 0.55)
    # needs {0, 2}: adds expert 2 to rank 0, the busiest rank rises by 1. Token 11 (P 0.45)
    # needs {1, 5}: adds expert 5 to rank 1, the busiest rank stays at 2.
    predictor.observe(torch.tensor([1, 10, 11]), torch.tensor([[[0, 1]], [[0, 2]], [[1, 5]]]))
    score_list = [torch.tensor([[[0.55, 0.45]]])]
    token_list = [torch.tensor([[10, 11]])]
    parents_list = [torch.tensor([[-1, 0, 1]])]

    def choose(selector):
        selector.set_roots(torch.tensor([1]))
        return selector.organize(score_list, token_list, parents_list, 2)[2].tolist()

    def make(settings, placement=None):
        return selection.EcoSpecSelector(
            settings,
            predictor,
            topk=2,
            num_draft_tokens=2,
            max_batch=2,
            device="cpu",
            placement=placement,
        )

    settings = EcoSpecSettings(log_interval=0)
    assert choose(make(settings)) == [[10]]  # both add one expert: the higher P wins
    placement = ep_placement.ExpertPlacement(layout, [1], 8, "cpu")
    selector = make(settings, placement)
    assert choose(selector) == [[11]]  # 0.45 / (0.5 + eps) beats 0.55 / (1 + eps)
    call = calls[-1]
    assert call["expert_rank"] is placement.expert_rank and call["num_ranks"] == 2
    assert call["total_weight"] is None  # the op's default, 1 / R
    assert placement.expert_rank.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
    # total_weight from the settings reaches the op: 1 prices every added expert alike.
    flat = make(EcoSpecSettings(log_interval=0, total_weight=1.0), placement)
    assert choose(flat) == [[10]] and calls[-1]["total_weight"] == 1.0

    # EPLB swaps experts 2 and 5 in layer 1 (SGLang's in-place update, through our hook).
    ep_placement.install_hook()
    ep_placement.activate(placement)
    try:
        buffer = placement.expert_rank.data_ptr()
        moved = fake_expert_location([[4, 5, 6, 7, 0, 1, 2, 3], [0, 1, 5, 3, 4, 2, 6, 7]], 2)
        metadata.update(moved, update_layer_ids=[1])
        assert placement.expert_rank.data_ptr() == buffer  # graphs keep reading it
        assert placement.expert_rank.tolist() == [[0, 0, 1, 0, 1, 0, 1, 1]]
        assert choose(selector) == [[10]]  # expert 2 is now free on the idle rank
    finally:
        ep_placement.activate(None)


def test_runtime_builds_ep_placement_and_cost_model_eps():
    from sglang_ecospec import algorithm
    from transformers import Qwen2MoeConfig

    from sgl_ecospec.costmodel import (
        PerformanceModel,
        analytic_params,
        get_hardware,
        get_model,
        selection_cost,
    )

    # Qwen3-30B-A3B's MoE shape (48 layers x 128 experts, top-8), EP 2 without metadata.
    config = Qwen2MoeConfig(num_hidden_layers=48, num_experts=128, num_experts_per_tok=8)
    settings = EcoSpecSettings(
        eps="auto", profile="qwen3-30b-a3b", hardware="2xh200", num_buckets=64, log_interval=0
    )
    runtime = algorithm.EcoSpecRuntime(
        settings,
        config,
        topk=4,
        num_draft_tokens=6,
        max_batch=40,
        device="cpu",
        ep_layout=ep_placement.EPLayout(ep_size=2),
    )
    try:
        placement = runtime.selector.placement
        assert placement is runtime.placement and ep_placement.active() is placement
        assert placement.expert_rank.shape == (48, 128) and placement.num_ranks == 2
        assert torch.equal(placement.expert_rank, (torch.arange(128) // 64).expand(48, -1))
        table = runtime.selector.eps_table
        assert table.batches == (1, 2, 4, 8, 16, 32, 40)
        model, hardware = get_model("qwen3-30b-a3b"), get_hardware("2xh200")
        perf = PerformanceModel(model, hardware, analytic_params(model, hardware).params)
        for batch, eps in zip(table.batches, table.eps, strict=True):
            assert eps == selection_cost(perf, batch, 6, layers=48, ep_size=2).eps
        assert runtime.selector.eps_for(39) == table.eps[-2]
    finally:
        runtime.close()
    assert ep_placement.active() is None and selection.active() is None
    # ep_cost=false: no placement even under EP.
    off = algorithm.EcoSpecRuntime(
        EcoSpecSettings(ep_cost=False, num_buckets=64, log_interval=0),
        config,
        topk=4,
        num_draft_tokens=6,
        max_batch=4,
        device="cpu",
        ep_layout=ep_placement.EPLayout(ep_size=2),
    )
    off.close()
    assert off.selector.placement is None and off.selector.eps_for(4) == 0.1


@pytest.mark.parametrize(
    "profile, hardware, ep_size, message",
    [
        ("qwen3-235b-a22b", "h200", 1, "'qwen3-235b-a22b' has 94 MoE layers x 128 experts"),
        ("qwen3-30b-a3b", "4xh200", 8, "smaller than the EP group of 8 ranks: .* 8x4xh200"),
    ],
)
def test_cost_model_eps_rejects_another_model_or_too_few_gpus(profile, hardware, ep_size, message):
    with pytest.raises(ValueError, match=message):
        eps_table.cost_model_eps_table(
            profile,
            hardware,
            moe_layers=48,
            num_experts=128,
            top_k=8,
            verify_tokens=4,
            max_batch=8,
            ep_size=ep_size,
        )


# --- routing --------------------------------------------------------------------------------


def test_moe_layout_of_known_configs():
    from transformers import Qwen2MoeConfig

    qwen = Qwen2MoeConfig(
        num_hidden_layers=6,
        num_experts=64,
        num_experts_per_tok=4,
        mlp_only_layers=[1],
        decoder_sparse_step=1,
    )
    assert routing.moe_layout(qwen) == ([0, 2, 3, 4, 5], 64, 4)
    deepseek = SimpleNamespace(
        num_hidden_layers=5,
        n_routed_experts=256,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        moe_layer_freq=1,
    )
    assert routing.moe_layout(deepseek) == ([3, 4], 256, 8)
    with pytest.raises(ValueError, match="Mixture-of-Experts"):
        routing.moe_layout(SimpleNamespace(num_hidden_layers=2))


def test_capture_hook_writes_moe_layers_and_honors_the_opt_out():
    capture = routing.RoutingCapture([0, 2], top_k=2, max_tokens=4, device="cpu")
    routing.activate(capture)
    try:
        target = SimpleNamespace(allow_routed_experts_capture=True)
        draft = SimpleNamespace(allow_routed_experts_capture=False)
        ids = torch.tensor([[1, 2, 9], [3, 4, 9], [5, 6, 9], [7, 8, 9], [0, 0, 9]])
        assert routing.after_capture("r", target, 2, ids) == "r"
        routing.after_capture(None, target, 1, ids + 100)  # not a MoE layer
        routing.after_capture(None, draft, 0, ids + 100)  # draft model opted out
    finally:
        routing.activate(None)
    # Five tokens, four rows: the first four are kept; the extra (shared) column dropped.
    assert capture.verify_routing(4)[:, 1].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    assert capture.verify_routing(4)[:, 0].eq(0).all()
    assert capture.captures == 1
    with pytest.raises(ValueError, match="exceed"):
        capture.verify_routing(5)


def test_verify_stats_union_and_recall():
    predictor = OnlineExpertPredictor(1, 8, 2, num_buckets=1 << 16)
    predictor.observe(torch.tensor([5]), torch.tensor([[[1, 2]]]))
    stats = routing.VerifyStats(8, "cpu")
    window = stats.window()
    assert window.read() is None  # no verify step yet
    # Tokens 5 and 6 routed to {1, 2} and {2, 3}: union 3 experts; recall: token 5 fully
    # predicted (2/2), token 6 (unseen, prior says {1, 2} or similar) at least 1/2 of {2, 3}.
    tokens, route = torch.tensor([5, 6]), torch.tensor([[[1, 2]], [[2, 3]]])
    stats.update(route, predictor.predict_topk(tokens))
    summary = window.read()
    assert summary["unique_experts_per_layer"] == 3.0 and summary["verify_steps"] == 1
    assert 0.75 <= summary["predictor_recall"] <= 1.0
    assert summary["verify_tokens_per_step"] == 2.0
    assert window.pending_steps == 0 and window.read() is None


def test_stats_windows_read_their_own_intervals():
    predictor = OnlineExpertPredictor(2, 8, 1, num_buckets=64)
    stats = routing.VerifyStats(8, "cpu")
    early, late = stats.window(), stats.window()
    # Step 1: 1 token, experts {0} and {1} -> 1 unique per layer. Step 2: 3 tokens, layer 0
    # {0, 1, 2}, layer 1 {3, 3, 3} -> (3 + 1) / 2 = 2. Step 3: 2 tokens, 2 per layer -> 2.
    steps = [
        [[[0], [1]]],
        [[[0], [3]], [[1], [3]], [[2], [3]]],
        [[[4], [5]], [[6], [7]]],
    ]
    for i, routes in enumerate(steps):
        route = torch.tensor(routes)
        stats.update(route, predictor.predict_topk(torch.arange(route.shape[0]) + 10 * i))
        if i == 0:
            first = early.read()
    assert first["unique_experts_per_layer"] == 1.0 and first["verify_tokens_per_step"] == 1
    rest = early.read()
    assert rest["verify_steps"] == 2 and rest["unique_experts_per_layer"] == 2.0
    assert rest["verify_tokens_per_step"] == 2.5
    whole = late.read()  # the other reader still sees all three steps
    assert whole["verify_steps"] == 3 and whole["verify_tokens_per_step"] == 2.0
    assert whole["unique_experts_per_layer"] == pytest.approx(5 / 3)
    assert 0.0 <= whole["predictor_recall"] <= 1.0


# --- observability: SGLang's decode log line and Prometheus ------------------------------


LABELS = {"model_name": "tiny", "tp_rank": 0}


def sample(registry, name):
    """A series' value as /metrics shows it (label values are strings there)."""
    return registry.get_sample_value(name, {key: str(value) for key, value in LABELS.items()})


def fake_reporter(*, tick, metrics_enabled=True, accepted=9, forwards=4):
    """What report_decode_stats_hook reads of SGLang's SchedulerMetricsReporter."""
    return SimpleNamespace(
        decode_log_interval=2,
        forward_ct_decode=4 if tick else 5,
        is_stats_logging_rank=True,
        current_scheduler_metrics_enabled=metrics_enabled,
        spec_num_accept_tokens=accepted,
        spec_num_forward_ct=forwards,
        metrics_collector=SimpleNamespace(labels=LABELS) if metrics_enabled else None,
    )


def sglang_decode_line(reporter):
    """Stands in for SGLang's report_decode_stats: logs its line on its logger, resets its
    acceptance counters."""
    logging.getLogger(metrics.DECODE_LOGGER).info(
        "Decode batch, #running-req: 1, accept len: %.2f, #queue-req: 0"
        % (reporter.spec_num_accept_tokens / reporter.spec_num_forward_ct)
    )
    reporter.spec_num_accept_tokens = reporter.spec_num_forward_ct = 0
    return "reported"


@pytest.fixture
def decode_line_stats(monkeypatch):
    """An active window with two verify steps (unique experts 2 and 3, recall known), and a
    private Prometheus registry for EcoSpec's series."""
    from prometheus_client import CollectorRegistry

    metrics.install_hook()
    registry = CollectorRegistry()
    series = metrics.EcoSpecMetrics(LABELS, registry=registry)
    monkeypatch.setattr(metrics, "_metrics", series)
    predictor = OnlineExpertPredictor(1, 8, 2, num_buckets=64)
    stats = routing.VerifyStats(8, "cpu")
    window, reference = stats.window(), stats.window()
    stats.update(torch.tensor([[[0, 1]], [[1, 0]]]), predictor.predict_topk(torch.tensor([1, 2])))
    stats.update(torch.tensor([[[2, 5]]]), predictor.predict_topk(torch.tensor([3])))
    metrics.activate(window)
    try:
        yield window, registry, reference.read()
    finally:
        metrics.activate(None)


def test_decode_log_line_carries_ecospec_fields_and_metrics_update(decode_line_stats, caplog):
    window, registry, expected = decode_line_stats
    assert expected["unique_experts_per_layer"] == 2.0 and expected["verify_steps"] == 2
    reporter = fake_reporter(tick=True)
    with caplog.at_level(logging.INFO, logger=metrics.DECODE_LOGGER):
        assert metrics.report_decode_stats_hook(sglang_decode_line, reporter) == "reported"
    (line,) = [r.getMessage() for r in caplog.records if r.name == metrics.DECODE_LOGGER]
    recall = expected["predictor_recall"]
    assert line == (
        "Decode batch, #running-req: 1, accept len: 2.25, #queue-req: 0, "
        f"ecospec experts/layer/step: 2.00, predictor recall: {recall:.3f}"
    )
    assert sample(registry, "sglang:ecospec_unique_experts_per_layer_step") == 2.0
    assert sample(registry, "sglang:ecospec_predictor_recall") == pytest.approx(recall)
    # SGLang's acceptance counters over the same window: 9 tokens / 4 request-steps.
    assert sample(registry, "sglang:ecospec_accept_length") == 2.25
    assert sample(registry, "sglang:ecospec_verify_tokens_per_step") == 1.5
    assert sample(registry, "sglang:ecospec_verify_steps_total") == 2
    assert window.pending_steps == 0
    # Other records of that logger pass unchanged.
    with caplog.at_level(logging.INFO, logger=metrics.DECODE_LOGGER):
        logging.getLogger(metrics.DECODE_LOGGER).info("Prefill batch, #new-seq: 1")
    assert caplog.records[-1].getMessage() == "Prefill batch, #new-seq: 1"


def test_decode_log_hook_reads_nothing_between_log_lines(decode_line_stats, caplog):
    window, registry, _ = decode_line_stats
    calls = []
    with caplog.at_level(logging.INFO, logger=metrics.DECODE_LOGGER):
        # Not a log tick: SGLang's method only, the window is not read (no host sync).
        metrics.report_decode_stats_hook(lambda r: calls.append(r), fake_reporter(tick=False))
        assert len(calls) == 1 and window.pending_steps == 2
        # A log tick without --enable-metrics: fields in the line, no series touched.
        reporter = fake_reporter(tick=True, metrics_enabled=False)
        metrics.report_decode_stats_hook(sglang_decode_line, reporter)
    assert "ecospec experts/layer/step: 2.00" in caplog.records[-1].getMessage()
    assert sample(registry, "sglang:ecospec_verify_steps_total") == 0
    # No ECOSPEC worker in the process (EAGLE3 and the rest): SGLang's line unchanged.
    metrics.activate(None)
    with caplog.at_level(logging.INFO, logger=metrics.DECODE_LOGGER):
        metrics.report_decode_stats_hook(sglang_decode_line, fake_reporter(tick=True))
    assert caplog.records[-1].getMessage().endswith("#queue-req: 0")


def test_report_hook_is_applied_to_sglang_reporter():
    from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter

    metrics.install_hook()
    method = SchedulerMetricsReporter.report_decode_stats
    assert hasattr(method, "__wrapped__") and method.__name__ == "report_decode_stats"
    assert metrics.window_accept_length(SimpleNamespace(spec_num_forward_ct=0)) is None


def test_metrics_are_multiprocess_safe(tmp_path):
    """In Prometheus' multiprocess mode (SGLang's) a scheduler process writes the series to
    PROMETHEUS_MULTIPROC_DIR and the HTTP server aggregates them: two records in a child
    process, read back the way /metrics reads them."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    child = (
        "from sglang_ecospec.metrics import EcoSpecMetrics\n"
        "m = EcoSpecMetrics({'model_name': 'tiny', 'tp_rank': 0})\n"
        "m.record({'unique_experts_per_layer': 6.5, 'predictor_recall': 0.5, "
        "'verify_tokens_per_step': 12.0, 'verify_steps': 3}, 2.0)\n"
        "m.record({'unique_experts_per_layer': 5.25, 'predictor_recall': 0.75, "
        "'verify_tokens_per_step': 10.0, 'verify_steps': 4}, None)\n"
    )
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    subprocess.run([sys.executable, "-c", child], env=env, check=True, timeout=120)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(tmp_path))
    text = generate_latest(registry).decode()
    assert sample(registry, "sglang:ecospec_unique_experts_per_layer_step") == 5.25  # latest
    assert sample(registry, "sglang:ecospec_predictor_recall") == 0.75
    assert sample(registry, "sglang:ecospec_accept_length") == 2.0  # the 2nd record had none
    assert sample(registry, "sglang:ecospec_verify_steps_total") == 7
    assert 'sglang:ecospec_verify_tokens_per_step{model_name="tiny",tp_rank="0"} 10.0' in text


# --- registration ---------------------------------------------------------------------------


def test_entry_point_is_installed():
    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("ecospec") == "sglang_ecospec:register"


def test_ecospec_is_a_registered_eagle3_like_algorithm():
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang_ecospec import algorithm

    algorithm.register_algorithm()
    algorithm.register_algorithm()  # idempotent
    algo = SpeculativeAlgorithm.from_string("ecospec")
    assert isinstance(algo, algorithm.EcoSpecAlgo) and algo.name == "ECOSPEC"
    eagle3 = SpeculativeAlgorithm.EAGLE3
    for method in [
        name for name in vars(SpeculativeAlgorithm) if name.startswith(("is_", "supports_"))
    ] + [
        "need_topk",
        "carries_draft_hidden_states",
        "has_draft_kv",
    ]:
        assert getattr(algo, method)() == getattr(eagle3, method)(), method


def test_validate_server_args_reports_bad_settings(monkeypatch):
    from sglang_ecospec import algorithm

    args = SimpleNamespace(speculative_draft_model_path="/d", speculative_eagle_topk=4, ep_size=8)
    algorithm.validate_server_args(args)
    monkeypatch.setenv("SGLANG_ECOSPEC_EPS", "-1")
    with pytest.raises(ValueError, match="ECOSPEC: eps must be"):
        algorithm.validate_server_args(args)
    monkeypatch.setenv("SGLANG_ECOSPEC_EPS", "auto")
    monkeypatch.setenv("SGLANG_ECOSPEC_PROFILE", "qwen3-235b-a22b")
    monkeypatch.setenv("SGLANG_ECOSPEC_HARDWARE", "h200")
    with pytest.raises(ValueError, match="HARDWARE: .*EP group of 8 ranks"):
        algorithm.validate_server_args(args)
    monkeypatch.setenv("SGLANG_ECOSPEC_HARDWARE", "8xh200")
    algorithm.validate_server_args(args)
    for name in ("EPS", "PROFILE", "HARDWARE"):
        monkeypatch.delenv(f"SGLANG_ECOSPEC_{name}")
    with pytest.raises(ValueError, match="speculative-draft-model-path"):
        algorithm.validate_server_args(
            SimpleNamespace(speculative_draft_model_path=None, speculative_eagle_topk=4, ep_size=1)
        )


def test_costmodel_adaptive_config_loads_in_sglang(tmp_path, capsys):
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    from sgl_ecospec.costmodel import (
        PerformanceModel,
        adaptive_draft_steps,
        analytic_params,
        get_hardware,
        get_model,
    )
    from sgl_ecospec.lab import cli

    config, report = tmp_path / "adaptive.json", tmp_path / "report.json"
    argv = ["costmodel", "--batch", "1,16,128", "--gamma", "2", "--accept-rate", "0.8"]
    argv += ["--adaptive-config", str(config), "--max-draft-steps", "5", "--json", str(report)]
    assert cli.main(argv) == 0
    model, hardware = get_model("qwen3-235b-a22b"), get_hardware("h200")
    perf = PerformanceModel(model, hardware, analytic_params(model, hardware).params)
    steps = adaptive_draft_steps(perf, [1, 16, 128], 0.8, 5)
    buckets = json.loads(report.read_text())["adaptive"]["buckets"]
    assert [(b["batch"], b["draft_steps"], b["num_draft_tokens"]) for b in buckets] == [
        (batch, k, k + 1) for batch, k in sorted(steps.items())
    ]
    out = capsys.readouterr().out
    for batch, k in steps.items():
        assert f"{batch:>6d} {k:>12d} {k + 1:>17d}" in out
    params = AdaptiveSpeculativeParams(initial_steps=0, cfg_path=str(config))
    for batch, k in steps.items():  # SGLang routes each bucket to its own candidate steps
        assert params._route(batch).candidate_steps == list(range(k + 1))
    assert cli.main(["costmodel", "--adaptive-config", str(config), "--max-draft-steps", "0"]) == 2
    assert "--max-draft-steps must be an int >= 1" in capsys.readouterr().err


def test_compat_hook_shares_embed_and_head_of_targets_without_the_method():
    from sglang_ecospec import compat

    embed, head = torch.nn.Embedding(4, 2), torch.nn.Linear(2, 4)
    target = SimpleNamespace(model=SimpleNamespace(embed_tokens=embed), lm_head=head)
    got = compat.resolve_target_embed_and_head(lambda *a, **k: "sglang", target)
    assert got[0] is embed.weight and got[1] is head.weight
    with_method = SimpleNamespace(get_embed_and_head=lambda: None)
    assert compat.resolve_target_embed_and_head(lambda *a, **k: "sglang", with_method) == "sglang"


# --- CPU development mode -------------------------------------------------------------------


def test_cpu_mode_is_off_without_the_cpu_engine(monkeypatch):
    import sglang_ecospec_cpu as cpu_dev

    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    assert not cpu_dev.is_cpu_dev_mode() and not cpu_dev.enable_if_cpu()
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert cpu_dev.is_cpu_dev_mode() == (not torch.cuda.is_available())


def test_tree_mask_mode_follows_the_attention_backend():
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode
    from sglang_ecospec_cpu import mask_mode_for_backend

    assert mask_mode_for_backend("triton") == TreeMaskMode.FULL_MASK
    assert mask_mode_for_backend("torch_native") == TreeMaskMode.FULL_MASK
    assert mask_mode_for_backend("intel_amx") == TreeMaskMode.QLEN_ONLY
    assert (ops.FULL_MASK, ops.QLEN_ONLY) == (TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY)


def test_ops_register_into_the_sgl_kernel_namespace():
    ops.register_ops()
    assert set(ops.SCHEMAS) <= {name for name in ops.SCHEMAS if ops._op_exists(name)}
    assert ops.register_ops() == []  # idempotent
    bonus = torch.zeros(2, dtype=torch.int32)
    accept = torch.tensor([[7, 8, 9], [4, 5, 6]], dtype=torch.int32)
    torch.ops.sgl_kernel.fill_bonus_tokens_cpu(
        accept, torch.tensor([2, 3], dtype=torch.int32), bonus, 3
    )
    assert bonus.tolist() == [8, 6]


def build_tree(parent_list, selected, seq_lens, topk, depth, ndt, mode):
    batch = parent_list.shape[0]
    if mode == ops.QLEN_ONLY:
        mask = torch.zeros(batch * ndt * ndt, dtype=torch.bool)
    else:
        mask = torch.ones(int(seq_lens.sum()) * ndt + batch * ndt * ndt, dtype=torch.bool)
    positions = torch.zeros(batch * ndt, dtype=torch.int64)
    index = torch.zeros(batch, ndt, dtype=torch.int64)
    child = torch.full((batch, ndt), -1, dtype=torch.int64)
    sibling = torch.full((batch, ndt), -1, dtype=torch.int64)
    ops.build_tree_kernel_efficient(
        parent_list,
        selected,
        seq_lens,
        mask,
        positions,
        index,
        child,
        sibling,
        topk,
        depth,
        ndt,
        mode,
    )
    return mask, positions, index, child, sibling


# topk 2, depth 3: candidates 0, 1 (children of the root), 2..5 (children of parent_list[1],
# parent_list[2] = candidates 0, 1), 6..9 (children of parent_list[3], parent_list[4] = 3, 4).
PARENT_LIST = torch.tensor([[-1, 0, 1, 3, 4]])
SELECTED = torch.tensor([[0, 1, 3, 6, 7]])  # nodes 1..5; node 3 (cand 3) under node 1 (cand 0)


def test_build_tree_links_positions_and_masks():
    mask, positions, index, child, sibling = build_tree(
        PARENT_LIST, SELECTED, torch.tensor([10]), 2, 3, 6, ops.QLEN_ONLY
    )
    # Tree: root 0 -> {1, 2}; 1 -> {3}; 3 -> {4, 5}.
    assert child.tolist() == [[1, 3, -1, 4, -1, -1]]
    assert sibling.tolist() == [[-1, 2, -1, -1, 5, -1]]
    assert positions.tolist() == [10, 11, 11, 12, 13, 13]
    assert index.tolist() == [[0, 1, 2, 3, 4, 5]]
    m = mask.view(6, 6).int().tolist()
    assert m[4] == [1, 1, 0, 1, 1, 0] and m[2] == [1, 0, 1, 0, 0, 0]
    full, *_ = build_tree(PARENT_LIST, SELECTED, torch.tensor([3]), 2, 3, 6, ops.FULL_MASK)
    block = full.view(6, 3 + 6)
    assert block[:, :3].all() and torch.equal(block[:, 3:], mask.view(6, 6))


def test_reconstruct_indices_from_mask_inverts_build_tree():
    mask, positions, index, child, sibling = build_tree(
        PARENT_LIST.repeat(2, 1),
        SELECTED.repeat(2, 1),
        torch.tensor([4, 9]),
        2,
        3,
        6,
        ops.QLEN_ONLY,
    )
    rec_pos = torch.zeros(12, dtype=torch.int64)
    rec = [torch.zeros(2, 6, dtype=torch.int64) for _ in range(3)]
    ops.reconstruct_indices_from_tree_mask(mask, torch.tensor([4, 9]), rec_pos, *rec, 2, 6)
    assert torch.equal(rec_pos, positions)
    assert (
        torch.equal(rec[0], index) and torch.equal(rec[1], child) and torch.equal(rec[2], sibling)
    )


def test_verify_tree_greedy_walks_the_matching_path():
    _, _, index, child, sibling = build_tree(
        PARENT_LIST, SELECTED, torch.tensor([10]), 2, 3, 6, ops.QLEN_ONLY
    )
    candidates = torch.tensor([[100, 21, 22, 31, 41, 42]])
    # Target argmax per node: at root 21 (-> node 1), at node 1 31 (-> node 3), at node 3 42
    # (-> node 5), at node 5 77 (the bonus token).
    target = torch.tensor([[21, 31, 0, 42, 0, 77]])
    predicts = torch.zeros(6, dtype=torch.int32)
    accept = torch.full((1, 4), -1, dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int32)
    ops.verify_tree_greedy(predicts, accept, count, candidates, index, child, sibling, target)
    assert accept.tolist() == [[0, 1, 3, 5]] and count.tolist() == [3]
    assert predicts.tolist() == [21, 31, 0, 42, 0, 77]
    target[0, 0] = 999  # nothing matches at the root: only the bonus token
    accept.fill_(-1)
    ops.verify_tree_greedy(predicts, accept, count, candidates, index, child, sibling, target)
    assert accept.tolist() == [[0, -1, -1, -1]] and count.tolist() == [0]


def test_cache_location_ops():
    req_to_token = torch.arange(40, dtype=torch.int32).view(4, 10)
    rpi, start, end = torch.tensor([2, 0]), torch.tensor([1, 7]), torch.tensor([3, 10])
    out = torch.zeros(5, dtype=torch.int64)
    ops.assign_extend_cache_locs(rpi, req_to_token, start, end, out, 10)
    assert out.tolist() == [21, 22, 7, 8, 9]
    ops.assign_req_to_token_pool(rpi, req_to_token, start, end, torch.arange(100, 105), 10)
    assert req_to_token[2, 1:3].tolist() == [100, 101] and req_to_token[0, 7:].tolist() == [
        102,
        103,
        104,
    ]
    draft = torch.zeros(2 * 2 * 2, dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous(
        torch.tensor([1, 3]), req_to_token, torch.tensor([4, 5]), draft, 10, 2, 2
    )
    assert draft.tolist() == [14, 15, 16, 17, 35, 36, 37, 38]
    accepted = torch.zeros(3, dtype=torch.int64)
    ops.fill_accept_out_cache_loc(
        torch.tensor([[0, 2, -1], [4, -1, -1]], dtype=torch.int32),
        torch.tensor([50, 51, 52, 53, 54, 55]),
        accepted,
    )
    assert accepted.tolist() == [50, 52, 54]
    meta = ops.build_draft_decode_metadata(
        req_to_token, torch.tensor([1]), torch.tensor([2]), 2, 2, 10
    )
    assert meta[:, :4].tolist() == [[10, 11, 12, 13], [10, 11, 14, 15]]


def test_rotate_input_ids():
    ids = torch.tensor([1, 2, 3, 4, 5])
    ops.rotate_input_ids(
        ids, torch.tensor([0, 3]), torch.tensor([3, 2]), torch.tensor([9, 8]), None
    )
    assert ids.tolist() == [2, 3, 9, 5, 8]


def test_copy_all_layer_kv_cache_moves_slots_of_every_buffer():
    buffers = [torch.arange(24, dtype=torch.float32).view(6, 4), torch.arange(12.0).view(6, 2)]
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers])
    expected = [b.clone() for b in buffers]
    for b in expected:
        b[[0, 1]] = b[[1, 5]].clone()
    ops.copy_all_layer_kv_cache(data_ptrs, strides, torch.tensor([0, 1]), torch.tensor([1, 5]))
    for got, want in zip(buffers, expected, strict=True):
        assert torch.equal(got, want)


def test_tiny_target_spec_round_trip(tmp_path):
    from sglang_ecospec_cpu import tiny

    spec = tiny.TinyTargetSpec()
    ids = tiny.output_ids(spec)
    assert ids.numel() == spec.output_vocab and math.isclose(spec.copy_weight, 0.0)
    (tmp_path / tiny.MARKER).write_text(json.dumps({"kind": "target", **spec.__dict__}))
    assert tiny.target_spec_of(tmp_path) == spec


def test_runtime_learns_from_the_verify_routing_and_logs_statistics():
    from sglang_ecospec import algorithm
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    settings = EcoSpecSettings(log_interval=1, num_buckets=1 << 12)
    runtime = algorithm.EcoSpecRuntime(
        settings, config, topk=2, num_draft_tokens=3, max_batch=2, device="cpu"
    )
    try:
        assert selection.active() is runtime.selector and routing.active() is runtime.capture
        assert metrics.active() is runtime.decode_log_window
        runtime.before_decode(
            SimpleNamespace(is_draft_input=lambda: True, bonus_tokens=torch.tensor([4, 5]))
        )
        assert runtime.selector.root_valid.tolist() == [True, True]
        # The verify forward of 2 requests x 3 tokens routes token t to experts {t%8, (t+1)%8}.
        tokens = torch.tensor([4, 9, 10, 5, 11, 12])
        ids = torch.stack([tokens % 8, (tokens + 1) % 8], 1)
        topk_config = SimpleNamespace(allow_routed_experts_capture=True)
        for layer in (0, 1):
            routing.after_capture(None, topk_config, layer, ids)
        runtime.after_verify(SimpleNamespace(draft_token=tokens))
        predicted = runtime.predictor.predict_topk(tokens)  # learnt: exact routing
        assert torch.equal(
            predicted.sort(-1).values, ids.sort(-1).values[:, None].expand(-1, 2, -1)
        )
        (summary,) = runtime.summaries
        assert summary["verify_tokens_per_step"] == 6.0
        assert summary["unique_experts_per_layer"] == 6.0  # experts 1..6
        # The decode log line's window is separate: it still holds the step.
        assert runtime.decode_log_window.read() == summary
    finally:
        runtime.close()
    assert selection.active() is None and routing.active() is None and metrics.active() is None


# --- a trained head as the predictor --------------------------------------------------------


def draft_tree_through_hooks(batch, topk, steps, hidden_size, seed=0, vocab=50):
    """As ``sglang_draft_tree``, but through the plugin's select hook, with distinct draft
    states: the root's of request b is b, beam row r's after step i is 100 * (i + 1) + r.
    Returns the tree lists and the state that proposed each candidate ``[B, N]``."""
    from sglang.srt.speculative.spec_utils import select_top_k_tokens

    # SGLang's own function, not the hooked one a runtime installs in the process.
    original = getattr(select_top_k_tokens, "__wrapped__", select_top_k_tokens)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.arange(batch).float()[:, None].expand(-1, hidden_size)
    scores, lists, proposers = None, ([], [], []), []
    for i in range(steps):
        rows = hidden.shape[0]
        probs = torch.rand(rows, vocab, generator=gen).pow(6)
        topk_p, topk_index = (probs / probs.sum(-1, keepdim=True)).topk(topk, dim=-1)
        proposers.append(hidden[:, 0].view(batch, -1).repeat_interleave(topk, 1))
        _, hidden, scores, info = selection.select_hook(
            original, i, topk_p, topk_index, hidden, scores, topk
        )
        for store, item in zip(lists, info, strict=True):
            store.append(item)
        hidden = (100.0 * (i + 1) + torch.arange(batch * topk).float())[:, None]
        hidden = hidden.expand(-1, hidden_size)
    return lists, torch.cat(proposers, 1)


class StateEchoPredictor(OnlineExpertPredictor):
    """Needs draft states; predicts experts from the first state value, and records it."""

    needs_hidden = True
    hidden_size = 3

    def predict_topk(self, token_ids, hidden=None, *, validate=False):
        self.seen = hidden[:, 0].clone()
        first = hidden[:, 0].long()
        offsets = torch.arange(self.top_k)
        ids = (first[:, None] + offsets) % self.num_experts  # [T, K]
        return ids[:, None].expand(-1, self.num_layers, -1)


def test_head_gets_the_draft_state_that_proposed_each_candidate():
    batch, topk, steps, ndt = 2, 3, 3, 5
    predictor = StateEchoPredictor(2, 16, 2, num_buckets=64)
    settings = EcoSpecSettings(policy="confidence", log_interval=0)
    selector = selection.EcoSpecSelector(
        settings, predictor, topk=topk, num_draft_tokens=ndt, max_batch=4, device="cpu"
    )
    selection.activate(selector)
    try:
        selector.set_roots(torch.tensor([7, 8]))
        lists, proposers = draft_tree_through_hooks(batch, topk, steps, 3)
        _, index, _ = selection.organize_hook(None, *lists, ndt)
    finally:
        selection.activate(None)
    # One predict_topk call over the root-first rows: each request's root reads its own
    # state (0 and 1); check the candidates' through the recorded verify rows.
    assert predictor.seen.view(batch, -1)[:, 0].tolist() == [0.0, 1.0]
    chosen = proposers.gather(1, index)  # [B, D - 1]: the state behind each chosen node
    rows = selector.verify_topk[: batch * ndt].view(batch, ndt, 2, 2)
    assert rows[:, 0, 0, 0].tolist() == [0, 1]  # roots
    assert torch.equal(rows[:, 1:, 0, 0].long(), chosen.long() % 16)


def test_runtime_serves_a_trained_head_frozen(tmp_path):
    from sglang_ecospec import algorithm
    from transformers import Qwen2MoeConfig

    from sgl_ecospec.predictors import LowRankExpertHead

    config = Qwen2MoeConfig(
        hidden_size=16, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2
    )
    head = LowRankExpertHead(16, 2, 8, 2, rank=4, token_buckets=32)
    path = tmp_path / "head.pt"
    head.save(path)
    with pytest.raises(EcoSpecSettingsError, match="predictor 'head' needs predictor_file"):
        EcoSpecSettings(predictor="head")
    settings = EcoSpecSettings(predictor="head", predictor_file=str(path), log_interval=1)
    runtime = algorithm.EcoSpecRuntime(
        settings, config, topk=2, num_draft_tokens=3, max_batch=2, device="cpu"
    )
    try:
        assert isinstance(runtime.predictor, LowRankExpertHead) and runtime.predictor.lr == 0
        before = [p.clone() for p in runtime.predictor.parameters()]
        runtime.before_decode(
            SimpleNamespace(is_draft_input=lambda: True, bonus_tokens=torch.tensor([4, 5]))
        )
        lists, _ = draft_tree_through_hooks(2, 2, 2, 16, vocab=30)
        _, _, draft_tokens = selection.organize_hook(None, *lists, 3)
        tokens = torch.cat([torch.tensor([[4], [5]]), draft_tokens], 1).flatten()
        # Route every verify row exactly as the head predicted, layer by layer: recall 1.
        predicted = runtime.selector.verify_topk[:6].long()  # [6, L, K]
        capture_config = SimpleNamespace(allow_routed_experts_capture=True)
        for layer in (0, 1):
            routing.after_capture(None, capture_config, layer, predicted[:, layer])
        runtime.after_verify(SimpleNamespace(draft_token=tokens))
        (summary,) = runtime.summaries
        assert summary["predictor_recall"] == 1.0
        params = runtime.predictor.parameters()
        assert all(torch.equal(a, b) for a, b in zip(before, params, strict=True))
    finally:
        runtime.close()
    # A head for another model is refused at startup.
    wrong = Qwen2MoeConfig(
        hidden_size=32, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2
    )
    with pytest.raises(ValueError, match="hidden_size: saved 16, expected 32"):
        algorithm.EcoSpecRuntime(
            settings, wrong, topk=2, num_draft_tokens=3, max_batch=2, device="cpu"
        )
