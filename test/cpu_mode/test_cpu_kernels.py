"""The CPU development mode's PyTorch versions of SGLang's shared-expert gate and draft
KV-list kernels (sglang_ecospec_cpu.kernels) against the Triton kernels. Without a GPU
the kernels run under Triton's interpreter, which must be switched on before triton is
imported, so that comparison runs in a fresh interpreter (:func:`compare_with_triton`)."""

import functools

import pytest
import torch
from _util import compared_under_interpreter, run_both
from sglang_ecospec_cpu import function_hooks, kernels

# --- shared-expert gate --------------------------------------------------------------------

GATE_CASES = [
    # name, tokens, hidden, dtype
    ("fp32", 5, 64, torch.float32),
    ("odd_hidden", 3, 100, torch.float32),
    ("one_token", 1, 48, torch.float32),
    ("bf16", 4, 96, torch.bfloat16),
    ("no_tokens", 0, 32, torch.float32),
]


def gate_inputs(case, seed=0):
    """(hidden_states [T, H], gate_weight [H], shared_output [T, H], final [T, H])."""
    _, tokens, hidden, dtype = case
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    return randn(tokens, hidden), randn(hidden) * 0.3, randn(tokens, hidden), randn(tokens, hidden)


def gate_tolerance(dtype):
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


# --- draft decode KV lists -----------------------------------------------------------------

DRAFT_CASES = [
    # name, seq lens, topk, steps, options
    ("chain_blocks", [5, 0, 130], 4, 3, {}),
    ("window_sink", [3, 20, 11, 9], 2, 3, dict(window_size=8, sink_size=2)),
    ("pages_branches", [6, 9, 4], 2, 3, dict(page_size=4)),
    ("pages_topk1", [7, 12], 1, 4, dict(page_size=4)),
    ("entry_pages_translate", [6, 13], 3, 2, dict(page_size=4, entry_page_size=4)),
    ("strided_table_int64_positions", [10, 3, 17], 2, 2, dict(strided=True, random_positions=True)),
    ("num_steps_blocks", [600, 7], 2, 3, dict(num_steps_blocks=2)),
]


def next_power_of_2(n):
    return 1 << max(n - 1, 0).bit_length()


def draft_inputs(case, seed=0):
    """Arguments and keyword arguments of one ``generate_draft_decode_kv_indices`` launch,
    and its grid. Table rows are distinct random ids so that a wrong address shows; the
    output buffers start at -7 so that a write to the wrong cell shows."""
    _, seq_lens, topk, steps, options = case
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    page_size = options.get("page_size", 1)
    entry_page_size = options.get("entry_page_size", 1)
    # room for the prefix and every branch's draft pages
    width = max(seq_lens) + topk * (steps + 2 * page_size) + page_size
    width = (width + entry_page_size - 1) // entry_page_size * entry_page_size
    pool_rows = batch + 2
    v2p = None
    if entry_page_size == 1:
        table = torch.randperm(pool_rows * width * 2, generator=gen)[: pool_rows * width]
        table = table.view(pool_rows, width).int()
    else:
        # page-granular rows of virtual page ids, mapped to physical pages by v2p; one -1
        # entry (a sink) in a row that is read
        entries = width // entry_page_size
        virtual_pages = pool_rows * entries
        table = torch.randperm(virtual_pages, generator=gen).view(pool_rows, entries).int()
        v2p = (torch.randperm(virtual_pages * 2, generator=gen)[:virtual_pages] + 1).int()
    req_pool_indices = torch.randperm(pool_rows, generator=gen)[:batch].int()
    if entry_page_size > 1:
        table[req_pool_indices[0], 0] = -1
    if options.get("strided"):
        wide = torch.randint(0, 10**6, (pool_rows, width + 5), generator=gen, dtype=torch.int32)
        wide[:, :width] = table
        table = wide[:, :width]  # rows width + 5 apart
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    positions = lens.repeat_interleave(topk)
    if options.get("random_positions"):
        positions = torch.randint(0, 50, (batch * topk,), generator=gen)
    max_list = (sum(seq_lens) + batch * steps) * topk
    kv_indices = torch.full((steps, max_list + 3), -7, dtype=torch.int32)
    kv_indptr = torch.full((steps, batch * topk + 2), -7, dtype=torch.int32)
    num_steps = 0
    grid = (steps, batch, topk)
    if options.get("num_steps_blocks"):
        num_steps = steps
        grid = (steps * options["num_steps_blocks"], batch, topk)
    args = [
        req_pool_indices,
        table,
        lens,
        kv_indices,
        kv_indptr,
        positions,
        table.stride(0),
        kv_indices.shape[1],
        kv_indptr.shape[1],
        next_power_of_2(batch),
        next_power_of_2(steps),
        next_power_of_2(batch * topk),
        page_size,
        options.get("window_size", 0),
        options.get("sink_size", 0),
    ]
    kwargs = dict(
        NUM_STEPS=num_steps,
        ENTRY_PAGE_SIZE=entry_page_size,
        v2p=v2p,
        TRANSLATE=v2p is not None,
    )
    return args, kwargs, grid


