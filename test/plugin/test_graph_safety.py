"""Graph safety and the per-step cost of the plugin's work (issue 14), proved on the CPU.

- The draft step's selection (``EcoSpecSelector.organize``, TP 1) and the routing capture
  hook trace as one graph each with ``torch.compile(fullgraph=True)`` (aot_eager), equal the
  eager call, and hold no host sync in a FakeTensor trace: what a CUDA graph captures.
- The work after each verify (finding 9) is a bounded number of kernels with no host sync,
  no host read of the device statistics, and no ``[T, L, E]`` float temporary in the
  statistics; the "EcoSpec:" line is copied asynchronously and logged once it has landed.
"""

import pytest
import torch
from _util import SYNC_OPS, compile_once, host_syncs
from sglang_ecospec import ep_placement, routing, selection
from sglang_ecospec.settings import EcoSpecSettings
from torch.utils._python_dispatch import TorchDispatchMode

from plugin._helpers import PUBLISHED, cpu_runtime, sglang_draft_tree, spy_on_host_reads
from sgl_ecospec.predictors import OnlineExpertPredictor

BATCH, TOPK, STEPS, NDT, L, E, K = 3, 3, 3, 8, 2, 16, 2
# After a verify, at most: statistics 9, the online predictor's update 10 (its multi-hot,
# hashing, tables), the "EcoSpec:" snapshot 2 (pinned buffer, copy). Before: 29 and a host
# read of the totals every log_interval steps.
AFTER_VERIFY_OPS = 21
# Calibrated acceptance (on by default) learning from SGLang's accept_index at this tree's 3
# draft steps: its own 10, the library's observe 53 (test_acceptance.py), its totals'
# snapshot 1.
ACCEPTANCE_OPS = 64
# The served defaults add: the recall-weighted cost's live recall (its update, cost fit and
# novel-expert counts, 135) and the score floor's copy check (11, and 2 that leave the copies
# out of the live recall).
RECALL_OPS = 135
COPY_CHECK_OPS = 13


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def learnt_predictor():
    predictor = OnlineExpertPredictor(L, E, K, num_buckets=64)
    tokens = torch.arange(60)
    ids = torch.stack([tokens % E, (tokens * 5 + 3) % E], 1)  # distinct per row
    predictor.observe(tokens, ids[:, None].expand(-1, L, -1).contiguous())
    return predictor


def make_selector(policy, ep, rows):
    placement = None
    if ep:
        placement = ep_placement.ExpertPlacement(ep_placement.EPLayout(ep_size=4), [0, 1], E, "cpu")
    selector = selection.EcoSpecSelector(
        EcoSpecSettings(policy=policy, log_interval=0),
        learnt_predictor(),
        topk=TOPK,
        num_draft_tokens=NDT,
        max_batch=4,
        device="cpu",
        placement=placement,
        score_rows=rows,
    )
    selector.set_roots(torch.tensor([1, 2, 3]))
    return selector


@pytest.mark.parametrize("policy", ["ecospec", "confidence"])
@pytest.mark.parametrize("ep", [False, True])
@pytest.mark.parametrize("rows", [None, 7])  # one prediction block, or blocks of 7 rows
def test_selection_step_compiles_as_one_graph(policy, ep, rows):
    tree = sglang_draft_tree(BATCH, TOPK, STEPS, seed=1)
    eager = make_selector(policy, ep, rows)
    want = eager.organize(*tree, NDT)
    selector = make_selector(policy, ep, rows)
    selector.options_for(BATCH)  # options are built once per eps, before any capture

    def step(score_list, token_list, parents_list):
        return selector.organize(score_list, token_list, parents_list, NDT)

    compiled, recorder = compile_once(step, "aot_eager")
    got = compiled(*tree)
    assert len(recorder.graphs) == 1 and recorder.calls_native()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(selector.verify_topk, eager.verify_topk)  # the persistent buffer
    assert host_syncs(step, *tree) == []
    # A new tree of the same shape replays the same graph.
    tree = sglang_draft_tree(BATCH, TOPK, STEPS, seed=2)
    again = compiled(*tree)
    assert len(recorder.graphs) == 1
    assert all(torch.equal(a, b) for a, b in zip(again, eager.organize(*tree, NDT), strict=True))


def test_routing_capture_compiles_as_one_graph():
    from types import SimpleNamespace

    config = SimpleNamespace(allow_routed_experts_capture=True)
    ids = torch.tensor([[1, 2, 9], [3, 4, 9], [5, 6, 9], [7, 8, 9], [0, 0, 9]])
    captures = [routing.RoutingCapture([0, 2], top_k=2, max_tokens=4, device="cpu") for _ in "ab"]

    def hook(topk_ids):
        return routing.after_capture("sglang's", config, 2, topk_ids)

    compiled, recorder = compile_once(hook, "aot_eager")
    for capture, fn in zip(captures, (hook, compiled), strict=True):
        routing.slot.activate(capture)
        try:
            assert fn(ids) == "sglang's"
            assert host_syncs(hook, ids) == []
        finally:
            routing.slot.activate(None)
    assert torch.equal(captures[0].buffer, captures[1].buffer)
    assert captures[1].buffer[:, 1].tolist() == [[1, 2], [3, 4], [5, 6], [7, 8]]
    routing.slot.activate(captures[1])
    try:
        compiled(ids + 10)  # a later layer call replays the same graph
    finally:
        routing.slot.activate(None)
    assert len(recorder.graphs) == 1 and captures[1].buffer[0, 1].tolist() == [11, 12]


