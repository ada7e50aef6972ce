"""The engine with a context predictor and the recall-weighted cost: lossless, every row's
parent token handed over correctly, the live recall measured (tiny models, as test_engine)."""

import pytest
import torch
from _models import EXPERTS, LAYERS, TOP_K, VOCAB, random_prompts, tiny_engine_fixture

from sgl_ecospec.lab.bench.predictor_replay import StepRecorder, memory_bytes, replay
from sgl_ecospec.lab.engine import ENGINE_SELECTION, SpecConfig
from sgl_ecospec.predictors import (
    ContextExpertPredictor,
    LowRankExpertHead,
    OnlineExpertPredictor,
)

MAX_NEW = 24


PROMPTS = random_prompts(3, seed=1)


engine = tiny_engine_fixture("engine_context", PROMPTS, MAX_NEW + 8)


@pytest.fixture(scope="module")
def greedy(engine):
    return engine.generate_greedy(PROMPTS, MAX_NEW)


@pytest.mark.parametrize("weighted", [False, True])
def test_context_predictor_is_lossless_and_measured(engine, greedy, weighted):
    predictor = ContextExpertPredictor(LAYERS, EXPERTS, TOP_K, vocab_size=VOCAB, pair_buckets=1024)
    spec = SpecConfig(
        topk=4,
        num_steps=3,
        budget=4,
        recall_weighted_cost=weighted,
        selection=ENGINE_SELECTION.replace(policy="ecospec"),
    )
    result = engine.generate_speculative(PROMPTS, MAX_NEW, spec, predictor)
    assert result.outputs == greedy.outputs
    assert 0.0 < result.predictor_recall < 1.0
    live = predictor.live_recall
    assert live.recall() == pytest.approx(result.predictor_recall)
    assert len(live.per_layer()) == LAYERS
    assert bool((predictor.pair_keys[:-1] >= 0).any()), "pairs were learnt"


def test_each_verified_row_gets_its_parent_token(engine, greedy):
    recorder = StepRecorder(OnlineExpertPredictor(LAYERS, EXPERTS, TOP_K))
    spec = SpecConfig(
        topk=4, num_steps=3, budget=4, selection=ENGINE_SELECTION.replace(policy="confidence")
    )
    prompt, output = PROMPTS[0], greedy.outputs[0]
    engine.generate_speculative([prompt], MAX_NEW, spec, recorder)
    sequence = prompt + output
    first = recorder.steps[0]
    assert (first["context"][0], first["tokens"][0]) == (prompt[-1], output[0])
    position = len(prompt) - 1
    for step in recorder.steps:
        tokens, context = step["tokens"].tolist(), step["context"].tolist()
        # The root is a later generated token and its context the token before it.
        later = [
            p
            for p in range(position + 1, len(sequence))
            if (sequence[p - 1], sequence[p]) == (context[0], tokens[0])
        ]
        assert later, (context[0], tokens[0])
        position = later[0]
        # A candidate's parent is the root or another verified row of the step.
        assert all(c in tokens for c in context[1:])
        # Each row keeps the drafter state that proposed it.
        assert step["hidden"].dtype == torch.float16
        assert step["hidden"].shape == (len(tokens), engine.draft.config.hidden_size)
    # The replay of the recorded stream gives every predictor kind its online recall.
    for predictor in (
        OnlineExpertPredictor(LAYERS, EXPERTS, TOP_K),
        ContextExpertPredictor(LAYERS, EXPERTS, TOP_K, vocab_size=VOCAB, pair_buckets=64),
    ):
        result = replay(predictor, recorder.steps)
        assert result["rows"] == sum(s["tokens"].shape[0] for s in recorder.steps)
        assert 0.0 < result["recall"] < 1.0 and len(result["recall_per_layer"]) == LAYERS


def test_replay_trains_a_head_online_on_the_recorded_states(engine):
    recorder = StepRecorder(OnlineExpertPredictor(LAYERS, EXPERTS, TOP_K))
    spec = SpecConfig(
        topk=4, num_steps=3, budget=4, selection=ENGINE_SELECTION.replace(policy="confidence")
    )
    engine.generate_speculative(PROMPTS[:1], MAX_NEW, spec, recorder)
    hidden_size = engine.draft.config.hidden_size
    torch.manual_seed(0)
    head = LowRankExpertHead(hidden_size, LAYERS, EXPERTS, TOP_K, rank=8, token_buckets=16, lr=1e-2)
    before = head.up.weight.detach().clone()
    result = replay(head, recorder.steps)
    assert 0.0 < result["recall"] <= 1.0
    assert not torch.equal(before, head.up.weight), "the head learnt from the verify routing"
    params = hidden_size * 8 + 16 * 8 + 8 * LAYERS * EXPERTS + LAYERS * EXPERTS
    assert memory_bytes(head) == 4 * params
