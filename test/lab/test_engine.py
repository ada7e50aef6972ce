"""Offline tree speculative decoding: lossless vs greedy, SGLang's tree, routing records.

The target is a tiny random Qwen2-MoE (4 layers, 16 experts, top-4, vocab 512); the draft is
an EAGLE-3 head trained for a few seconds on the target's own greedy continuations of the
test prompts, so that drafts are accepted often and every acceptance path is exercised.
"""

import dataclasses

import pytest
import torch
from _models import AUX, EXPERTS, LAYERS, TOP_K, random_prompts, tiny_target, train_draft

from sgl_ecospec.lab.engine import (
    ENGINE_SELECTION,
    OfflineEngine,
    OracleExpertPredictor,
    SpecConfig,
)
from sgl_ecospec.lab.engine.drafter import Drafter
from sgl_ecospec.lab.engine.stats import rank_loads
from sgl_ecospec.ops.bitmaps import bitmap_popcount, bitmap_to_ids
from sgl_ecospec.predictors import OnlineExpertPredictor

MAX_NEW = 24


PROMPTS = random_prompts(3, seed=1)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine")
    target = tiny_target()
    target.save_pretrained(root / "target")
    engine = OfflineEngine(str(root / "target"), None)
    prompts = PROMPTS + random_prompts(3, seed=2)
    greedy = engine.generate_greedy(prompts, MAX_NEW + 8)
    train_draft(
        target, [p + o for p, o in zip(prompts, greedy.outputs, strict=True)]
    ).save_pretrained(root / "draft")
    return target, OfflineEngine(str(root / "target"), str(root / "draft"))


@pytest.fixture(scope="module")
def greedy(setup):
    return {n: setup[1].generate_greedy(PROMPTS[:n], MAX_NEW) for n in (1, 3)}


# --- the target alone ---------------------------------------------------------------------


def test_greedy_equals_transformers_generate(setup, greedy):
    target, _ = setup
    prompt = torch.tensor([PROMPTS[0]])
    expected = target.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)
    assert greedy[1].outputs[0] == expected[0, prompt.shape[1] :].tolist()


def test_batched_greedy_equals_one_by_one(setup, greedy):
    _, engine = setup
    for prompt, output in zip(PROMPTS, greedy[3].outputs, strict=True):
        assert engine.generate_greedy([prompt], MAX_NEW).outputs == [output]


def test_greedy_steps(greedy):
    steps = greedy[3].steps
    assert len(steps) == MAX_NEW - 1  # the first token comes from the prefill
    for step in steps:
        assert step.batch_size == step.verified_tokens == 3 and step.accepted == [0, 0, 0]
        assert len(step.unique_experts) == LAYERS and step.recall is None
        assert all(TOP_K <= n <= min(EXPERTS, 3 * TOP_K) for n in step.unique_experts)


def test_routing_and_aux_capture_match_transformers(setup):
    target, engine = setup
    ids = torch.tensor([PROMPTS[2]])
    rows = ids.shape[1]
    cache = engine.target.new_cache(1)
    mask = torch.ones(rows, rows, dtype=torch.bool).tril()[None]
    out = engine.target.forward(ids, torch.arange(rows)[None], cache, mask)
    with torch.no_grad():
        ref = target(ids, output_hidden_states=True, output_router_logits=True)
    torch.testing.assert_close(out.logits, ref.logits)
    # SGLang's aux ids [a, b, c] are the outputs of layers a, b, c: hidden_states[id + 1].
    expected_aux = torch.cat([ref.hidden_states[a + 1] for a in AUX], -1)
    torch.testing.assert_close(out.aux, expected_aux)
    for layer, logits in enumerate(ref.router_logits):
        expected = logits.softmax(-1).topk(TOP_K, -1).indices
        assert torch.equal(out.routing[0, :, layer], expected)