class OpLog(TorchDispatchMode):
    """The aten ops that run (views excluded: they launch no kernel), with their outputs."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view:
            self.ops.append((func.overloadpacket.__name__, out))
        return out

    def names(self):
        return [name for name, _ in self.ops]


@pytest.mark.parametrize("rule", ["published", "defaults"])
def test_after_verify_is_a_few_kernels_without_host_sync(monkeypatch, rule):
    from types import SimpleNamespace

    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(num_hidden_layers=L, num_experts=E, num_experts_per_tok=K)
    published = PUBLISHED if rule == "published" else {}
    # A snapshot after every step.
    settings = EcoSpecSettings(log_interval=1, num_buckets=64, **published)
    bound = AFTER_VERIFY_OPS + ACCEPTANCE_OPS
    if settings.recall_weighted_cost:
        bound += RECALL_OPS
    if settings.min_score > 0:
        bound += COPY_CHECK_OPS
    runtime = cpu_runtime(settings, config, TOPK, NDT, num_steps=STEPS)
    reads = spy_on_host_reads(monkeypatch)
    try:
        tree = sglang_draft_tree(BATCH, TOPK, STEPS, seed=3)
        roots = torch.tensor([1, 2, 3])
        runtime.before_decode(SimpleNamespace(is_draft_input=lambda: True, bonus_tokens=roots))
        _, _, draft = selection.organize_hook(None, *tree, NDT)
        tokens = torch.cat([roots[:, None], draft], 1).flatten()  # [T], T = B * D
        runtime.before_verify()
        capture_config = SimpleNamespace(allow_routed_experts_capture=True)
        for layer in range(L):
            ids = torch.stack([(tokens + layer) % E, (tokens * 3 + 1 + layer) % E], 1)
            routing.after_capture(None, capture_config, layer, ids)
        # SGLang's verify result: each request's accepted verify rows, flat, root first.
        accept_index = torch.full((BATCH, STEPS + 1), -1, dtype=torch.int32)
        accept_index[:, :2] = torch.arange(BATCH)[:, None] * NDT + torch.tensor([0, 1])
        reads.clear()
        with OpLog() as log:
            runtime.after_verify(
                SimpleNamespace(draft_token=tokens), SimpleNamespace(accept_index=accept_index)
            )
        assert reads == []  # no host read of anything on the device
        assert not SYNC_OPS & set(log.names()), log.names()
        assert len(log.ops) <= bound, log.names()
        assert runtime.acceptance.calibrator.observe_calls == 1
        # The statistics alone: nothing of [T, L, E] and nothing in float.
        with OpLog() as stats_log:
            count = tokens.numel()
            predicted = runtime.selector.verify_topk[:count]
            runtime.stats.update(runtime.capture.verify_routing(count), predicted)
        assert not any(out.is_floating_point() for _, out in stats_log.ops)
        assert max(out.numel() for _, out in stats_log.ops) <= count * L * K * K
        assert runtime.summaries == []  # the line waits for SGLang's per-batch report
        runtime.poll_log()
        (summary,) = runtime.summaries
        assert summary["verify_steps"] == 1 and summary["verify_tokens_per_step"] == BATCH * NDT
        assert summary["accept_length"] == 2.0 and summary["forecast_accept_length"] > 1.0
    finally:
        runtime.close()


def test_ecospec_line_waits_for_its_copy_without_blocking():
    """On a GPU the snapshot lands when its event completes; ``ready`` never waits for it."""

    class Event:
        done = False

        def query(self):
            return self.done

    stats = routing.VerifyStats(8, "cpu", layer_ids=[0])
    window = stats.window()
    stats.update(torch.tensor([[[0, 1]], [[2, 1]]]), torch.tensor([[[0, 1]], [[5, 6]]]))
    window.request()
    event = Event()
    window._pending[-1] = window._pending[-1]._replace(event=event)  # as on a CUDA device
    assert window.pending_steps == 0 and window.ready() == []
    stats.update(torch.tensor([[[3, 4]]]), torch.tensor([[[3, 4]]]))
    window.request()  # the next snapshot is queued behind the first
    assert window.ready() == []
    event.done = True
    first, second = window.ready()
    assert first["unique_experts_per_layer"] == 3.0 and first["predictor_recall"] == 0.5
    assert second["verify_steps"] == 1 and second["predictor_recall"] == 1.0
