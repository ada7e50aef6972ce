"""ECOSPEC's device memory (issue 14, finding 7): the footprint computed up front is what the
runtime allocates, bounds the per-step temporaries, and the selector predicts in blocks.
Measured with the CPU allocator's events (the profiler's memory records), which also see the
native ops' own allocations.

Where the footprint is reserved in SGLang's order is tested with SGLang's own scheduler code
in test_algorithm.py."""

import gc
from types import SimpleNamespace

import pytest
import torch
from sglang_ecospec import acceptance, ep_placement, memory, routing, selection
from sglang_ecospec.settings import EcoSpecSettings

from plugin._helpers import PUBLISHED, sglang_draft_tree

L, E, K = 4, 64, 4  # MoE layers, experts, top-k of the served model
BATCH, TOPK, STEPS, NDT = 5, 4, 3, 8  # largest batch and the draft tree (36 candidates)
SHAPE = memory.ModelShape(L, E, K)
# The served defaults (recall-weighted cost, score floor) and the published rule.
SETTINGS = {
    "defaults": EcoSpecSettings(log_interval=1, num_buckets=256),
    "published": EcoSpecSettings(log_interval=1, num_buckets=256, **PUBLISHED),
}


def allocations(fn):
    """``fn()``'s result, the bytes it left allocated and the peak above the start."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # garbage of earlier tests is not freed inside the window
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
        gc.collect()
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return result, live, peak


@pytest.fixture(params=sorted(SETTINGS))
def settings(request):
    return SETTINGS[request.param]


def build_runtime(settings, **kwargs):
    from sglang_ecospec.runtime import EcoSpecRuntime
    from transformers import Qwen2MoeConfig

    config = Qwen2MoeConfig(num_hidden_layers=L, num_experts=E, num_experts_per_tok=K)
    return EcoSpecRuntime(
        settings,
        config,
        topk=TOPK,
        num_draft_tokens=NDT,
        num_steps=STEPS,
        max_batch=BATCH,
        device="cpu",
        ep_layout=ep_placement.EPLayout(ep_size=2),
        **kwargs,
    )


def test_computed_footprint_is_what_the_runtime_allocates(settings):
    build_runtime(settings).close()  # first use of every module out of the way
    runtime, kept, _ = allocations(lambda: build_runtime(settings))
    try:
        usage = runtime.memory
        assert kept == usage.persistent  # every tensor the runtime keeps, counted exactly
        assert usage.predictor == (256 + 1) * L * E * 4  # the online table and its prior
        # Up front, from the settings and the model's shape alone: the same numbers.
        assert usage == memory.plugin_memory_bytes(
            settings,
            SHAPE,
            max_batch=BATCH,
            num_draft_tokens=NDT,
            topk=TOPK,
            num_steps=STEPS,
            ep_placement=True,
        )
    finally:
        runtime.close()
    with pytest.raises(ValueError, match="pass the built predictor"):
        memory.plugin_memory_bytes(
            EcoSpecSettings(predictor="online", predictor_file=__file__),
            SHAPE,
            max_batch=1,
            num_draft_tokens=2,
            topk=2,
            num_steps=1,
        )


def test_step_temporaries_stay_within_the_estimate(settings):
    """The largest batch's selection and after-verify temporaries, measured, lie under the
    estimate, which is not loose (within 1.5x)."""
    runtime = build_runtime(settings)
    try:
        tree = sglang_draft_tree(BATCH, TOPK, STEPS, seed=0)
        roots = torch.arange(BATCH)
        runtime.before_decode(SimpleNamespace(is_draft_input=lambda: True, bonus_tokens=roots))
        (_, _, draft), _, selection_peak = allocations(
            lambda: selection.organize_hook(None, *tree, NDT)
        )
        tokens = torch.cat([roots[:, None], draft], 1).flatten()
        gen = torch.Generator().manual_seed(0)
        runtime.before_verify()
        config = SimpleNamespace(allow_routed_experts_capture=True)
        for layer in range(L):
            ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in tokens])
            routing.after_capture(None, config, layer, ids)
        # SGLang's accepted paths (flat verify rows, root first): calibrated acceptance learns.
        accept_index = torch.full((BATCH, STEPS + 1), -1, dtype=torch.int32)
        accept_index[:, :2] = torch.arange(BATCH)[:, None] * NDT + torch.tensor([0, 1])
        result = SimpleNamespace(accept_index=accept_index)
        _, _, verify_peak = allocations(
            lambda: runtime.after_verify(SimpleNamespace(draft_token=tokens), result)
        )
        assert runtime.acceptance.calibrator.observe_calls == 1
    finally:
        runtime.close()
    tree_args = {"batch": BATCH, "num_draft_tokens": NDT}
    calibration = {"batch": BATCH, "topk": TOPK, "num_steps": STEPS}
    selection_bound = memory.selection_step_bytes(
        SHAPE, topk=TOPK, num_steps=STEPS, **tree_args
    ) + acceptance.draft_step_bytes(num_draft_tokens=NDT, **calibration)
    verify_bound = memory.after_verify_bytes(
        SHAPE, live_recall=settings.recall_weighted_cost, **tree_args
    )
    verify_bound += acceptance.after_verify_bytes(**calibration)
    assert selection_peak <= selection_bound <= 1.5 * selection_peak
    assert verify_peak <= verify_bound <= 1.5 * verify_peak
    assert runtime.memory.step == selection_bound + verify_bound


def test_prediction_in_blocks_bounds_scoring_and_selects_the_same():
    runtime = build_runtime(SETTINGS["defaults"])
    try:
        tree = sglang_draft_tree(BATCH, TOPK, STEPS, seed=1)
        spec_info = SimpleNamespace(is_draft_input=lambda: True, bonus_tokens=torch.arange(5))
        results, peaks = [], []
        for rows in (None, 17):  # one block (185 rows), then blocks of 17
            if rows is not None:
                runtime.selector.block_predictor.rows = rows
            runtime.before_decode(spec_info)
            got, _, peak = allocations(lambda: selection.organize_hook(None, *tree, NDT))
            results.append([*got, runtime.selector.verify_topk.clone()])
            peaks.append(peak)
    finally:
        runtime.close()
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    assert peaks[1] * 3 < peaks[0]  # the [rows, L, E] float scoring dominated the step
    # Served shapes: a block's two float [rows, L, E] stay within SCORE_CHUNK_BYTES.
    for shape in (memory.ModelShape(94, 128, 8), memory.ModelShape(58, 256, 8)):
        rows = memory.score_chunk_rows(shape)
        assert 2 * rows * shape.num_layers * shape.num_experts * 4 <= memory.SCORE_CHUNK_BYTES
        assert 2 * (rows + 1) * shape.num_layers * shape.num_experts * 4 > memory.SCORE_CHUNK_BYTES


def test_footprint_of_a_served_model_and_its_log_line():
    """Qwen3-235B-A22B's shape (94 MoE layers, 128 experts, top-8) at SGLang's EAGLE default
    of 48 running requests, topk 4, 3 steps, 8 draft tokens: the 4096-bucket table is the
    ~200 MB of the finding, and blocks keep the scoring within the 64 MiB cap: the step's
    temporaries are 120 MiB with the published rule, 140 MiB with the recall-weighted cost's
    update (the default), which holds its own [T, L, E] multi-hot and per-request counts."""
    usage = memory.plugin_memory_bytes(
        EcoSpecSettings(),
        memory.ModelShape(94, 128, 8),
        max_batch=49,
        num_draft_tokens=8,
        topk=4,
        num_steps=3,
    )
    assert usage.predictor == 4097 * 94 * 128 * 4
    assert usage.step < 144 * memory.MIB and usage.buffers < 4 * memory.MIB
    published = memory.plugin_memory_bytes(
        EcoSpecSettings(**PUBLISHED),
        memory.ModelShape(94, 128, 8),
        max_batch=49,
        num_draft_tokens=8,
        topk=4,
        num_steps=3,
    )
    assert published.step < 128 * memory.MIB < usage.step
    line = usage.describe()
    assert line.startswith(f"ECOSPEC reserves {usage.total / memory.MIB:.1f} MiB: predictor ")
    assert "MiB, buffers " in line and "MiB, per-step temporaries " in line
    reservation = memory.Reservation(usage.step, "cpu")  # on a GPU: a placeholder tensor
    assert reservation.held
    reservation.release()
    reservation.release()
    assert not reservation.held
