"""The sgl_kernel CPU ops that the CUDA wheel of sglang-kernel 0.4.10 lacks, in plain PyTorch.

sglang 0.5.23 on ``--device cpu`` calls ``torch.ops.sgl_kernel.<name>_cpu`` for speculative
decoding bookkeeping (cache locations, draft trees, greedy tree verification, KV moves).
Those ops are compiled only into the CPU build of sgl_kernel, so on a machine with the CUDA
wheel and no GPU speculative decoding stops with "no attribute ...". :func:`register_ops`
defines each missing op in the ``sgl_kernel`` namespace (a ``torch.library`` FRAGMENT) with
a CPU kernel written here from the op's documented contract; ops that already exist (a CPU
build of sgl_kernel) are left alone.

These kernels favour plain, checkable code over speed: the CPU development mode serves tiny
models, and every op here runs once per decode step over a handful of requests. Each has a
test in test/plugin/test_cpu_dev.py against a plain-loop statement of the same contract.

Shape legend: B = requests, D = draft tokens per request (tree nodes, root first),
P = req_to_token row length (pool_len), S = verify steps (accept_index width),
K = draft top-k, N = num draft steps.
"""

import ctypes
import logging

import torch

logger = logging.getLogger(__name__)

# name -> schema (arguments after the name). Mutated arguments carry alias annotations.
SCHEMAS = {
    "verify_tree_greedy_cpu": (
        "(Tensor(a!) predicts, Tensor(b!) accept_index, Tensor(c!) accept_token_num, "
        "Tensor candidates, Tensor retrive_index, Tensor retrive_next_token, "
        "Tensor retrive_next_sibling, Tensor target_predict) -> ()"
    ),
    "build_tree_kernel_efficient_cpu": (
        "(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, "
        "Tensor(a!) tree_mask, Tensor(b!) positions, Tensor(c!) retrive_index, "
        "Tensor(d!) retrive_next_token, Tensor(e!) retrive_next_sibling, int topk, int depth, "
        "int draft_token_num, int tree_mask_mode) -> ()"
    ),
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
        "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()"
    ),
    "build_draft_decode_metadata_cpu": (
        "(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int topk, "
        "int num_steps, int pool_len) -> Tensor"
    ),
    "fill_bonus_tokens_cpu": (
        "(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, "
        "int accept_stride) -> ()"
    ),
    "fill_accept_out_cache_loc_cpu": (
        "(Tensor accept_index, Tensor out_cache_loc, Tensor(a!) accept_out_cache_loc) -> ()"
    ),
    "assign_draft_cache_locs_contiguous_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor seq_lens, "
        "Tensor(a!) out_cache_loc, int pool_len, int topk, int num_steps) -> ()"
    ),
    "assign_extend_cache_locs_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, "
        "Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()"
    ),
    "reconstruct_indices_from_tree_mask_cpu": (
        "(Tensor tree_mask, Tensor verified_seq_len, Tensor(a!) positions, "
        "Tensor(b!) retrive_index, Tensor(c!) retrive_next_token, "
        "Tensor(d!) retrive_next_sibling, int batch_size, int draft_token_num) -> ()"
    ),
    "copy_all_layer_kv_cache_cpu": (
        "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()"
    ),
    "rotate_input_ids_cpu": (
        "(Tensor(a!) input_ids, Tensor extend_start_loc, Tensor extend_seq_lens, "
        "Tensor topk_index, Tensor? select_index) -> ()"
    ),
}

FULL_MASK, QLEN_ONLY = 0, 1  # TreeMaskMode values in sglang.kernels.ops.speculative.spec_tree


# --- draft trees ------------------------------------------------------------------------


def tree_parents(parent_list: list[int], selected: list[int], topk: int) -> list[int]:
    """Tree node parents of one request: node 0 is the root (bonus token), node i >= 1 is
    candidate ``selected[i - 1]``.

    A candidate c hangs under ``parent_list[c // topk]`` (SGLang's draft-tree layout: entry 0
    is the root, then the candidates each draft step expanded); that candidate's node is its
    position in ``selected`` plus one. Returns ``parents[D]`` with -1 for the root and for a
    node whose parent was not selected (no ancestor-closed tree; it then hangs under nothing).
    """
    where = {c: i + 1 for i, c in enumerate(selected)}
    parents = [-1]
    for c in selected:
        slot = c // topk
        parents.append(0 if slot == 0 else where.get(parent_list[slot], -1))
    return parents


