"""The expert -> EP rank placement from SGLang's expert location metadata, its price in
selection and its refresh after EPLB updates."""

import pytest
import torch
from sglang_ecospec import ep_placement, hooks, selection
from sglang_ecospec.settings import EcoSpecSettings

from plugin._helpers import PUBLISHED, cpu_runtime, spy_on_selection
from sgl_ecospec.predictors import OnlineExpertPredictor


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

    settings = EcoSpecSettings(log_interval=0, **PUBLISHED)  # the cost's mechanics alone
    assert choose(make(settings)) == [[10]]  # both add one expert: the higher P wins
    placement = ep_placement.ExpertPlacement(layout, [1], 8, "cpu")
    selector = make(settings, placement)
    assert choose(selector) == [[11]]  # 0.45 / (0.5 + eps) beats 0.55 / (1 + eps)
    call = calls[-1]
    assert call["expert_rank"] is placement.expert_rank and call["num_ranks"] == 2
    assert call["total_weight"] is None  # the op's default, 1 / R
    assert placement.expert_rank.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
    # total_weight from the settings reaches the op: 1 prices every added expert alike.
    flat = make(EcoSpecSettings(log_interval=0, total_weight=1.0, **PUBLISHED), placement)
    assert choose(flat) == [[10]] and calls[-1]["total_weight"] == 1.0

    # EPLB swaps experts 2 and 5 in layer 1 (SGLang's in-place update, through our hook).
    bindings = [ep_placement.slot.bind(placement)]
    hooks.activate(bindings)
    try:
        buffer = placement.expert_rank.data_ptr()
        metadata.update(moved_location(), update_layer_ids=[1])
        # Not within the step that is running: the draft step still prices the old ranks.
        assert placement.refresh_pending
        assert placement.expert_rank.tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]
        assert choose(selector) == [[11]]
        assert placement.apply_refresh()  # the next step's start (EcoSpecRuntime.before_decode)
        assert not placement.apply_refresh() and not placement.refresh_pending
        assert placement.expert_rank.data_ptr() == buffer  # graphs keep reading it
        assert placement.expert_rank.tolist() == [[0, 0, 1, 0, 1, 0, 1, 1]]
        assert choose(selector) == [[10]]  # expert 2 is now free on the idle rank
    finally:
        hooks.deactivate(bindings)
    assert ep_placement.slot.active() is None


def moved_location():
    """Layer 1 of the metadata above after EPLB swapped experts 2 and 5."""
    return fake_expert_location([[4, 5, 6, 7, 0, 1, 2, 3], [0, 1, 5, 3, 4, 2, 6, 7]], 2)


def test_eplb_refresh_applies_at_the_next_decode_step():
    """Finding 8: EPLB's update only marks the placement stale; the runtime copies the new
    ranks at the start of the next decode step (on the forward stream), never mid-step."""
    from types import SimpleNamespace

    from transformers import Qwen2MoeConfig

    metadata = fake_expert_location([[4, 5, 6, 7, 0, 1, 2, 3], list(range(8))], 2)
    config = Qwen2MoeConfig(num_hidden_layers=2, num_experts=8, num_experts_per_tok=2)
    layout = ep_placement.EPLayout(ep_size=2, metadata=metadata)
    settings = EcoSpecSettings(log_interval=0, num_buckets=64)
    runtime = cpu_runtime(settings, config, 2, 2, max_batch=2, ep_layout=layout)
    spec_info = SimpleNamespace(is_draft_input=lambda: True, bonus_tokens=torch.tensor([1]))
    try:
        ranks = runtime.placement.expert_rank
        before = ranks.tolist()
        assert before[1] == [0, 0, 0, 0, 1, 1, 1, 1]
        metadata.update(moved_location(), update_layer_ids=[1])  # EPLB, through the hook
        assert ranks.tolist() == before  # mid-step: unchanged
        runtime.before_decode(spec_info)  # the next step starts
        assert ranks.tolist() == [before[0], [0, 0, 1, 0, 1, 0, 1, 1]]
        assert runtime.placement.expert_rank is ranks
    finally:
        runtime.close()
    # Without an active placement an update is SGLang's alone.
    metadata.update(
        fake_expert_location([[4, 5, 6, 7, 0, 1, 2, 3], list(range(8))], 2), update_layer_ids=[1]
    )
    assert not runtime.placement.refresh_pending