# --- speculative relay gather ------------------------------------------------------------

GATHER_CASES = [
    # name, buffer rows, gathered rows, with hidden states
    ("hidden", 6, 4, True),
    ("no_hidden", 5, 3, False),
    ("repeated_rows", 4, 5, True),
    ("no_rows", 4, 0, True),
]


def gather_inputs(case, seed=0):
    """(indices int64 [M], topk_p [R, 4] float, topk_index [R, 4] int64, tokens [R] int32,
    hidden [R, 24] bf16 or None)."""
    _, rows, gathered, has_hidden = case
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, rows, (gathered,), generator=gen)
    hidden = torch.randn(rows, 24, generator=gen).to(torch.bfloat16) if has_hidden else None
    return (
        indices,
        torch.rand(rows, 4, generator=gen),
        torch.randint(0, 1000, (rows, 4), generator=gen),
        torch.randint(0, 1000, (rows,), generator=gen, dtype=torch.int32),
        hidden,
    )


def compare_with_triton() -> int:
    """Runs every case through SGLang's Triton kernel and the PyTorch version and asserts
    that they write the same tensors. Needs ``TRITON_INTERPRET=1`` from process start on a
    machine without a GPU. Returns the number of cases compared."""
    from sglang.kernels.ops.elementwise import elementwise
    from sglang.kernels.ops.speculative import cache_locs

    compared = 0
    for case in GATE_CASES:
        hidden, weight, shared, final = gate_inputs(case)
        ours_final = final.clone()
        elementwise.fused_gate_sigmoid_mul_add(hidden, weight, shared, final)
        kernels.fused_gate_sigmoid_mul_add(hidden, weight, shared, ours_final)
        tol = gate_tolerance(case[3])
        torch.testing.assert_close(ours_final, final, **tol, msg=f"gate add {case[0]}")
        theirs = elementwise.fused_gate_sigmoid_mul(hidden, weight, shared)
        ours = kernels.fused_gate_sigmoid_mul(hidden, weight, shared)
        torch.testing.assert_close(ours, theirs, **tol, msg=f"gate mul {case[0]}")
        compared += 1
    for case in DRAFT_CASES:
        args, kwargs, grid = draft_inputs(case)
        theirs = cache_locs.generate_draft_decode_kv_indices[grid]
        ours = functools.partial(kernels.generate_draft_decode_kv_indices, grid=grid)
        ours_args, _ = run_both(theirs, ours, args, kwargs, contiguous_only=True)
        assert torch.equal(ours_args[3], args[3]), f"kv_indices {case[0]}"
        assert torch.equal(ours_args[4], args[4]), f"kv_indptr {case[0]}"
        compared += 1
    from sglang.kernels.ops.speculative.gather_spec_extras import gather_spec_extras

    for case in GATHER_CASES:
        inputs = gather_inputs(case)
        theirs, ours = gather_spec_extras(*inputs), kernels.gather_spec_extras(*inputs)
        for name, a, b in zip(
            ("topk_p", "topk_index", "tokens", "hidden"), ours, theirs, strict=True
        ):
            assert (a is None) == (b is None), f"{name} {case[0]}"
            if a is not None:
                assert a.dtype == b.dtype and torch.equal(a, b), f"{name} {case[0]}"
        compared += 1
    return compared


