"""The predictors an ECOSPEC server builds from its settings (``vocab`` and ``context`` from
the library's catalog, sized to the target's vocabulary), the parent tokens the context
predictor reads and learns from in the plugin's draft and verify path, and their memory."""

from types import SimpleNamespace

import pytest
import torch
from sglang_ecospec import memory, routing, selection, served_predictor
from sglang_ecospec.settings import EcoSpecSettings

from plugin._helpers import sglang_draft_tree, spy_on_host_reads
from plugin.test_memory import allocations
from sgl_ecospec.predictors import ContextExpertPredictor, OnlineExpertPredictor

L, E, K, VOCAB = 2, 8, 2, 64  # MoE layers, experts, top-k and vocabulary of the target
SHAPE = memory.ModelShape(L, E, K)
TOPK, STEPS, NDT = 2, 2, 4  # the draft tree: 2 + 2 * 2 = 6 candidates, 3 verified
# The memory test's model and tree (test_memory.py's): there the [T, L, E] terms dominate.
MEMORY_SHAPE, MEMORY_TREE = memory.ModelShape(4, 64, 4), {"topk": 4, "num_steps": 3}


def moe_config(vocab=VOCAB, shape=SHAPE):
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(
        num_hidden_layers=shape.num_layers,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k,
        vocab_size=vocab,
    )


def build_runtime(settings, max_batch=4, shape=SHAPE, num_draft_tokens=NDT):
    from sglang_ecospec.runtime import EcoSpecRuntime

    tree = MEMORY_TREE if shape == MEMORY_SHAPE else {"topk": TOPK, "num_steps": STEPS}
    return EcoSpecRuntime(
        settings,
        moe_config(shape=shape),
        num_draft_tokens=num_draft_tokens,
        max_batch=max_batch,
        device="cpu",
        **tree,
    )


def hand_tree():
    """Two requests' draft trees as SGLang's draft step hands them to
    organize_draft_results: step 0 proposes two children of the root, step 1 two children
    of each (beam j is step 0's candidate j). Candidates 0..5 of request 0 are tokens
    10..15 (2, 3 under 0; 4, 5 under 1), of request 1 tokens 20..25."""
    score_list = [
        torch.tensor([[[0.6, 0.4]], [[0.7, 0.3]]]),
        torch.tensor([[[0.35, 0.2], [0.1, 0.05]], [[0.3, 0.25], [0.2, 0.1]]]),
    ]
    token_list = [
        torch.tensor([[10, 11], [20, 21]]),
        torch.tensor([[12, 13, 14, 15], [22, 23, 24, 25]]),
    ]
    parents_list = [torch.tensor([[-1, 0, 1]] * 2), torch.tensor([[2, 3]] * 2)]
    return score_list, token_list, parents_list


def parent_tokens(roots, root_context):
    """token -> its parent token in :func:`hand_tree` (the root's: ``root_context``)."""
    parents = {}
    for b, base in enumerate((10, 20)):
        parents[int(roots[b])] = int(root_context[b])
        parents.update({base: int(roots[b]), base + 1: int(roots[b])})
        parents.update({base + 2: base, base + 3: base, base + 4: base + 1, base + 5: base + 1})
    return parents


def spy(runtime, monkeypatch):
    """Records the (tokens, context tokens) of every prediction and update."""
    calls = {"predict": [], "observe": []}
    predictor = runtime.predictor
    real_predict, real_observe = predictor.predict_topk, predictor.observe

    def predict(token_ids, hidden=None, *, validate=False, context_tokens=None):
        calls["predict"].append((token_ids.tolist(), context_tokens.tolist()))
        return real_predict(token_ids, hidden, validate=validate, context_tokens=context_tokens)

    def observe(token_ids, topk_ids, hidden=None, *, validate=True, context_tokens=None):
        calls["observe"].append((token_ids.tolist(), context_tokens.tolist()))
        real_observe(token_ids, topk_ids, hidden, validate=validate, context_tokens=context_tokens)

    monkeypatch.setattr(predictor, "predict_topk", predict)
    monkeypatch.setattr(predictor, "observe", observe)
    return calls


