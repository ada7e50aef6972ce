"""The CPU development mode's PyTorch attention (sglang_ecospec_cpu.attention) against
SGLang's Triton kernels. Without a GPU the kernels run under Triton's interpreter, which must
be switched on before triton is imported, so that comparison runs in a fresh interpreter
(:func:`compare_with_triton`)."""

import pytest
import torch
from _util import compared_under_interpreter, run_both
from sglang_ecospec_cpu import attention, function_hooks

TOL = dict(atol=1e-4, rtol=1e-4)


def paged_pool(lengths, kv_heads, dim, dim_v, gen, spare=7):
    """A KV pool whose slots are shuffled over the requests: (k_buffer [slots, Hkv, D],
    v_buffer [slots, Hkv, Dv], kv_indptr int32 [B+1], kv_indices int32, one list per
    request). ``spare`` unused slots make the pool larger than the lists."""
    total = sum(lengths)
    slots = total + spare
    k_buffer = torch.randn(slots, kv_heads, dim, generator=gen)
    v_buffer = torch.randn(slots, kv_heads, dim_v, generator=gen)
    kv_indices = (torch.randperm(slots - 1, generator=gen)[:total] + 1).int()
    kv_indptr = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.tensor(lengths).cumsum(0)
    return k_buffer, v_buffer, kv_indptr, kv_indices


def pool_and_queries(lengths, rows, heads, kv_heads, dim, seed):
    """A generator seeded ``seed``, then drawn from it in this order: a :func:`paged_pool`
    over ``lengths`` (keys and values ``dim`` wide) and ``rows`` queries [rows, heads, dim]."""
    gen = torch.Generator().manual_seed(seed)
    pool = paged_pool(lengths, kv_heads, dim, dim, gen)
    return gen, pool, torch.randn(rows, heads, dim, generator=gen)


def tree_mask(prefix_lens, extend_lens, gen, prefix_density=1.0):
    """A FULL_MASK-layout custom mask (int8, flat) and its mask_indptr (int32 [B+1]): per
    request E rows of P + E cells; each new token sees itself and a random subset of the
    earlier new tokens (a tree is such a subset); prefix cells are 1 with probability
    ``prefix_density``."""
    rows, indptr = [], [0]
    for p, e in zip(prefix_lens, extend_lens, strict=True):
        prefix = (torch.rand(e, p, generator=gen) < prefix_density).to(torch.int8)
        own = (torch.rand(e, e, generator=gen) < 0.5).to(torch.int8).tril(-1)
        own += torch.eye(e, dtype=torch.int8)
        rows.append(torch.cat([prefix, own], dim=1).flatten())
        indptr.append(indptr[-1] + e * (p + e))
    return torch.cat(rows), torch.tensor(indptr, dtype=torch.int32)


# --- decode ------------------------------------------------------------------------------

DECODE_CASES = [
    # name, lengths, heads, kv_heads, dim, max splits, options
    ("gqa", [1, 7, 33, 100, 64], 6, 2, 64, 4, {}),
    ("mha_odd_dim", [5, 70, 31], 4, 4, 48, 3, {}),
    (
        "cap_sink_scales_xai",
        [3, 90, 40],
        6,
        3,
        64,
        4,
        dict(logit_cap=2.0, sinks=True, k_scale=0.7, v_scale=1.3, xai_temperature_len=20),
    ),
    ("one_split", [12, 65], 9, 3, 64, 1, {}),
]


def decode_inputs(case, seed=0):
    _, lengths, heads, kv_heads, dim, splits, options = case
    batch = len(lengths)
    gen, pool, q = pool_and_queries(lengths, batch, heads, kv_heads, dim, seed)
    k_buffer, v_buffer, kv_indptr, kv_indices = pool
    num_kv_splits = torch.randint(1, splits + 1, (batch,), generator=gen, dtype=torch.int32)
    # one spare row: neither implementation may write past the batch
    attn_logits = torch.full((batch + 1, heads, splits, dim), 7.0)
    attn_lse = torch.full((batch + 1, heads, splits), 7.0)
    o = torch.full((batch, heads, dim), 7.0)
    sinks = torch.randn(heads, generator=gen) if options.get("sinks") else None
    kwargs = dict(
        logit_cap=options.get("logit_cap", 0.0),
        sinks=sinks,
        xai_temperature_len=options.get("xai_temperature_len", -1),
    )
    args = [
        q,
        k_buffer,
        v_buffer,
        o,
        kv_indptr,
        kv_indices,
        attn_logits,
        attn_lse,
        num_kv_splits,
        splits,
        dim**-0.5,
        options.get("k_scale", 1.0),
        options.get("v_scale", 1.0),
    ]
    return args, kwargs