@pytest.mark.slow  # Triton interpreter, about 15 s
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs without a GPU")
def test_pytorch_versions_match_the_triton_kernels_under_the_interpreter():
    cases = len(GATE_CASES) + len(DRAFT_CASES) + len(GATHER_CASES)
    assert compared_under_interpreter(__file__) == cases


# --- plain PyTorch checks (no Triton) ------------------------------------------------------


def test_gate_matches_a_per_token_formula():
    hidden, weight, shared, final = gate_inputs(GATE_CASES[1], seed=2)
    expected = final.clone()
    for t in range(hidden.shape[0]):
        gate = 1.0 / (1.0 + torch.exp(-(hidden[t] * weight).sum()))
        expected[t] += gate * shared[t]
    kernels.fused_gate_sigmoid_mul_add(hidden, weight, shared, final)
    torch.testing.assert_close(final, expected, atol=1e-5, rtol=1e-5)


def test_draft_kv_lists_for_one_request_by_hand():
    # one request of 3 tokens in row 1, topk 2, 2 steps, token ids = 100 + position
    table = torch.arange(2 * 16, dtype=torch.int32).view(2, 16) + 100 - 16
    kv_indices = torch.full((2, 12), -1, dtype=torch.int32)
    kv_indptr = torch.full((2, 4), -1, dtype=torch.int32)
    args = [torch.tensor([1]), table, torch.tensor([3]), kv_indices, kv_indptr]
    args += [torch.tensor([3, 3]), 16, 12, 4, 1, 2, 2, 1]
    kernels.generate_draft_decode_kv_indices(*args, grid=(2, 1, 2))
    # step 0: each branch reads the prefix and its first draft token (branch k's draft
    # tokens sit at positions 3 + k * steps ...)
    assert kv_indices[0].tolist() == [100, 101, 102, 103, 100, 101, 102, 105] + [-1] * 4
    assert kv_indices[1].tolist() == [100, 101, 102, 103, 104, 100, 101, 102, 105, 106, -1, -1]
    # kv_indptr[s, z] = sum(positions[:z]) + z * (s + 1); z = 0's program writes z = B * K
    assert kv_indptr.tolist() == [[-1, 4, 8, -1], [-1, 5, 10, -1]]


def test_draft_kv_lists_keep_sink_and_window():
    args, kwargs, grid = draft_inputs(DRAFT_CASES[1])
    kernels.generate_draft_decode_kv_indices(*args, **kwargs, grid=grid)
    req_pool_indices, table, kv_indices = args[0], args[1], args[3]
    # request 1 has 20 tokens; window 8 + sink 2: positions 0, 1 then 12..19
    row = table[req_pool_indices[1]]
    start = min(3, 10) * 2 + 1 * 1 * 2  # step 0: earlier lens * K + b * iters * K
    expected = torch.cat([row[:2], row[12:20], row[20:21]])
    assert torch.equal(kv_indices[0, start : start + 11], expected)


def test_gate_hook_runs_pytorch_on_cpu_and_triton_otherwise():
    calls = []

    def original(*args):
        calls.append(len(args))

    hook = function_hooks.around_hook(
        "fused_gate_sigmoid_mul_add",
        kernels.fused_gate_sigmoid_mul_add,
        kernels.gate_fallback_reason,
    )
    hidden, weight, shared, final = gate_inputs(GATE_CASES[0])
    before = final.clone()
    hook(original, hidden, weight, shared, final)
    assert calls == [] and not torch.equal(final, before)
    hook(original, hidden.t(), weight, shared, final)  # non-contiguous: Triton's assert
    assert calls == [4]