def capture_routing(runtime, verify_tokens):
    """The verify forward's routing of ``verify_tokens`` [B * D], as the capture hook sees it
    (expert ids in ``range(top_k)`` shifted by the token and layer)."""
    capture_config = SimpleNamespace(allow_routed_experts_capture=True)
    experts, top_k = runtime.predictor.num_experts, runtime.predictor.top_k
    runtime.before_verify()
    for layer in range(runtime.predictor.num_layers):
        shift = (verify_tokens[:, None] + layer) % experts
        ids = (shift + torch.arange(top_k) * (1 + layer % 2)) % experts  # distinct per row
        routing.after_capture(None, capture_config, layer, ids)


def verify(runtime, verify_tokens, accept_index, accept_lens, slots):
    """SGLang's verify of ``verify_tokens`` [B * D] as the worker reports it: captured
    routing, then its accepted paths (flat verify rows, root first)."""
    capture_routing(runtime, verify_tokens)
    result = SimpleNamespace(
        accept_index=torch.tensor(accept_index, dtype=torch.int32),
        accept_lens=torch.tensor(accept_lens, dtype=torch.int32),
    )
    runtime.after_verify(SimpleNamespace(draft_token=verify_tokens), result, slots)


def test_context_predictor_reads_and_learns_each_rows_parent_token(monkeypatch):
    runtime = build_runtime(EcoSpecSettings(predictor="context", log_interval=0))
    try:
        assert isinstance(runtime.predictor, ContextExpertPredictor)
        assert runtime.predictor.vocab_size == VOCAB and runtime.predictor.pair_buckets > 0
        calls = spy(runtime, monkeypatch)
        draft_input = SimpleNamespace(is_draft_input=lambda: True)
        # Step 1: requests in pool slots 3 and 1, fresh (prefilled): the roots' parents
        # are unknown.
        roots, slots = torch.tensor([5, 6]), torch.tensor([3, 1])
        runtime.forget_requests(slots)
        runtime.before_decode(SimpleNamespace(**vars(draft_input), bonus_tokens=roots), slots)
        _, _, draft = selection.organize_hook(None, *hand_tree(), NDT)
        (tokens, context), *_ = calls["predict"]
        parents = parent_tokens(roots, [-1, -1])
        assert context == [parents[t] for t in tokens]
        assert context[:7] == [-1, 5, 5, 10, 10, 11, 11]  # root, then candidates 0..5
        # After the verify the predictor learns every verify row with its parent token.
        verify_tokens = torch.cat([roots[:, None], draft], 1).flatten()  # [B * D]
        # Request 0 accepts its first chosen candidate (row 1), request 1 nothing (row 4:
        # its root): the next roots follow draft[0, 0] and 6.
        verify(runtime, verify_tokens, [[0, 1, -1], [4, -1, -1]], [2, 1], slots)
        ((learnt, learnt_context),) = calls["observe"]
        assert learnt == verify_tokens.tolist()
        assert learnt_context == [parents[t] for t in learnt]
        # Step 2, the batch in another order: each root's parent is its request's last
        # verified token, found by its pool slot.
        calls["predict"].clear()
        roots, slots = torch.tensor([31, 30]), torch.tensor([1, 3])
        runtime.before_decode(SimpleNamespace(**vars(draft_input), bonus_tokens=roots), slots)
        selection.organize_hook(None, *hand_tree(), NDT)
        (tokens, context), *_ = calls["predict"]
        before_roots = [6, int(draft[0, 0])]
        parents = parent_tokens(roots, before_roots)
        assert context == [parents[t] for t in tokens]
        # A prefill in slot 3 (a new request there): its earlier token is forgotten.
        runtime.forget_requests(torch.tensor([3]))
        assert runtime.root_context.lookup(torch.tensor([3, 1])).tolist() == [-1, 6]
        # The utility gate's plain steps verify the bonus tokens alone (row b is request
        # b's root): the root becomes the next root's parent.
        runtime.track_roots(
            SimpleNamespace(draft_token=roots),
            SimpleNamespace(accept_index=torch.tensor([[0], [1]]), accept_lens=torch.ones(2)),
            slots,
        )
        assert runtime.root_context.lookup(slots).tolist() == [31, 30]
    finally:
        runtime.close()


def test_vocab_predictor_reads_no_pairs_and_online_stays_hashed():
    runtime = build_runtime(EcoSpecSettings(predictor="vocab", log_interval=0))
    try:
        predictor = runtime.predictor
        assert isinstance(predictor, ContextExpertPredictor) and predictor.pair_buckets == 0
        assert predictor.num_rows == VOCAB and predictor.needs_context
        assert runtime.selector.verify_context.shape == (4 * NDT,)
    finally:
        runtime.close()
    online = build_runtime(EcoSpecSettings(num_buckets=64, log_interval=0))
    online.close()
    assert isinstance(online.predictor, OnlineExpertPredictor)
    assert online.root_context is None and online.selector.verify_context is None