def decode_outputs(args):
    """The tensors decode_attention_fwd writes: o, attn_logits, attn_lse."""
    return args[3], args[6], args[7]


# --- extend ------------------------------------------------------------------------------

EXTEND_CASES = [
    # name, prefix lens, extend lens, heads, kv_heads, dim, options
    ("causal", [0, 10, 37], [5, 1, 9], 6, 2, 64, {}),
    ("tree_mask", [12, 70, 3], [5, 5, 4], 9, 3, 64, dict(mask=True)),
    (
        "prefix_mask_lse",
        [8, 20],
        [4, 6],
        4,
        2,
        64,
        dict(mask=True, prefix_density=0.6, skip_prefix_custom_mask=False, lse=True),
    ),
    ("non_causal_odd_dim", [6, 0, 15], [3, 7, 2], 4, 4, 48, dict(causal=False)),
    ("window", [40, 9], [6, 3], 6, 2, 64, dict(window=8)),
    (
        "cap_sink_scales_xai_lse",
        [30, 4],
        [5, 3],
        6,
        3,
        64,
        dict(logit_cap=3.0, sinks=True, k_scale=0.8, v_scale=1.2, xai=10, lse=True),
    ),
    ("skip_extend_lse", [9, 0, 5], [2, 3, 1], 4, 2, 64, dict(skip_extend=True, lse=True)),
    # Every request extends by the same rows: the batched path (extend_batched).
    ("uniform_tree_mask_lse", [12, 70, 0, 3], [5, 5, 5, 5], 9, 3, 64, dict(mask=True, lse=True)),
    ("uniform_one_row", [31, 1, 64], [1, 1, 1], 6, 2, 64, dict(mask=True)),
    ("uniform_causal", [0, 10, 37], [4, 4, 4], 6, 2, 64, {}),
    (
        "uniform_non_causal_cap_sink_scales_lse",
        [6, 0, 15],
        [3, 3, 3],
        4,
        4,
        48,
        dict(causal=False, logit_cap=3.0, sinks=True, k_scale=0.8, v_scale=1.2, lse=True),
    ),
]
UNIFORM = [case for case in EXTEND_CASES if case[0].startswith("uniform")]


def windowed_kwargs(options, heads, dim, gen):
    """The keyword arguments the extend and unified kernels share, from a case's options
    (the sinks drawn from ``gen``)."""
    return dict(
        sm_scale=dim**-0.5,
        logit_cap=options.get("logit_cap", 0.0),
        sliding_window_size=options.get("window", -1),
        sinks=torch.randn(heads, generator=gen) if options.get("sinks") else None,
        xai_temperature_len=options.get("xai", -1),
    )