# --- speculative decoding is lossless -----------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("policy", ["confidence", "ecospec"])
@pytest.mark.parametrize("predictor", ["online", "oracle"])
def test_lossless(setup, greedy, batch, policy, predictor):
    _, engine = setup
    spec = SpecConfig(
        topk=4, num_steps=3, budget=4, selection=ENGINE_SELECTION.replace(policy=policy)
    )
    result = engine.generate_speculative(PROMPTS[:batch], MAX_NEW, spec, predictor)
    assert result.outputs == greedy[batch].outputs
    accepted = [a for step in result.steps for a in step.accepted]
    assert sum(accepted) / len(accepted) > 1.0, "the fitted draft should be accepted"
    assert max(accepted) == spec.num_steps
    if predictor == "oracle":
        assert result.predictor_recall > 0.99
    else:
        assert 0.0 < result.predictor_recall < 1.0


def test_head_predictor_reads_draft_states_and_learns(setup, greedy):
    from sgl_ecospec.predictors import LowRankExpertHead

    _, engine = setup
    hidden = engine.draft.config.hidden_size
    torch.manual_seed(0)
    head = LowRankExpertHead(hidden, engine.num_layers, engine.num_experts, TOP_K, lr=1e-2)
    before = [p.clone() for p in head.parameters()]
    spec = SpecConfig(
        topk=4, num_steps=3, budget=4, selection=ENGINE_SELECTION.replace(policy="ecospec")
    )
    result = engine.generate_speculative(PROMPTS, MAX_NEW, spec, head)
    assert result.outputs == greedy[3].outputs
    assert 0.0 < result.predictor_recall < 1.0
    # observe got the verified rows' draft states and took Adam steps on them.
    assert not all(torch.equal(a, b) for a, b in zip(before, head.parameters(), strict=True))
    wrong = LowRankExpertHead(hidden + 1, engine.num_layers, engine.num_experts, TOP_K)
    with pytest.raises(ValueError, match=f"draft states of size {hidden + 1}.*train-head"):
        engine.generate_speculative(PROMPTS, MAX_NEW, spec, wrong)


@pytest.mark.parametrize(
    "spec",
    [
        SpecConfig(topk=2, num_steps=4, budget=5, tree_attention="ancestors"),
        SpecConfig(topk=1, num_steps=3, budget=3),
        SpecConfig(
            topk=3, num_steps=1, budget=2, selection=ENGINE_SELECTION.replace(policy="ecospec")
        ),
        SpecConfig(
            topk=4,
            num_steps=3,
            budget=7,
            selection=ENGINE_SELECTION.replace(share_buffer=False, policy="ecospec"),
        ),
    ],
)
def test_lossless_other_trees(setup, greedy, spec):
    _, engine = setup
    result = engine.generate_speculative(PROMPTS, MAX_NEW, spec, "online")
    assert result.outputs == greedy[3].outputs


def test_max_new_tokens_cut_mid_acceptance_and_counts(setup):
    _, engine = setup
    truncated = 0
    for max_new in (1, 2, 7, 13):
        expected = engine.generate_greedy(PROMPTS, max_new).outputs
        result = engine.generate_speculative(PROMPTS, max_new, SpecConfig(), "online")
        assert result.outputs == expected
        for request, output in enumerate(result.outputs):
            steps = [
                s.accepted[s.request_ids.index(request)]
                for s in result.steps
                if request in s.request_ids
            ]
            produced = 1 + sum(a + 1 for a in steps)
            assert len(output) == max_new
            assert produced >= max_new and (not steps or produced - (steps[-1] + 1) < max_new)
            truncated += produced > max_new
    assert truncated, "some request must stop in the middle of an accepted run"


def test_eos_stops_both_paths(setup, greedy):
    _, engine = setup
    outputs = greedy[3].outputs
    eos = outputs[1][5]
    engine.eos_token_ids = {eos}
    try:
        expected = engine.generate_greedy(PROMPTS, MAX_NEW).outputs
        result = engine.generate_speculative(PROMPTS, MAX_NEW, SpecConfig(), "online")
    finally:
        engine.eos_token_ids = set()
    assert result.outputs == expected
    for full, cut in zip(outputs, expected, strict=True):
        stop = full.index(eos) + 1 if eos in full else len(full)
        assert cut == full[:stop]


# --- what each step records ---------------------------------------------------------------