def saved_and_served(tmp_path, kind):
    """A ``kind`` table that saw one verified row, saved, and the served predictor loaded
    from it: (the table, the settings naming its file, the loaded predictor)."""
    from sgl_ecospec.predictors import make_predictor

    path = tmp_path / f"{kind}.pt"
    saved = make_predictor(kind, L, E, K, vocab_size=VOCAB)
    saved.observe(torch.tensor([3]), torch.tensor([[[1, 2], [3, 4]]]), context_tokens=None)
    saved.save(path)
    settings = EcoSpecSettings(predictor=kind, predictor_file=str(path))
    return saved, settings, served_predictor.build_predictor(settings, moe_config(), "cpu")


def test_saved_vocab_tables_must_fit_the_served_vocabulary_and_kind(tmp_path):
    saved, settings, loaded = saved_and_served(tmp_path, "context")
    path = settings.predictor_file
    assert torch.equal(loaded.token_counts, saved.token_counts)
    with pytest.raises(ValueError, match="vocab_size 64, the served model 128"):
        served_predictor.build_predictor(settings, moe_config(vocab=128), "cpu")
    vocab = EcoSpecSettings(predictor="vocab", predictor_file=str(path))
    with pytest.raises(ValueError, match="holds a 'context' table .* with predictor 'context'"):
        served_predictor.build_predictor(vocab, moe_config(), "cpu")


def test_adjacent_is_served_fresh_or_from_its_own_saved_table(tmp_path):
    from sgl_ecospec.predictors import AdjacentExpertPredictor

    fresh = build_runtime(EcoSpecSettings(predictor="adjacent", log_interval=0))
    fresh.close()
    assert isinstance(fresh.predictor, AdjacentExpertPredictor)
    assert fresh.predictor.vocab_size == VOCAB and fresh.root_context is not None
    saved, settings, loaded = saved_and_served(tmp_path, "adjacent")
    path = settings.predictor_file
    assert isinstance(loaded, AdjacentExpertPredictor)
    assert torch.equal(loaded.token_topk, saved.token_topk)
    context = EcoSpecSettings(predictor="context", predictor_file=str(path))
    with pytest.raises(ValueError, match="not a saved ContextExpertPredictor"):
        served_predictor.build_predictor(context, moe_config(), "cpu")


@pytest.mark.parametrize("name", ["vocab", "context", "adjacent"])
@pytest.mark.parametrize("recall_weighted", [False, True])
def test_memory_counts_the_context_tables_and_their_buffers(name, recall_weighted):
    """The computed footprint is what the runtime keeps (the predictor's tables as the
    library counts them, the context and live-recall buffers), known up front from the
    vocabulary, and bounds the per-step temporaries."""
    settings = EcoSpecSettings(
        predictor=name,
        recall_weighted_cost=recall_weighted,
        min_score=0.0,
        log_interval=1,
        calibrated_acceptance=False,  # its own memory is test_memory.py's
    )
    shape, ndt = MEMORY_SHAPE, 8

    def build():
        return build_runtime(settings, max_batch=5, shape=shape, num_draft_tokens=ndt)

    build().close()  # first use of every module out of the way
    runtime, kept, _ = allocations(build)
    try:
        usage = runtime.memory
        predictor = runtime.predictor
        tables = sum(
            t.numel() * t.element_size()
            for t in vars(predictor).values()
            if isinstance(t, torch.Tensor)
        )
        assert usage.predictor == predictor.memory_bytes() == tables
        assert kept == usage.persistent
        sizes = {"max_batch": 5, "num_draft_tokens": ndt, **MEMORY_TREE}
        assert usage == memory.plugin_memory_bytes(settings, shape, vocab_size=VOCAB, **sizes)
        with pytest.raises(ValueError, match="sized by the vocabulary: pass vocab_size"):
            memory.plugin_memory_bytes(settings, shape, **sizes)
        # One step at the largest batch, measured against its bounds.
        tree = sglang_draft_tree(5, MEMORY_TREE["topk"], MEMORY_TREE["num_steps"], 0, VOCAB)
        roots, slots = torch.arange(5), torch.arange(5)
        runtime.before_decode(
            SimpleNamespace(is_draft_input=lambda: True, bonus_tokens=roots), slots
        )
        (_, _, draft), _, selection_peak = allocations(
            lambda: selection.organize_hook(None, *tree, ndt)
        )
        verify_tokens = torch.cat([roots[:, None], draft], 1).flatten()
        capture_routing(runtime, verify_tokens)
        verify_input = SimpleNamespace(draft_token=verify_tokens)
        _, _, verify_peak = allocations(lambda: runtime.after_verify(verify_input))
    finally:
        runtime.close()
    tree_sizes = {"batch": 5, "num_draft_tokens": ndt, "predictor": name}
    selection_bound = memory.selection_step_bytes(shape, **MEMORY_TREE, **tree_sizes)
    verify_bound = memory.after_verify_bytes(shape, live_recall=recall_weighted, **tree_sizes)
    # The count updates' [T, L, E] temporaries dominate the work after a verify: tight.
    assert verify_peak <= verify_bound <= 1.5 * verify_peak
    # The context predictor only gathers cached rows: the selection's bound sums every
    # tensor of the step as if alive at once.
    assert selection_peak <= selection_bound <= 4 * selection_peak