def build_tree_kernel_efficient(
    parent_list: torch.Tensor,  # [B, K * (N - 1) + 1]
    selected_index: torch.Tensor,  # [B, D - 1], ascending candidate indices
    verified_seq_len: torch.Tensor,  # [B]
    tree_mask: torch.Tensor,  # bool, flat: QLEN_ONLY [B*D*D]; FULL_MASK [sum(len*D) + B*D*D]
    positions: torch.Tensor,  # [B * D]
    retrive_index: torch.Tensor,  # [B, D]
    retrive_next_token: torch.Tensor,  # [B, D], pre-filled with -1
    retrive_next_sibling: torch.Tensor,  # [B, D], pre-filled with -1
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """Verify-tree layout of each request: node i attends to the root, its ancestors and
    itself; positions are ``seq_len + depth``; ``retrive_next_token`` holds a node's first
    (lowest) child and ``retrive_next_sibling`` the next higher sibling."""
    if tree_mask_mode not in (FULL_MASK, QLEN_ONLY):
        raise ValueError(f"tree_mask_mode {tree_mask_mode} is not supported on the CPU")
    batch, nodes = parent_list.shape[0], draft_token_num
    seq_lens = verified_seq_len.tolist()
    mask_offset = 0
    for b in range(batch):
        parents = tree_parents(parent_list[b].tolist(), selected_index[b].tolist(), topk)
        first_child, next_sibling = [-1] * nodes, [-1] * nodes
        for i in range(nodes - 1, 0, -1):  # descending: each list ends up ascending
            p = parents[i]
            if p >= 0:
                next_sibling[i], first_child[p] = first_child[p], i
        ancestors = torch.zeros(nodes, nodes, dtype=torch.bool)  # [D, D]
        node_depth = [0] * nodes
        for i in range(nodes):
            ancestors[i, 0] = True
            node, hops = i, 0
            while node > 0:
                ancestors[i, node] = True
                node, hops = parents[node], hops + 1
            node_depth[i] = hops
        seq_len = seq_lens[b]
        row = slice(b * nodes, (b + 1) * nodes)
        positions[row] = torch.tensor(node_depth, dtype=positions.dtype) + seq_len
        retrive_index[b] = torch.arange(b * nodes, (b + 1) * nodes, dtype=retrive_index.dtype)
        retrive_next_token[b] = torch.tensor(first_child, dtype=retrive_next_token.dtype)
        retrive_next_sibling[b] = torch.tensor(next_sibling, dtype=retrive_next_sibling.dtype)
        if tree_mask_mode == QLEN_ONLY:
            tree_mask[b * nodes * nodes : (b + 1) * nodes * nodes] = ancestors.flatten()
        else:
            width = seq_len + nodes  # the committed prefix columns are the caller's
            block = tree_mask[mask_offset : mask_offset + nodes * width].view(nodes, width)
            block[:, seq_len:] = ancestors
            mask_offset += nodes * width


def verify_tree_greedy(
    predicts: torch.Tensor,  # int32 [B * D], out
    accept_index: torch.Tensor,  # int32 [B, S], out (rejected slots keep their fill)
    accept_token_num: torch.Tensor,  # int32 [B], out: accepted drafts, bonus excluded
    candidates: torch.Tensor,  # [B, D] draft tokens
    retrive_index: torch.Tensor,  # [B, D] flat index of each node
    retrive_next_token: torch.Tensor,  # [B, D]
    retrive_next_sibling: torch.Tensor,  # [B, D]
    target_predict: torch.Tensor,  # [B, D] target argmax at each node
) -> None:
    """Greedy tree verification: from the root, repeatedly step to the first child whose
    token equals the target's argmax at the current node; ``predicts`` gets the target's
    token at every accepted node (the last one's is the bonus token)."""
    steps = accept_index.shape[1]
    cand, index = candidates.tolist(), retrive_index.tolist()
    child, sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.flatten().tolist()
    for b in range(len(cand)):
        last = index[b][0]
        accepted = [last]
        cur = 0
        for _ in range(1, steps):
            cur = child[b][cur]
            while cur != -1 and cand[b][cur] != target[last]:
                cur = sibling[b][cur]
            if cur == -1:
                break
            predicts[last] = target[last]
            last = index[b][cur]
            accepted.append(last)
        accept_index[b, : len(accepted)] = torch.tensor(accepted, dtype=accept_index.dtype)
        accept_token_num[b] = len(accepted) - 1
        predicts[last] = target[last]


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,  # bool [B * D * D], row i = the nodes node i attends to
    verified_seq_len: torch.Tensor,  # [B]
    positions: torch.Tensor,  # [B * D], out
    retrive_index: torch.Tensor,  # [B, D], out
    retrive_next_token: torch.Tensor,  # [B, D], out
    retrive_next_sibling: torch.Tensor,  # [B, D], out
    batch_size: int,
    draft_token_num: int,
) -> None:
    """Tree links from a QLEN_ONLY mask (NGRAM's trees): a node's depth is the number of
    earlier nodes it attends to, its parent the nearest one, its first child the first later
    node attending to it, its next sibling the first later node under the same parent."""
    nodes = draft_token_num
    masks = tree_mask.view(batch_size, nodes, nodes).tolist()
    seq_lens = verified_seq_len.tolist()
    for b in range(batch_size):
        m = masks[b]
        parents = [max((j for j in range(i) if m[i][j]), default=-1) for i in range(nodes)]
        for i in range(nodes):
            flat = b * nodes + i
            retrive_index[b, i] = flat
            positions[flat] = sum(m[i][:i]) + seq_lens[b]
            retrive_next_token[b, i] = next((k for k in range(i + 1, nodes) if m[k][i]), -1)
            retrive_next_sibling[b, i] = next(
                (k for k in range(i + 1, nodes) if parents[i] >= 0 and parents[k] == parents[i]),
                -1,
            )