def extend_inputs(case, seed=0):
    _, prefix_lens, extend_lens, heads, kv_heads, dim, options = case
    tokens = sum(extend_lens)
    gen, pool, q = pool_and_queries(prefix_lens, tokens, heads, kv_heads, dim, seed)
    k_buffer, v_buffer, kv_indptr, kv_indices = pool
    k = torch.randn(tokens, kv_heads, dim, generator=gen)
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    o = torch.full((tokens, heads, dim), 7.0)
    qo_indptr = torch.zeros(len(extend_lens) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.tensor(extend_lens).cumsum(0)
    mask, mask_indptr = None, None
    if options.get("mask"):
        mask, mask_indptr = tree_mask(
            prefix_lens, extend_lens, gen, options.get("prefix_density", 1.0)
        )
    lse = torch.full((tokens, heads), 7.0) if options.get("lse") else None
    args = [
        q,
        k,
        v,
        o,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        mask,
        options.get("causal", True),
        mask_indptr,
        max(extend_lens),
        options.get("k_scale", 1.0),
        options.get("v_scale", 1.0),
    ]
    kwargs = dict(
        windowed_kwargs(options, heads, dim, gen),
        skip_prefix_custom_mask=options.get("skip_prefix_custom_mask", True),
        lse_extend=lse,
        skip_extend=options.get("skip_extend", False),
    )
    return args, kwargs


def extend_outputs(args, kwargs):
    return args[3], kwargs["lse_extend"]


UNIFIED_CASES = [
    # name, prefix lens, extend lens, heads, kv_heads, dim, options
    ("causal", [0, 11, 40], [4, 1, 7], 6, 2, 64, {}),
    ("tree_mask_odd_dim", [9, 25], [5, 4], 4, 2, 48, dict(mask=True)),
    ("window_sink_cap", [30, 5], [4, 3], 6, 3, 64, dict(window=6, sinks=True, logit_cap=2.5)),
    ("non_causal_scales_xai", [7, 3], [3, 5], 4, 4, 64, dict(causal=False, xai=4, v_scale=1.5)),
]


def unified_inputs(case, seed=0):
    _, prefix_lens, extend_lens, heads, kv_heads, dim, options = case
    lengths = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    tokens = sum(extend_lens)
    gen, pool, q = pool_and_queries(lengths, tokens, heads, kv_heads, dim, seed)
    k_buffer, v_buffer, kv_indptr, kv_indices = pool
    o = torch.full((tokens, heads, dim), 7.0)
    qo_indptr = torch.zeros(len(extend_lens) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.tensor(extend_lens).cumsum(0)
    kwargs = dict(windowed_kwargs(options, heads, dim, gen), is_causal=options.get("causal", True))
    if options.get("mask"):
        # the unified mask has E rows of N = P + E cells: the FULL_MASK layout
        kwargs["custom_mask"], kwargs["mask_indptr"] = tree_mask(prefix_lens, extend_lens, gen)
    if options.get("window"):
        kwargs["window_start_pos"] = torch.randint(0, 50, (len(lengths),), generator=gen)
    args = [
        q,
        o,
        k_buffer,
        v_buffer,
        options.get("k_scale", 1.0),
        options.get("v_scale", 1.0),
        qo_indptr,
        kv_indptr,
        kv_indices,
        torch.tensor(prefix_lens, dtype=torch.int32),
        max(extend_lens),
    ]
    return args, kwargs


def assert_outputs_close(names, theirs, ours, label):
    for name, expected, actual in zip(names, theirs, ours, strict=True):
        torch.testing.assert_close(actual, expected, **TOL, msg=f"{label} {name}")


def compare_with_triton() -> int:
    """Runs every case through SGLang's Triton kernel and the PyTorch version and asserts
    that they write the same tensors. Needs ``TRITON_INTERPRET=1`` from process start on a
    machine without a GPU. Returns the number of cases compared."""
    from sglang.kernels.ops.attention import decode_attention, extend_attention

    compared = 0
    for case in DECODE_CASES:
        args, kwargs = decode_inputs(case)
        theirs, ours = decode_attention.decode_attention_fwd, attention.decode_attention_fwd
        ours_args, _ = run_both(theirs, ours, args, kwargs)
        names = ("o", "attn_logits", "attn_lse")
        label = f"decode {case[0]}"
        assert_outputs_close(names, decode_outputs(args), decode_outputs(ours_args), label)
        compared += 1
    for case in EXTEND_CASES:
        args, kwargs = extend_inputs(case)
        theirs, ours = extend_attention.extend_attention_fwd, attention.extend_attention_fwd
        ours_args, ours_kwargs = run_both(theirs, ours, args, kwargs)
        expected = extend_outputs(args, kwargs)
        actual = extend_outputs(ours_args, ours_kwargs)
        assert_outputs_close(("o", "lse"), expected, actual, f"extend {case[0]}")
        compared += 1
    for case in UNIFIED_CASES:
        args, kwargs = unified_inputs(case)
        theirs = extend_attention.extend_attention_fwd_unified
        ours_args, _ = run_both(theirs, attention.extend_attention_fwd_unified, args, kwargs)
        torch.testing.assert_close(ours_args[1], args[1], **TOL, msg=f"unified {case[0]}")
        compared += 1
    return compared


@pytest.mark.slow  # Triton interpreter, about 20 s
@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs without a GPU")
def test_pytorch_versions_match_the_triton_kernels_under_the_interpreter():
    assert compared_under_interpreter(__file__) == len(DECODE_CASES) + len(EXTEND_CASES) + len(
        UNIFIED_CASES
    )


# --- plain PyTorch checks (no Triton) ------------------------------------------------------


def naive_attention(q, k, v, allowed, sm_scale):
    """softmax(q k^T * scale) v over the allowed keys of one query head: q [D], k [N, D],
    v [N, Dv], allowed [N] bool."""
    scores = (k @ q) * sm_scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, 0) @ v


def test_decode_matches_a_per_row_softmax():
    args, kwargs = decode_inputs(DECODE_CASES[0], seed=3)
    q, k_buffer, v_buffer, o, kv_indptr, kv_indices = args[:6]
    attention.decode_attention_fwd(*args, **kwargs)
    group = q.shape[1] // k_buffer.shape[1]
    for b in range(q.shape[0]):
        loc = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        for h in range(q.shape[1]):
            keys, values = k_buffer[loc, h // group], v_buffer[loc, h // group]
            expected = naive_attention(
                q[b, h], keys, values, torch.ones(len(loc), dtype=torch.bool), args[10]
            )
            torch.testing.assert_close(o[b, h], expected, **TOL)


def test_extend_with_tree_mask_matches_a_per_query_softmax():
    case = EXTEND_CASES[1]
    args, kwargs = extend_inputs(case, seed=5)
    q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, mask, _, mask_indptr = args[
        :12
    ]
    attention.extend_attention_fwd(*args, **kwargs)
    group = q.shape[1] // k.shape[1]
    for b, (p, e) in enumerate(zip(case[1], case[2], strict=True)):
        loc = kv_indices[kv_indptr[b] : kv_indptr[b + 1]].long()
        rows = mask[mask_indptr[b] : mask_indptr[b + 1]].view(e, p + e).bool()
        for i in range(e):
            t = int(qo_indptr[b]) + i
            for h in range(q.shape[1]):
                kh = h // group
                keys = torch.cat([k_buffer[loc, kh], k[qo_indptr[b] : qo_indptr[b + 1], kh]])
                values = torch.cat([v_buffer[loc, kh], v[qo_indptr[b] : qo_indptr[b + 1], kh]])
                expected = naive_attention(q[t, h], keys, values, rows[i], kwargs["sm_scale"])
                torch.testing.assert_close(o[t, h], expected, **TOL)


@pytest.mark.parametrize("case", UNIFORM, ids=[case[0] for case in UNIFORM])
def test_batched_extend_matches_the_per_request_reference(case, monkeypatch):
    from sglang_ecospec_cpu import extend_batched

    calls = []
    real = attention.extend_uniform
    monkeypatch.setattr(
        attention, "extend_uniform", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    for seed in range(3):
        args, kwargs = extend_inputs(case, seed=seed)
        ref_args, ref_kwargs = extend_inputs(case, seed=seed)
        attention.extend_attention_fwd(*args, **kwargs)
        attention.extend_per_request(*ref_args, **ref_kwargs)
        assert_outputs_close(
            ("o", "lse"),
            extend_outputs(ref_args, ref_kwargs),
            extend_outputs(args, kwargs),
            case[0],
        )
    assert len(calls) == 3  # the batched path ran
    assert extend_batched.uniform_rows([0, 2, 4, 6]) == 2
    assert extend_batched.uniform_rows([0, 2, 3]) == 0 and extend_batched.uniform_rows([0, 0]) == 0


@pytest.mark.parametrize(
    "case",
    [c for c in EXTEND_CASES if c not in UNIFORM][:1]
    + [
        (
            "uniform_but_prefix_mask",
            [8, 20],
            [4, 4],
            4,
            2,
            64,
            dict(mask=True, prefix_density=0.6, skip_prefix_custom_mask=False),
        ),
        ("uniform_but_window", [40, 9], [3, 3], 6, 2, 64, dict(window=8)),
        ("uniform_but_xai", [30, 4], [3, 3], 6, 3, 64, dict(xai=10)),
        ("uniform_but_skip_extend", [9, 5], [2, 2], 4, 2, 64, dict(skip_extend=True)),
    ],
    ids=lambda case: case[0],
)
def test_what_the_batched_extend_does_not_cover_runs_per_request(case, monkeypatch):
    monkeypatch.setattr(attention, "extend_uniform", None)  # would raise if called
    args, kwargs = extend_inputs(case, seed=2)
    ref_args, ref_kwargs = extend_inputs(case, seed=2)
    attention.extend_attention_fwd(*args, **kwargs)
    attention.extend_per_request(*ref_args, **ref_kwargs)
    assert torch.equal(args[3], ref_args[3])


def test_decode_uses_kernel_split_layout():
    # 70 keys in 3 splits: ceil(70 / 3) = 24, rounded up to 32 -> splits of 32, 32, 6 keys
    _, (k_buffer, v_buffer, kv_indptr, kv_indices), q = pool_and_queries([70], 1, 1, 1, 16, 1)
    o = torch.empty(1, 1, 16)
    logits = torch.full((1, 1, 4, 16), 7.0)
    lse = torch.full((1, 1, 4), 7.0)
    splits = torch.tensor([3], dtype=torch.int32)
    attention.decode_attention_fwd(
        q, k_buffer, v_buffer, o, kv_indptr, kv_indices, logits, lse, splits, 4, 0.25, 1.0, 1.0
    )
    loc = kv_indices.long()
    for s, (start, end) in enumerate([(0, 32), (32, 64), (64, 70)]):
        scores = (k_buffer[loc[start:end], 0] @ q[0, 0]) * 0.25
        torch.testing.assert_close(lse[0, 0, s], torch.logsumexp(scores, 0), **TOL)
        expected = torch.softmax(scores, 0) @ v_buffer[loc[start:end], 0]
        torch.testing.assert_close(logits[0, 0, s], expected, **TOL)
    assert torch.equal(lse[0, 0, 3], torch.tensor(7.0))  # the empty fourth split is untouched


def test_hook_runs_pytorch_on_cpu_and_triton_for_uncovered_calls():
    calls = []

    def original(*args, **kwargs):
        calls.append(kwargs.get("score_mod"))

    hook = function_hooks.around_hook(
        "decode_attention_fwd",
        attention.decode_attention_fwd,
        attention.decode_fallback_reason,
    )
    args, kwargs = decode_inputs(DECODE_CASES[0])
    hook(original, *args, **kwargs)
    assert calls == [] and not torch.equal(args[3], torch.full_like(args[3], 7.0))
    hook(original, *args, **kwargs, score_mod="mod")
    assert calls == ["mod"]


def test_fallback_reasons():
    args, _ = decode_inputs(DECODE_CASES[0])
    q, k_buffer, v_buffer = args[:3]
    assert attention.decode_fallback_reason(q, k_buffer, v_buffer) is None
    assert attention.decode_fallback_reason(q, k_buffer, v_buffer, score_mod=object())
    assert attention.decode_fallback_reason(q, k_buffer, v_buffer, has_mla=True)
    assert attention.decode_fallback_reason(q.to("meta"), k_buffer, v_buffer)
    assert attention.extend_fallback_reason(q, k_buffer[None], v_buffer)
    assert attention.extend_unified_fallback_reason(q, k_buffer, v_buffer) is None


def test_register_hooks_targets_the_three_kernels(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    registered = []
    monkeypatch.setattr(
        HookRegistry, "register", classmethod(lambda cls, *a, **k: registered.append(a))
    )
    assert attention.register_hooks() == list(attention.KERNELS)
    assert [(target, kind) for target, _, kind in registered] == [
        (target, HookType.AROUND) for target in attention.KERNELS
    ]


def test_a_kernel_with_other_parameters_keeps_triton():
    target = "sglang.kernels.ops.attention.extend_attention.build_unified_kv_indices"
    assert not function_hooks.same_parameters(target, attention.extend_attention_fwd)
    assert function_hooks.same_parameters(attention.DECODE_TARGET, attention.decode_attention_fwd)
