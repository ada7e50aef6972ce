"""SGLang's other Triton kernels on the CPU-mode decode path, in plain PyTorch.

With the attention kernels in PyTorch (:mod:`.attention`), py-spy on the EAGLE3 scheduler of
the small testbed (Qwen2-MoE target) found two Triton kernels still run by the interpreter
(``TRITON_INTERPRET=1``), about 60% of its busy time:

- the Qwen2-MoE shared-expert gate ``fused_gate_sigmoid_mul_add`` (and its out-of-place
  sibling ``fused_gate_sigmoid_mul``) in ``sglang.kernels.ops.elementwise.elementwise``: one
  interpreted program per token and MoE layer;
- the draft's ``generate_draft_decode_kv_indices`` in
  ``sglang.kernels.ops.speculative.cache_locs``: one interpreted program per (draft step,
  request, top-k branch), building the paged KV lists of the multi-step draft decode.

and, with the overlap scheduler that ECOSPEC keeps on the CPU, ``gather_spec_extras``
(``sglang.kernels.ops.speculative``): the FutureMap's gather of each request's speculative
relay rows, one interpreted program per request every decode step (about 8% of the busy time
of a plainly decoding ECOSPEC scheduler).

The functions here have the semantics of those kernels. The gate functions are Python
wrappers around a Triton launch and are hooked like the attention kernels (AROUND hooks, see
:func:`.function_hooks.around_hook`). ``generate_draft_decode_kv_indices`` is itself the
``@triton.jit`` object, launched as ``kernel[grid](...)`` by the Triton attention backend's
``TritonMultiStepDraftBackend.common_template``; ``kernel[grid]`` calls the object's
``run(*args, grid=grid, warmup=False, **kwargs)``, so the AROUND hook sits on that one
object's ``run`` attribute: every module that imported the kernel sees it, and the object
stays a Triton kernel for anything else. Each hook runs the PyTorch version for CPU tensors
and hands every other call to Triton. ``cpu_dev.enable`` installs them, so only a GPU-less
``--device cpu`` server uses them.

Shape legend: T = tokens, H = hidden size, B = requests (``grid[1]``), K = top-k branches
(``grid[2]``), S = draft steps (``grid[0]``).
"""

import inspect
import logging
import pkgutil

import torch

from sglang_ecospec_cpu.function_hooks import register_function_hooks

logger = logging.getLogger(__name__)

GATE_MUL_ADD_TARGET = "sglang.kernels.ops.elementwise.elementwise.fused_gate_sigmoid_mul_add"
GATE_MUL_TARGET = "sglang.kernels.ops.elementwise.elementwise.fused_gate_sigmoid_mul"
# Bound by name in the overlap scheduler's FutureMap, so hooked where it is looked up.
GATHER_SPEC_EXTRAS_TARGET = "sglang.srt.managers.overlap_utils.gather_spec_extras"
DRAFT_KV_INDICES_KERNEL = (
    "sglang.kernels.ops.speculative.cache_locs.generate_draft_decode_kv_indices"
)
# Launch options a Triton launch may carry besides the kernel's arguments; they choose how
# the GPU runs the kernel, not what it computes.
TRITON_LAUNCH_OPTIONS = frozenset(
    {"num_warps", "num_stages", "num_ctas", "maxnreg", "launch_pdl", "launch_cooperative_grid"}
)


# --- shared-expert gate -------------------------------------------------------------------


def _gated_shared_output(hidden_states, gate_weight, shared_output) -> torch.Tensor:
    """``sigmoid(hidden_states . gate_weight) * shared_output`` per token, fp32 [T, H]."""
    gate = torch.sigmoid(torch.mv(hidden_states.float(), gate_weight.float()))
    return gate[:, None] * shared_output.float()


def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states):
    """Adds the gated shared-expert output to the routed experts' output, in place, as
    SGLang's Triton ``fused_gate_sigmoid_mul_add``.

    hidden_states: [T, H] the MoE layer's input; gate_weight: [H] the shared-expert gate
    (``Linear(H, 1)``'s weight row); shared_output: [T, H] the shared expert's output;
    final_hidden_states: [T, H], written: ``final + sigmoid(h . w) * shared``, computed in
    fp32 (the kernel's accumulator) and cast to its dtype. Any float dtypes.
    """
    gated = _gated_shared_output(hidden_states, gate_weight, shared_output)
    final_hidden_states.copy_(gated + final_hidden_states.float())


def fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output) -> torch.Tensor:
    """The gated shared-expert output, as SGLang's Triton ``fused_gate_sigmoid_mul``.

    hidden_states: [T, H]; gate_weight: [H]; shared_output: [T, H]. Returns a new [T, H]
    tensor of ``shared_output``'s dtype: ``sigmoid(h . w) * shared``, computed in fp32.
    """
    gated = _gated_shared_output(hidden_states, gate_weight, shared_output)
    return gated.to(shared_output.dtype)


def gate_fallback_reason(
    hidden_states, gate_weight, shared_output, final_hidden_states=None
) -> str | None:
    """Why the gate functions do not cover a call (None: they do). Layouts the Triton
    wrapper asserts against go to it, so that such a call fails as it would without us."""
    tensors = [hidden_states, gate_weight, shared_output]
    if final_hidden_states is not None:
        tensors.append(final_hidden_states)
    if any(t.device.type != "cpu" for t in tensors):
        return "tensors not on the CPU"
    if not all(t.is_contiguous() for t in tensors):
        return "non-contiguous tensors"
    if hidden_states.ndim != 2 or gate_weight.shape != hidden_states.shape[1:]:
        return "shapes not [T, H] and [H]"
    if any(t.shape != hidden_states.shape for t in tensors[2:]):
        return "outputs not shaped like hidden_states"
    return None


# --- draft decode KV lists ----------------------------------------------------------------


def _from_pointer(tensor: torch.Tensor) -> torch.Tensor:
    """1-D view of the storage from ``tensor``'s first element on: the address space a
    Triton kernel sees through the tensor's pointer (so ``row * row_stride + pos`` reaches
    the element it reaches in the kernel, whatever the tensor's shape)."""
    size = tensor.untyped_storage().nbytes() // tensor.element_size() - tensor.storage_offset()
    return tensor.as_strided((size,), (1,))