# --- cache locations ----------------------------------------------------------------------


def _row_spans(start: torch.Tensor, end: torch.Tensor):
    """Per-request spans [start, end) flattened: request of each element, column of each."""
    lens = (end - start).long()
    owner = torch.repeat_interleave(torch.arange(lens.numel()), lens)  # [T]
    first = torch.cumsum(lens, 0) - lens  # [B]
    cols = start.long()[owner] + torch.arange(int(lens.sum())) - first[owner]  # [T]
    return owner, cols


def assign_req_to_token_pool(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """``req_to_token[rpi[b], start[b]:end[b]]`` = the next ``end[b] - start[b]`` entries of
    ``out_cache_loc`` (requests in order)."""
    owner, cols = _row_spans(start_offset, end_offset)
    rows = req_pool_indices.long()[owner]
    req_to_token[rows, cols] = out_cache_loc[: cols.numel()].to(req_to_token.dtype)


def assign_extend_cache_locs(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
) -> None:
    """``out_cache_loc`` = concatenation of ``req_to_token[rpi[b], start[b]:end[b]]``."""
    owner, cols = _row_spans(start_offset, end_offset)
    rows = req_pool_indices.long()[owner]
    out_cache_loc[: cols.numel()] = req_to_token[rows, cols].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous(
    req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len, topk, num_steps
) -> None:
    """Row b of ``out_cache_loc.view(B, K * N)`` = ``req_to_token[rpi[b], len[b]:len[b]+K*N]``."""
    width = topk * num_steps
    cols = seq_lens.long()[:, None] + torch.arange(width)  # [B, K*N]
    rows = req_pool_indices.long()[:, None].expand_as(cols)
    out_cache_loc.view(-1, width)[:] = req_to_token[rows, cols].to(out_cache_loc.dtype)


def build_draft_decode_metadata(
    req_to_token, req_pool_indices, seq_lens, topk, num_steps, pool_len
) -> torch.Tensor:
    """``[B * K, P]`` int32: row b*K+k = request b's committed prefix, then branch k's
    ``num_steps`` draft slots (laid out at ``len + k * num_steps``); the rest is undefined."""
    out = torch.zeros((req_pool_indices.numel() * topk, pool_len), dtype=req_to_token.dtype)
    for b, (row, length) in enumerate(
        zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)
    ):
        source = req_to_token[row]
        for k in range(topk):
            out[b * topk + k, :length] = source[:length]
            branch = length + k * num_steps
            out[b * topk + k, length : length + num_steps] = source[branch : branch + num_steps]
    return out