def test_context_selection_and_learning_stay_on_the_device(monkeypatch):
    """The draft step with the context predictor, its parent tokens and the recall-weighted
    cost traces as one graph without host sync (what a CUDA graph captures), and the work
    after a verify (parent tokens learnt, live recall, the next roots' parents) reads nothing
    on the host."""
    from _util import SYNC_OPS, compile_once, host_syncs
    from sglang_ecospec import metrics

    from sgl_ecospec.predictors import make_predictor

    settings = EcoSpecSettings(predictor="context", recall_weighted_cost=True, log_interval=0)
    tree = hand_tree()

    def make_selector():
        predictor = make_predictor("context", L, E, K, vocab_size=VOCAB)
        tokens = torch.arange(5, 26)
        predictor.observe(
            tokens, torch.stack([tokens % E, (tokens + 3) % E], 1)[:, None].expand(-1, L, -1)
        )
        selector = selection.EcoSpecSelector(
            settings,
            predictor,
            topk=TOPK,
            num_draft_tokens=NDT,
            max_batch=4,
            device="cpu",
            timer=metrics.PredictTimer("cpu"),
        )
        selector.live_recall.trust.copy_(torch.tensor([0.7, 0.4]))
        selector.set_roots(torch.tensor([5, 6]), torch.tensor([7, -1]))
        selector.options_for(2)  # options are built once per eps, before any capture
        return selector

    eager = make_selector()
    want = eager.organize(*tree, NDT)
    selector = make_selector()

    def step(score_list, token_list, parents_list):
        return selector.organize(score_list, token_list, parents_list, NDT)

    torch._dynamo.reset()
    try:
        compiled, recorder = compile_once(step, "aot_eager")
        got = compiled(*tree)
        assert len(recorder.graphs) == 1
    finally:
        torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(selector.verify_context, eager.verify_context)
    assert host_syncs(step, *tree) == []
    assert eager.block_predictor.timer.timed == 1  # the eager step was timed

    runtime = build_runtime(settings)
    try:
        roots, slots = torch.tensor([5, 6]), torch.tensor([0, 2])
        runtime.before_decode(
            SimpleNamespace(is_draft_input=lambda: True, bonus_tokens=roots), slots
        )
        _, _, draft = selection.organize_hook(None, *tree, NDT)
        verify_tokens = torch.cat([roots[:, None], draft], 1).flatten()
        capture_routing(runtime, verify_tokens)
        result = SimpleNamespace(
            accept_index=torch.tensor([[0, 1, -1], [4, 5, -1]], dtype=torch.int32),
            accept_lens=torch.tensor([2, 2], dtype=torch.int32),
        )
        reads = spy_on_host_reads(monkeypatch)
        from torch.utils._python_dispatch import TorchDispatchMode

        class Ops(TorchDispatchMode):
            names = []

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.names.append(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        with Ops() as ops:
            runtime.after_verify(SimpleNamespace(draft_token=verify_tokens), result, slots)
        monkeypatch.undo()
        assert reads == [] and not SYNC_OPS & set(ops.names), ops.names
        assert runtime.root_context.lookup(slots).tolist() == draft[:, 0].tolist()
    finally:
        runtime.close()