def _token_ids(table, row_start, pos, entry_page_size, v2p, page_size, translate):
    """The kernel's ``_load_token_ids``: token ids at positions ``pos`` of table rows.

    table: 1-D int view (:func:`_from_pointer`) of the read source; row_start, pos: int64,
    broadcastable (a row's first element, a position in it). Page-granular sources
    (``entry_page_size`` > 1) hold one entry per page: ``entry * eps + pos % eps``. With
    ``translate``, virtual ids map through the page table ``v2p`` (1-D view, int), negative
    ids to 0. Returns int64 ids of the broadcast shape."""
    if entry_page_size == 1:
        ids = table[row_start + pos].long()
    else:
        entry = table[row_start + pos // entry_page_size].long()
        ids = entry * entry_page_size + pos % entry_page_size
    if translate:
        page = torch.where(ids < 0, 0, ids // page_size)
        physical = v2p[page].long() * page_size + ids % page_size
        ids = torch.where(ids < 0, 0, physical.clamp_min(0))
    return ids


def generate_draft_decode_kv_indices(
    req_pool_indices,
    req_to_token,
    paged_kernel_lens,
    kv_indices,
    kv_indptr,
    positions,
    row_stride,
    kv_indices_stride,
    kv_indptr_stride,
    bs_upper,
    iter_upper,
    num_tokens_upper,
    page_size,
    window_size=0,
    sink_size=0,
    NUM_STEPS=0,
    ENTRY_PAGE_SIZE=1,
    v2p=None,
    TRANSLATE=False,
    *,
    grid,
):
    """The draft decode's KV lists, as SGLang's Triton ``generate_draft_decode_kv_indices``
    launched on ``grid``.

    grid: ``(S, B, K)`` (with ``NUM_STEPS`` > 0: ``(NUM_STEPS * blocks, B, K)`` and S =
    ``NUM_STEPS``; the blocks only share the copy out). Request b (0 <= b < B) reads row
    ``req_pool_indices[b]`` (int, [>= B]) of ``req_to_token`` (int, rows ``row_stride``
    elements apart; page-granular with ``ENTRY_PAGE_SIZE`` > 1, virtual ids mapped through
    ``v2p`` with ``TRANSLATE``), and has ``paged_kernel_lens[b]`` (int, [>= B]) committed
    tokens, of which the draft reads L_b: all, or with ``window_size`` > 0 the first
    ``sink_size`` and the latest ``window_size``. For step s (``iters`` = s + 1) branch k,
    kv_indices (int, step s's list ``kv_indices_stride`` elements after step s-1's) gets, at
    ``sum(L_<b) * K + b * iters * K + k * (L_b + iters)``, the L_b prefix ids and then the
    ids of the ``iters`` draft tokens of branch k so far (positions ``len + k * S + i``; with
    pages and K > 1 each branch's draft tokens start on its own pages).
    ``kv_indptr[s, z]`` (int, steps ``kv_indptr_stride`` apart) for z = b * K + k gets
    ``sum(positions[:z]) + z * iters`` (positions int [B * K], capped at window + sink with
    a window), except z = 0, whose program writes entry B * K instead; entry 0 is left
    alone. ``bs_upper``, ``iter_upper``, ``num_tokens_upper`` are the kernel's block sizes
    (powers of two >= B, S, B * K); sums and draft tokens beyond them are cut as in the
    kernel.
    """
    grid_steps, batch, topk = grid
    num_steps = NUM_STEPS or grid_steps
    if batch == 0 or topk == 0 or grid_steps == 0:
        return
    device = kv_indices.device
    table = _from_pointer(req_to_token)
    page_table = _from_pointer(v2p) if TRANSLATE else None
    out = _from_pointer(kv_indices)
    indptr_out = _from_pointer(kv_indptr)

    def token_ids(row_start, pos):
        return _token_ids(table, row_start, pos, ENTRY_PAGE_SIZE, page_table, page_size, TRANSLATE)

    seq_lens = paged_kernel_lens[:batch].long()
    if window_size > 0:
        read_lens = seq_lens.clamp_max(window_size + sink_size)
        sink = seq_lens.clamp_max(sink_size)
        recent_start = seq_lens - (read_lens - sink)
    else:
        read_lens = seq_lens
        sink = recent_start = torch.zeros_like(seq_lens)
    ends = torch.cumsum(read_lens, 0)
    starts = torch.cat([ends.new_zeros(1), ends])
    # the kernel sums the lengths of the earlier requests among the first bs_upper
    earlier = starts[torch.arange(batch, device=device).clamp_max(bs_upper)]
    row_start = req_pool_indices[:batch].long() * row_stride

    # the prefix ids, the same for every step and branch
    request = torch.repeat_interleave(torch.arange(batch, device=device), read_lens)
    offset = torch.arange(request.numel(), device=device) - starts[request]
    in_sink = offset < sink[request]
    src = torch.where(in_sink, offset, recent_start[request] + offset - sink[request])
    prefix_ids = token_ids(row_start[request], src).to(out.dtype)

    branch = torch.arange(topk, device=device)
    if page_size == 1 or topk == 1:
        draft_start = seq_lens[:, None] + branch * num_steps
    else:
        # each branch's draft tokens continue the last prefix page's offset on pages of
        # their own (the kernel's prefix_base + k * pages * page_size + last_page_len)
        pages_per_branch = (seq_lens % page_size + num_steps + page_size - 1) // page_size
        draft_start = seq_lens[:, None] + branch * (pages_per_branch * page_size)[:, None]

    tokens = batch * topk
    counted = min(tokens, num_tokens_upper)
    pos_vals = positions[:counted].long()
    if window_size > 0:
        pos_vals = pos_vals.clamp_max(window_size + sink_size)
    pos_sums = torch.cat([pos_vals.new_zeros(1), torch.cumsum(pos_vals, 0)])
    zid = torch.arange(tokens, device=device)
    zid[0] = tokens

    for step in range(num_steps):
        iters = step + 1
        list_start = (
            step * kv_indices_stride
            + (earlier * topk + torch.arange(batch, device=device) * iters * topk)[:, None]
            + branch * (read_lens + iters)[:, None]
        )  # [B, K]
        out[list_start[request] + offset[:, None]] = prefix_ids[:, None].expand(-1, topk)
        drafts = torch.arange(min(iters, iter_upper), device=device)
        draft_ids = token_ids(row_start[:, None, None], draft_start[..., None] + drafts)
        dest = list_start[..., None] + read_lens[:, None, None] + drafts
        out[dest] = draft_ids.to(out.dtype)
        base = pos_sums[zid.clamp_max(counted)]
        indptr_out[step * kv_indptr_stride + zid] = (base + zid * iters).to(indptr_out.dtype)


def draft_kv_indices_fallback_reason(
    req_pool_indices, req_to_token, kv_indices, kv_indptr, *, grid, NUM_STEPS=0, **_
) -> str | None:
    """Why :func:`generate_draft_decode_kv_indices` does not cover a launch (None: it does)."""
    if any(t.device.type != "cpu" for t in (req_pool_indices, req_to_token, kv_indices, kv_indptr)):
        return "tensors not on the CPU"
    if not (isinstance(grid, tuple) and len(grid) == 3 and all(isinstance(g, int) for g in grid)):
        return "grid not a tuple of three ints"
    if NUM_STEPS and grid[0] % NUM_STEPS:
        return "grid[0] not a multiple of NUM_STEPS"
    return None


# --- installation -------------------------------------------------------------------------


def _launch_hook(name: str, impl, fallback_reason):
    """AROUND hook on a Triton kernel object's ``run``: ``impl(*args, grid=grid)`` for the
    launches it covers, the kernel for the rest (warm-up, other devices, launch options
    ``impl`` does not take)."""
    signature = inspect.signature(impl)
    reported = set()

    def hook(original_run, *args, grid, warmup, **kwargs):
        arguments = {k: v for k, v in kwargs.items() if k not in TRITON_LAUNCH_OPTIONS}
        try:
            bound = signature.bind(*args, grid=grid, **arguments).arguments
        except TypeError as error:
            reason = f"arguments: {error}"
        else:
            reason = "warm-up" if warmup else fallback_reason(**bound)
        if reason is None:
            return impl(*args, grid=grid, **arguments)
        if reason not in reported:
            reported.add(reason)
            logger.info("%s: %s, running the Triton kernel", name, reason)
        return original_run(*args, grid=grid, warmup=warmup, **kwargs)

    return hook


def _same_kernel_parameters(target: str, impl) -> bool:
    """Whether the Triton kernel at ``target`` takes the parameters ``impl`` takes before
    its keyword-only ``grid``."""
    kernel = pkgutil.resolve_name(target)
    theirs = list(inspect.signature(kernel.fn).parameters)
    ours = [
        p.name
        for p in inspect.signature(impl).parameters.values()
        if p.kind is not inspect.Parameter.KEYWORD_ONLY
    ]
    if theirs != ours:
        logger.warning(
            "%s takes %s, the CPU version %s: keeping the Triton kernel", target, theirs, ours
        )
        return False
    return True


# wrapper function target -> (PyTorch version, its fallback predicate)
def gather_spec_extras(
    indices: torch.Tensor,
    topk_p_buf: torch.Tensor,
    topk_index_buf: torch.Tensor,
    output_tokens_buf: torch.Tensor,
    hidden_states_buf: torch.Tensor | None,
):
    """SGLang's ``gather_spec_extras``: rows ``indices`` (int ``[M]``) of each speculative
    relay buffer (``[R, ...]``: draft top-k probabilities and ids, bonus tokens, optionally
    hidden states), as new ``[M, ...]`` tensors of the buffers' dtypes; None for absent hidden
    states. The overlap scheduler's FutureMap calls it every decode step."""
    rows = indices.long()
    hidden = None if hidden_states_buf is None else hidden_states_buf[rows]
    return topk_p_buf[rows], topk_index_buf[rows], output_tokens_buf[rows], hidden


def gather_fallback_reason(
    indices, topk_p_buf, topk_index_buf, output_tokens_buf, hidden_states_buf
) -> str | None:
    buffers = [indices, topk_p_buf, topk_index_buf, output_tokens_buf, hidden_states_buf]
    if any(b is not None and b.device.type != "cpu" for b in buffers):
        return "tensors not on the CPU"
    return None


FUNCTIONS = {
    GATE_MUL_ADD_TARGET: (fused_gate_sigmoid_mul_add, gate_fallback_reason),
    GATE_MUL_TARGET: (fused_gate_sigmoid_mul, gate_fallback_reason),
    GATHER_SPEC_EXTRAS_TARGET: (gather_spec_extras, gather_fallback_reason),
}
# Triton kernel object target -> (PyTorch version, its fallback predicate)
LAUNCHED_KERNELS = {
    DRAFT_KV_INDICES_KERNEL: (generate_draft_decode_kv_indices, draft_kv_indices_fallback_reason),
}


def register_hooks() -> list[str]:
    """Registers the PyTorch versions as AROUND hooks (applied by SGLang's
    ``HookRegistry.apply_hooks`` after plugin loading): on the gate wrapper functions, and on
    the ``run`` of the draft KV-list kernel object. A function or kernel whose parameters
    differ from ours (another SGLang version) keeps its Triton version. Returns the hook
    targets."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooked = register_function_hooks(FUNCTIONS)
    for target, (impl, fallback_reason) in LAUNCHED_KERNELS.items():
        if not _same_kernel_parameters(target, impl):
            continue
        name = target.rsplit(".", 1)[1]
        run_target = f"{target}.run"
        hook = _launch_hook(name, impl, fallback_reason)
        HookRegistry.register(run_target, hook, HookType.AROUND)
        hooked.append(run_target)
    return hooked