def fill_bonus_tokens(accept_tokens, accept_lens, bonus_tokens, accept_stride) -> None:
    """``bonus[b]`` = the last accepted token of request b (``accept_lens`` counts it)."""
    flat = torch.arange(accept_lens.numel()) * accept_stride + accept_lens.long() - 1
    bonus_tokens.copy_(accept_tokens.flatten()[flat])


def fill_accept_out_cache_loc(accept_index, out_cache_loc, accept_out_cache_loc) -> None:
    """The KV slots of the accepted tokens (``accept_index`` >= 0), packed in order."""
    index = accept_index.flatten().long()
    slots = out_cache_loc[index[index >= 0]]
    accept_out_cache_loc[: slots.numel()] = slots


def rotate_input_ids(input_ids, extend_start_loc, extend_seq_lens, topk_index, select_index):
    """Per request: shift its extend segment left by one and write its new draft token at the
    end (or at ``select_index[b]``)."""
    starts, lens = extend_start_loc.tolist(), extend_seq_lens.tolist()
    tokens = topk_index.flatten().tolist()
    for b, (start, length) in enumerate(zip(starts, lens, strict=True)):
        if length > 1:
            input_ids[start : start + length - 1] = input_ids[start + 1 : start + length].clone()
        if length > 0:
            at = select_index[b] if select_index is not None else start + length - 1
            input_ids[at] = tokens[b]


# --- KV moves -----------------------------------------------------------------------------


def copy_all_layer_kv_cache(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """For every KV buffer (raw pointer ``data_ptrs[i]``, ``strides[i]`` bytes per slot),
    copy the slots ``src_loc`` onto ``tgt_loc`` (sources are read before any write)."""
    if tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    slots = int(torch.maximum(tgt.max(), src.max())) + 1
    for pointer, stride in zip(data_ptrs.tolist(), strides.tolist(), strict=True):
        # A byte view of the first `slots` slots of the buffer (no copy).
        raw = (ctypes.c_uint8 * (slots * stride)).from_address(pointer)
        buffer = torch.frombuffer(raw, dtype=torch.uint8).view(slots, stride)
        buffer[tgt] = buffer[src]  # advanced indexing gathers the sources first


_KERNELS = {
    "verify_tree_greedy_cpu": verify_tree_greedy,
    "build_tree_kernel_efficient_cpu": build_tree_kernel_efficient,
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool,
    "build_draft_decode_metadata_cpu": build_draft_decode_metadata,
    "fill_bonus_tokens_cpu": fill_bonus_tokens,
    "fill_accept_out_cache_loc_cpu": fill_accept_out_cache_loc,
    "assign_draft_cache_locs_contiguous_cpu": assign_draft_cache_locs_contiguous,
    "assign_extend_cache_locs_cpu": assign_extend_cache_locs,
    "reconstruct_indices_from_tree_mask_cpu": reconstruct_indices_from_tree_mask,
    "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache,
    "rotate_input_ids_cpu": rotate_input_ids,
}
assert set(_KERNELS) == set(SCHEMAS)

_library: torch.library.Library | None = None
_registered: list[str] = []


def _op_exists(name: str) -> bool:
    try:
        getattr(torch.ops.sgl_kernel, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def register_ops() -> list[str]:
    """Defines every op of :data:`SCHEMAS` that ``torch.ops.sgl_kernel`` lacks (idempotent).

    Imports ``sgl_kernel`` first, so ops its compiled library provides win. Returns the names
    defined by this call.
    """
    global _library
    try:
        import sgl_kernel  # noqa: F401  (loads its ops into torch.ops.sgl_kernel)
    except ImportError as exc:
        logger.warning(
            "sglang_ecospec CPU mode: `import sgl_kernel` failed (%s); is the stub libcuda on "
            "LD_LIBRARY_PATH? Use scripts/launch_cpu.sh.",
            exc,
        )
    missing = [name for name in SCHEMAS if not _op_exists(name)]
    if not missing:
        return []
    if _library is None:
        _library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in missing:
        _library.define(name + SCHEMAS[name])
        _library.impl(name, _KERNELS[name], "CPU")
        _registered.append(name)
    logger.info("sglang_ecospec CPU mode: registered sgl_kernel ops %s", missing)
    return missing


def registered_ops() -> list[str]:
    """Names this process defined through :func:`register_ops`."""
    return list(_registered)