def test_step_records(setup):
    _, engine = setup
    predictor = OnlineExpertPredictor(LAYERS, EXPERTS, TOP_K)
    seen = []
    spec = SpecConfig(selection=ENGINE_SELECTION.replace(policy="ecospec"))
    result = engine.generate_speculative(PROMPTS, MAX_NEW, spec, predictor, progress=seen.append)
    assert seen == result.steps and predictor.observe_calls == len(result.steps)
    for step in result.steps:
        assert step.batch_size == len(step.accepted) == len(step.request_ids)
        assert step.verified_tokens == step.batch_size * spec.num_draft_tokens
        assert all(0 <= a <= spec.num_steps for a in step.accepted)
        assert len(step.unique_experts) == LAYERS
        assert all(TOP_K <= n <= EXPERTS for n in step.unique_experts)
        assert 0.0 <= step.recall <= 1.0
    weights = [s.verified_tokens for s in result.steps]
    overall = sum(s.recall * w for s, w in zip(result.steps, weights, strict=True)) / sum(weights)
    assert result.predictor_recall == pytest.approx(overall)


def test_step_records_the_union_bitmap_and_rank_loads(setup, greedy):
    _, engine = setup
    result = engine.generate_speculative(
        PROMPTS, MAX_NEW, SpecConfig(selection=ENGINE_SELECTION.replace(policy="ecospec"))
    )
    contiguous = torch.arange(EXPERTS) // (EXPERTS // 4)  # 4 ranks, SGLang's block layout
    every_own_rank = torch.arange(EXPERTS)
    for step in result.steps + greedy[3].steps:
        assert step.expert_bitmap.shape == (LAYERS, 1) and step.expert_bitmap.device.type == "cpu"
        assert bitmap_popcount(step.expert_bitmap).tolist() == step.unique_experts
        assert step.busiest_rank_experts(torch.zeros(EXPERTS, dtype=torch.long), 1) == (
            step.unique_experts
        )
        assert step.busiest_rank_experts(every_own_rank, EXPERTS) == [1] * LAYERS
        busiest = step.busiest_rank_experts(contiguous, 4)
        for layer, (top, union) in enumerate(zip(busiest, step.unique_experts, strict=True)):
            ids = bitmap_to_ids(step.expert_bitmap[layer], EXPERTS)
            assert top == max(sum(1 for e in ids if e // 4 == r) for r in range(4))
            assert -(-union // 4) <= top <= min(union, 4)


def test_paired_selection_scores_both_sets_on_the_same_trees(setup, greedy):
    _, engine = setup
    eco = SpecConfig(selection=ENGINE_SELECTION.replace(policy="ecospec", eps=0.05))
    conf = SpecConfig(selection=ENGINE_SELECTION.replace(policy="confidence"))
    paired = engine.generate_speculative(PROMPTS, MAX_NEW, eco, compare=conf)
    alone = {
        name: engine.generate_speculative(PROMPTS, MAX_NEW, spec)
        for name, spec in (("ecospec", eco), ("confidence", conf))
    }
    assert paired.outputs == alone["ecospec"].outputs == greedy[3].outputs
    # The compared set is only scored: the decode is the unpaired one, step for step.
    assert [s.accepted for s in paired.steps] == [s.accepted for s in alone["ecospec"].steps]
    first = paired.steps[0]  # every run's first tree is the same one
    assert first.paired_bitmaps.shape == (2, LAYERS, 1)
    assert first.paired_bitmaps.device.type == "cpu"
    for index, name in enumerate(("ecospec", "confidence")):
        assert torch.equal(first.paired_bitmaps[index], alone[name].steps[0].expert_bitmap)
    differ = 0
    for step in paired.steps:
        assert torch.equal(step.paired_bitmaps[0], step.expert_bitmap)
        # The run's own set accepts, in the pass over the whole tree, what its verify did.
        assert step.paired_accepted[0] == sum(step.accepted)
        assert step.paired_verified[0] == step.verified_tokens
        own, other = step.paired_scores
        # Confidence takes the top scores, so no ancestor-closed set of its size sums higher.
        assert 0 < own <= other + 1e-9
        differ += not torch.equal(step.paired_bitmaps[0], step.paired_bitmaps[1])
    assert differ > 0, "ecospec and confidence should pick different sets on some step"
    assert all(s.paired_bitmaps is None for s in alone["ecospec"].steps)

    # A compared set of roots only (adaptive that cannot pay: all -1 padding) reads a
    # subset of the run's union, and its draft score is 0.
    nothing = SpecConfig(
        selection=ENGINE_SELECTION.replace(policy="adaptive", eps=10.0, step_cost=0.01)
    )
    for step in engine.generate_speculative(PROMPTS, 4, eco, compare=nothing).steps:
        own, roots = step.paired_bitmaps
        assert step.paired_scores[1] == 0.0 and not bool((roots & ~own).any())
        assert bitmap_popcount(roots).sum() >= TOP_K * LAYERS

    # Compared with evict: flat step seconds keep confidence's whole set, steep ones cut it
    # to the roots.
    budget = eco.budget
    flat = SpecConfig(evict_seconds=(1.0,) * (budget + 1))
    steep = SpecConfig(evict_seconds=tuple(1.0 + 100 * k for k in range(budget + 1)))
    against_conf = paired.steps
    for compare, check in ((flat, "whole"), (steep, "roots")):
        steps = engine.generate_speculative(PROMPTS, MAX_NEW, eco, compare=compare).steps
        for step, conf_step in zip(steps, against_conf, strict=True):
            if check == "whole":
                assert torch.equal(step.paired_bitmaps[1], conf_step.paired_bitmaps[1])
                assert step.paired_accepted[1] == conf_step.paired_accepted[1]
                assert step.paired_verified[1] == step.batch_size * (1 + budget)
            else:
                assert step.paired_verified[1] == step.batch_size
                assert step.paired_accepted[1] == 0 and step.paired_scores[1] == 0.0

    same = engine.generate_speculative(PROMPTS[:1], 4, eco, compare=eco).steps
    assert all(torch.equal(s.paired_bitmaps[0], s.paired_bitmaps[1]) for s in same)
    with pytest.raises(ValueError, match="compare must grow the same tree.*topk 2 vs 4"):
        engine.generate_speculative(PROMPTS, 2, eco, compare=SpecConfig(topk=2))
    with pytest.raises(TypeError, match="compare must be a SpecConfig"):
        engine.generate_speculative(PROMPTS, 2, eco, compare={"policy": "confidence"})


def test_rank_loads_by_hand():
    # Layer 0: experts 0, 63 (the sign bit of word 0) and 64; layer 1: experts 1, 2, 3.
    bitmap = torch.tensor([[1 | (1 << 63) - (1 << 64), 1], [0b1110, 0]])
    ranks = torch.arange(70) // 35  # rank 0 holds 0-34, rank 1 holds 35-69
    assert rank_loads(bitmap, ranks, 2).tolist() == [[1, 2], [3, 0]]
    per_layer = torch.stack([ranks, torch.ones(70, dtype=torch.long)])  # layer 1: all on rank 1
    assert rank_loads(bitmap, per_layer, 2).tolist() == [[1, 2], [0, 3]]
    assert rank_loads(bitmap[None], ranks, 3).shape == (1, 2, 3)  # an idle third rank
    with pytest.raises(ValueError, match="outside|lie in"):
        rank_loads(bitmap, ranks, 1)
    with pytest.raises(ValueError, match="bitmaps hold only 128 bits"):
        rank_loads(bitmap, torch.zeros(200, dtype=torch.long), 1)


def test_adaptive_that_cannot_pay_verifies_only_the_roots(setup, greedy):
    _, engine = setup
    # The best node's gain per cost is P / eps <= 1 / 10, below the starting rate 1 / 0.01.
    spec = SpecConfig(
        selection=ENGINE_SELECTION.replace(policy="adaptive", eps=10.0, step_cost=0.01)
    )
    result = engine.generate_speculative(PROMPTS, MAX_NEW, spec)
    assert result.outputs == greedy[3].outputs
    for step in result.steps:
        assert step.verified_tokens == step.batch_size
        assert step.accepted == [0] * step.batch_size


@pytest.mark.parametrize("share_buffer", [True, False, "rounds"])
def test_adaptive_selects_fewer_nodes_losslessly(setup, greedy, share_buffer):
    _, engine = setup
    buffer = dict(share_buffer=bool(share_buffer), round_sync=share_buffer == "rounds")
    full = SpecConfig(budget=7, selection=ENGINE_SELECTION.replace(policy="ecospec", **buffer))
    # A cheap step start: nodes must be worth about as much as the bonus token per cost.
    spec = dataclasses.replace(
        full, selection=full.selection.replace(policy="adaptive", step_cost=2.0)
    )
    result = engine.generate_speculative(PROMPTS, MAX_NEW, spec)
    assert result.outputs == greedy[3].outputs
    verified = [s.verified_tokens / s.batch_size for s in result.steps]
    assert all(1 <= v <= spec.num_draft_tokens for v in verified)
    assert min(verified) < spec.num_draft_tokens, "some step should stop short of the budget"
    assert sum(a for s in result.steps for a in s.accepted) > 0, "and some should draft"
    assert all(
        0 <= a <= v - 1
        for s, v in zip(result.steps, verified, strict=True)
        for a in s.accepted
        if s.batch_size == 1
    )


def test_expert_parallel_selection_is_lossless_and_checked(setup, greedy):
    _, engine = setup
    ranks = (torch.arange(EXPERTS) // 4).tolist()
    spec = SpecConfig(
        expert_rank=ranks,
        num_ranks=4,
        selection=ENGINE_SELECTION.replace(policy="ecospec", total_weight=0.25),
    )
    result = engine.generate_speculative(PROMPTS, MAX_NEW, spec)
    assert result.outputs == greedy[3].outputs
    per_layer = SpecConfig(
        expert_rank=[ranks] * LAYERS,
        layer_weights=[1.0, 2.0, 0.5, 1.0],
        selection=ENGINE_SELECTION.replace(policy="ecospec"),
    )
    assert per_layer.num_ranks == 4
    assert engine.generate_speculative(PROMPTS, MAX_NEW, per_layer).outputs == greedy[3].outputs
    with pytest.raises(ValueError, match=r"expert_rank has shape \(8,\)"):
        engine.generate_speculative(PROMPTS, 2, SpecConfig(expert_rank=[0] * 8))
    with pytest.raises(ValueError, match=r"expert_rank has shape \(2, 16\)"):
        engine.generate_speculative(PROMPTS, 2, SpecConfig(expert_rank=[ranks] * 2))
    with pytest.raises(ValueError, match="layer_weights has 2 entries"):
        engine.generate_speculative(PROMPTS, 2, SpecConfig(layer_weights=[1.0, 1.0]))


def test_spec_config_normalises_and_validates():
    spec = SpecConfig(expert_rank=torch.tensor([0, 1, 1, 0]), layer_weights=torch.ones(2))
    assert spec.expert_rank == (0, 1, 1, 0) and spec.num_ranks == 2
    assert spec.layer_weights == (1.0, 1.0)
    assert spec == SpecConfig(expert_rank=[0, 1, 1, 0], layer_weights=[1, 1])
    assert hash(spec) == hash(SpecConfig(expert_rank=(0, 1, 1, 0), layer_weights=(1.0, 1.0)))
    assert SpecConfig(expert_rank=[0, 0], num_ranks=3).num_ranks == 3
    bad = [
        ({"policy": "adaptive"}, "needs step_cost"),
        ({"policy": "adaptive", "step_cost": 0.0}, "step_cost must be finite and > 0"),
        ({"step_tokens": -1.0}, "step_tokens must be >= 0"),
        ({"eps": float("nan")}, "eps must be finite"),
        ({"num_ranks": 2}, "num_ranks needs expert_rank"),
        ({"total_weight": 0.5}, "total_weight needs expert_rank"),
        ({"expert_rank": [0, 2], "num_ranks": 2}, r"lie in \[0, num_ranks=2\)"),
        ({"expert_rank": [-1, 0]}, r"lie in \[0, num_ranks=1\)"),
        ({"expert_rank": [0.5, 1.0]}, "must be integers"),
        ({"expert_rank": []}, "is empty"),
        ({"expert_rank": [0, 1], "num_ranks": 0}, "num_ranks must be an int >= 1"),
        ({"expert_rank": [0, 1], "total_weight": 1.5}, r"total_weight must lie in \[0, 1\]"),
        ({"layer_weights": [1.0, -1.0]}, "finite and >= 0"),
        ({"layer_weights": []}, "L >= 1 floats"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            SpecConfig.from_fields(**kwargs)


def test_bad_arguments(setup):
    _, engine = setup
    with pytest.raises(ValueError, match="budget must be in"):
        SpecConfig(topk=2, num_steps=2, budget=7)
    with pytest.raises(ValueError, match="policy"):
        SpecConfig(selection=ENGINE_SELECTION.replace(policy="fastest"))
    with pytest.raises(ValueError, match="predictor is for"):
        engine.generate_speculative(PROMPTS, 2, SpecConfig(), OnlineExpertPredictor(2, 16, 4))
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate_greedy([[]], 2)
    assert engine.generate_speculative(PROMPTS, 0, SpecConfig()).outputs == [[], [], []]


def test_oracle_refuses_unprimed_rows():
    oracle = OracleExpertPredictor(2, 8, 2)
    oracle.prime(torch.tensor([3, 4]), torch.zeros(2, 2, 2, dtype=torch.long))
    assert oracle.predict_topk(torch.tensor([3, 4])).shape == (2, 2, 2)
    with pytest.raises(ValueError, match="primed"):
        oracle.predict_topk(torch.tensor([4, 3]))


# --- draft tree attention -----------------------------------------------------------------


@pytest.mark.parametrize("tree_attention", ["sglang", "ancestors"])
def test_drafter_beams_see_the_rows_their_mode_says(setup, tree_attention):
    """Every beam's child distribution equals the draft run as a plain sequence over the
    prefix plus the rows the mode lets it see (its slot's rows, or its ancestors)."""
    target, engine = setup
    draft = engine.draft
    topk, steps = 3, 3
    prompt = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        states = target(prompt, output_hidden_states=True).hidden_states
    aux = torch.cat([states[a + 1] for a in AUX], -1)
    next_tokens = torch.cat([prompt[:, 1:], torch.tensor([[7]])], 1)
    drafter = Drafter(draft, engine.target.embed, 1, topk, tree_attention)
    drafter.extend(next_tokens, aux, torch.tensor([prompt.shape[1]]))
    root_hidden = drafter.root_hidden
    # Per step: beam tokens [k], input hidden [k, H], output hidden [k, H], parent beams [k]
    # and child probabilities [k, k].
    outputs = []
    original = drafter._expand

    def spy(step, beam_tokens, parent_beam):
        probs, children, beam_states = original(step, beam_tokens, parent_beam)
        hidden = root_hidden.expand(topk, -1) if step == 0 else outputs[-1][2][parent_beam[0]]
        outputs.append((beam_tokens[0], hidden, beam_states[0], parent_beam[0], probs[0]))
        return probs, children, beam_states

    drafter._expand = spy
    tree = drafter.grow(steps)
    assert drafter.cache.pending == 0 and int(drafter.cache.lengths[0]) == prompt.shape[1]
    # Each candidate carries the draft state that proposed it: the root's, then its beam's.
    proposers = [root_hidden.expand(topk, -1)]
    proposers += [out[2].repeat_interleave(topk, 0) for out in outputs]
    assert torch.equal(tree.hidden[0], torch.cat(proposers))

    prefix_len = prompt.shape[1]
    for step, (*_, probs) in enumerate(outputs):
        for beam in range(topk):
            # Which beam slot's row the beam sees at each earlier step.
            slots = [beam] * (step + 1)
            if tree_attention == "ancestors":
                for s in range(step, 0, -1):
                    slots[s - 1] = int(outputs[s][3][slots[s]])
            with torch.no_grad():
                past = draft(
                    engine.target.embed(next_tokens),
                    aux,
                    torch.arange(prefix_len)[None],
                )
                key, value = past.key, past.value
                for s, slot in enumerate(slots):
                    row = draft(
                        engine.target.embed(outputs[s][0][slot].view(1, 1)),
                        outputs[s][1][slot].view(1, 1, -1),
                        torch.tensor([[prefix_len + s]]),
                        past=(key, value),
                    )
                    key = torch.cat([key, row.key], 2)
                    value = torch.cat([value, row.value], 2)
            expected = row.logits[0, 0].float().softmax(-1).topk(topk).values
            torch.testing.assert_close(probs[beam], expected, rtol=1e-5, atol=1e-6)