def test_launch_hook_covers_launches_and_passes_warmup_and_other_devices_on():
    runs = []

    def original_run(*args, grid, warmup, **kwargs):
        runs.append((grid, warmup, sorted(kwargs)))

    hook = kernels._launch_hook(
        "generate_draft_decode_kv_indices",
        kernels.generate_draft_decode_kv_indices,
        kernels.draft_kv_indices_fallback_reason,
    )
    args, kwargs, grid = draft_inputs(DRAFT_CASES[0])
    hook(original_run, *args, grid=grid, warmup=False, num_warps=4, **kwargs)
    assert runs == [] and int(args[3][0, 0]) != -7
    hook(original_run, *args, grid=grid, warmup=True, **kwargs)
    hook(original_run, *args, grid=lambda meta: grid, warmup=False, **kwargs)
    assert [warmup for _, warmup, _ in runs] == [True, False]


def test_gather_takes_the_rows_of_every_buffer():
    indices, topk_p, topk_index, tokens, hidden = gather_inputs(GATHER_CASES[2])
    out = kernels.gather_spec_extras(indices, topk_p, topk_index, tokens, hidden)
    for row, source in enumerate(indices.tolist()):
        assert torch.equal(out[0][row], topk_p[source]) and torch.equal(out[3][row], hidden[source])
        assert out[1][row].tolist() == topk_index[source].tolist()
        assert out[2][row] == tokens[source] and out[2].dtype == torch.int32
    assert kernels.gather_spec_extras(indices, topk_p, topk_index, tokens, None)[3] is None
    assert kernels.gather_fallback_reason(indices, topk_p, topk_index, tokens, None) is None
    meta = topk_p.to("meta")
    assert kernels.gather_fallback_reason(indices, meta, topk_index, tokens, None)


def test_fallback_reasons():
    hidden, weight, shared, final = gate_inputs(GATE_CASES[0])
    assert kernels.gate_fallback_reason(hidden, weight, shared, final) is None
    assert kernels.gate_fallback_reason(hidden, weight, shared) is None
    assert kernels.gate_fallback_reason(hidden.to("meta"), weight, shared)
    assert kernels.gate_fallback_reason(hidden, weight[:-1], shared)
    assert kernels.gate_fallback_reason(hidden, weight, shared, final[:-1])
    args, kwargs, grid = draft_inputs(DRAFT_CASES[0])
    reason = kernels.draft_kv_indices_fallback_reason
    assert reason(*args[:2], *args[3:5], grid=grid) is None
    assert reason(*args[:2], args[3].to("meta"), args[4], grid=grid)
    assert reason(*args[:2], *args[3:5], grid=(3, 3, 4), NUM_STEPS=2)
    assert reason(*args[:2], *args[3:5], grid=[3, 3, 4])


def test_register_hooks_targets_the_gate_functions_and_the_kernel_run(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    registered = []
    monkeypatch.setattr(
        HookRegistry, "register", classmethod(lambda cls, *a, **k: registered.append(a))
    )
    expected = [
        kernels.GATE_MUL_ADD_TARGET,
        kernels.GATE_MUL_TARGET,
        kernels.GATHER_SPEC_EXTRAS_TARGET,
        kernels.DRAFT_KV_INDICES_KERNEL + ".run",
    ]
    assert kernels.register_hooks() == expected
    assert [(target, kind) for target, _, kind in registered] == [
        (target, HookType.AROUND) for target in expected
    ]


def test_a_kernel_with_other_parameters_keeps_triton():
    other = "sglang.kernels.ops.speculative.cache_locs.generate_draft_decode_window_kv_indices"
    assert not kernels._same_kernel_parameters(other, kernels.generate_draft_decode_kv_indices)
    assert kernels._same_kernel_parameters(
        kernels.DRAFT_KV_INDICES_KERNEL, kernels.generate_draft_decode_kv_indices
    )
