"""The CPU development mode (sglang_ecospec_cpu) as the plugin turns it on: its switch, the
tree-mask fix and the sgl_kernel ops it registers."""

import json
import math

import torch
from sglang_ecospec_cpu import ops


def test_cpu_mode_is_off_without_the_cpu_engine(monkeypatch):
    import sglang_ecospec_cpu as cpu_dev

    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    assert not cpu_dev.is_cpu_dev_mode() and not cpu_dev.enable_if_cpu()
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert cpu_dev.is_cpu_dev_mode() == (not torch.cuda.is_available())


def test_tree_mask_mode_follows_the_attention_backend():
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode
    from sglang_ecospec_cpu import mask_mode_for_backend

    assert mask_mode_for_backend("triton") == TreeMaskMode.FULL_MASK
    assert mask_mode_for_backend("torch_native") == TreeMaskMode.FULL_MASK
    assert mask_mode_for_backend("intel_amx") == TreeMaskMode.QLEN_ONLY
    assert (ops.FULL_MASK, ops.QLEN_ONLY) == (TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY)


def test_ops_register_into_the_sgl_kernel_namespace():
    ops.register_ops()
    assert set(ops.SCHEMAS) <= {name for name in ops.SCHEMAS if ops._op_exists(name)}
    assert ops.register_ops() == []  # idempotent
    bonus = torch.zeros(2, dtype=torch.int32)
    accept = torch.tensor([[7, 8, 9], [4, 5, 6]], dtype=torch.int32)
    torch.ops.sgl_kernel.fill_bonus_tokens_cpu(
        accept, torch.tensor([2, 3], dtype=torch.int32), bonus, 3
    )
    assert bonus.tolist() == [8, 6]


def build_tree(parent_list, selected, seq_lens, topk, depth, ndt, mode):
    batch = parent_list.shape[0]
    if mode == ops.QLEN_ONLY:
        mask = torch.zeros(batch * ndt * ndt, dtype=torch.bool)
    else:
        mask = torch.ones(int(seq_lens.sum()) * ndt + batch * ndt * ndt, dtype=torch.bool)
    positions = torch.zeros(batch * ndt, dtype=torch.int64)
    index = torch.zeros(batch, ndt, dtype=torch.int64)
    child = torch.full((batch, ndt), -1, dtype=torch.int64)
    sibling = torch.full((batch, ndt), -1, dtype=torch.int64)
    ops.build_tree_kernel_efficient(
        parent_list,
        selected,
        seq_lens,
        mask,
        positions,
        index,
        child,
        sibling,
        topk,
        depth,
        ndt,
        mode,
    )
    return mask, positions, index, child, sibling


# topk 2, depth 3: candidates 0, 1 (children of the root), 2..5 (children of parent_list[1],
# parent_list[2] = candidates 0, 1), 6..9 (children of parent_list[3], parent_list[4] = 3, 4).
PARENT_LIST = torch.tensor([[-1, 0, 1, 3, 4]])


SELECTED = torch.tensor([[0, 1, 3, 6, 7]])  # nodes 1..5; node 3 (cand 3) under node 1 (cand 0)


def test_build_tree_links_positions_and_masks():
    mask, positions, index, child, sibling = build_tree(
        PARENT_LIST, SELECTED, torch.tensor([10]), 2, 3, 6, ops.QLEN_ONLY
    )
    # Tree: root 0 -> {1, 2}; 1 -> {3}; 3 -> {4, 5}.
    assert child.tolist() == [[1, 3, -1, 4, -1, -1]]
    assert sibling.tolist() == [[-1, 2, -1, -1, 5, -1]]
    assert positions.tolist() == [10, 11, 11, 12, 13, 13]
    assert index.tolist() == [[0, 1, 2, 3, 4, 5]]
    m = mask.view(6, 6).int().tolist()
    assert m[4] == [1, 1, 0, 1, 1, 0] and m[2] == [1, 0, 1, 0, 0, 0]
    full, *_ = build_tree(PARENT_LIST, SELECTED, torch.tensor([3]), 2, 3, 6, ops.FULL_MASK)
    block = full.view(6, 3 + 6)
    assert block[:, :3].all() and torch.equal(block[:, 3:], mask.view(6, 6))


def test_reconstruct_indices_from_mask_inverts_build_tree():
    mask, positions, index, child, sibling = build_tree(
        PARENT_LIST.repeat(2, 1),
        SELECTED.repeat(2, 1),
        torch.tensor([4, 9]),
        2,
        3,
        6,
        ops.QLEN_ONLY,
    )
    rec_pos = torch.zeros(12, dtype=torch.int64)
    rec = [torch.zeros(2, 6, dtype=torch.int64) for _ in range(3)]
    ops.reconstruct_indices_from_tree_mask(mask, torch.tensor([4, 9]), rec_pos, *rec, 2, 6)
    assert torch.equal(rec_pos, positions)
    assert (
        torch.equal(rec[0], index) and torch.equal(rec[1], child) and torch.equal(rec[2], sibling)
    )


def test_verify_tree_greedy_walks_the_matching_path():
    _, _, index, child, sibling = build_tree(
        PARENT_LIST, SELECTED, torch.tensor([10]), 2, 3, 6, ops.QLEN_ONLY
    )
    candidates = torch.tensor([[100, 21, 22, 31, 41, 42]])
    # Target argmax per node: at root 21 (-> node 1), at node 1 31 (-> node 3), at node 3 42
    # (-> node 5), at node 5 77 (the bonus token).
    target = torch.tensor([[21, 31, 0, 42, 0, 77]])
    predicts = torch.zeros(6, dtype=torch.int32)
    accept = torch.full((1, 4), -1, dtype=torch.int32)
    count = torch.zeros(1, dtype=torch.int32)
    ops.verify_tree_greedy(predicts, accept, count, candidates, index, child, sibling, target)
    assert accept.tolist() == [[0, 1, 3, 5]] and count.tolist() == [3]
    assert predicts.tolist() == [21, 31, 0, 42, 0, 77]
    target[0, 0] = 999  # nothing matches at the root: only the bonus token
    accept.fill_(-1)
    ops.verify_tree_greedy(predicts, accept, count, candidates, index, child, sibling, target)
    assert accept.tolist() == [[0, -1, -1, -1]] and count.tolist() == [0]


def _verify_tree_greedy_loop(accept_width, candidates, index, child, sibling, target):
    """The op's contract as a plain loop over nodes: (predicts, accept_index, counts)."""
    flat = target.flatten()
    predicts = torch.full_like(flat, -7)
    accept = torch.full((candidates.shape[0], accept_width), -1, dtype=torch.int64)
    counts = []
    for b in range(candidates.shape[0]):
        node, path = 0, [int(index[b, 0])]
        while len(path) < accept_width:
            node = int(child[b, node])
            while node != -1 and int(candidates[b, node]) != int(flat[path[-1]]):
                node = int(sibling[b, node])
            if node == -1:
                break
            path.append(int(index[b, node]))
        for i, n in enumerate(path):
            accept[b, i] = n
            predicts[n] = flat[n]
        counts.append(len(path) - 1)
    return predicts, accept, torch.tensor(counts)


def test_verify_tree_greedy_equals_the_loop_on_random_trees():
    gen = torch.Generator().manual_seed(0)
    for batch, nodes, width in [(1, 1, 1), (4, 1, 1), (3, 6, 4), (5, 8, 5), (0, 4, 3)]:
        parents = [
            [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, nodes)]
            for _ in range(batch)
        ]
        child = torch.full((batch, nodes), -1, dtype=torch.int64)
        sibling = torch.full((batch, nodes), -1, dtype=torch.int64)
        for b, tree in enumerate(parents):
            for i in reversed(range(1, nodes)):  # first child = the lowest index
                sibling[b, i] = child[b, tree[i]]
                child[b, tree[i]] = i
        index = torch.arange(batch * nodes).view(batch, nodes)
        candidates = torch.randint(0, 3, (batch, nodes), generator=gen)  # 3 tokens: matches
        target = torch.randint(0, 3, (batch, nodes), generator=gen)
        predicts = torch.full((batch * nodes,), -7, dtype=torch.int32)
        accept = torch.full((batch, width), -1, dtype=torch.int32)
        count = torch.zeros(batch, dtype=torch.int32)
        ops.verify_tree_greedy(predicts, accept, count, candidates, index, child, sibling, target)
        want = _verify_tree_greedy_loop(width, candidates, index, child, sibling, target)
        assert predicts.tolist() == want[0].tolist()
        assert accept.tolist() == want[1].tolist() and count.tolist() == want[2].tolist()


def test_cache_location_ops():
    req_to_token = torch.arange(40, dtype=torch.int32).view(4, 10)
    rpi, start, end = torch.tensor([2, 0]), torch.tensor([1, 7]), torch.tensor([3, 10])
    out = torch.zeros(5, dtype=torch.int64)
    ops.assign_extend_cache_locs(rpi, req_to_token, start, end, out, 10)
    assert out.tolist() == [21, 22, 7, 8, 9]
    ops.assign_req_to_token_pool(rpi, req_to_token, start, end, torch.arange(100, 105), 10)
    assert req_to_token[2, 1:3].tolist() == [100, 101] and req_to_token[0, 7:].tolist() == [
        102,
        103,
        104,
    ]
    draft = torch.zeros(2 * 2 * 2, dtype=torch.int64)
    ops.assign_draft_cache_locs_contiguous(
        torch.tensor([1, 3]), req_to_token, torch.tensor([4, 5]), draft, 10, 2, 2
    )
    assert draft.tolist() == [14, 15, 16, 17, 35, 36, 37, 38]
    accepted = torch.zeros(3, dtype=torch.int64)
    ops.fill_accept_out_cache_loc(
        torch.tensor([[0, 2, -1], [4, -1, -1]], dtype=torch.int32),
        torch.tensor([50, 51, 52, 53, 54, 55]),
        accepted,
    )
    assert accepted.tolist() == [50, 52, 54]
    meta = ops.build_draft_decode_metadata(
        req_to_token, torch.tensor([1]), torch.tensor([2]), 2, 2, 10
    )
    assert meta[:, :4].tolist() == [[10, 11, 12, 13], [10, 11, 14, 15]]


def test_rotate_input_ids():
    ids = torch.tensor([1, 2, 3, 4, 5])
    ops.rotate_input_ids(
        ids, torch.tensor([0, 3]), torch.tensor([3, 2]), torch.tensor([9, 8]), None
    )
    assert ids.tolist() == [2, 3, 9, 5, 8]


def test_copy_all_layer_kv_cache_moves_slots_of_every_buffer():
    buffers = [torch.arange(24, dtype=torch.float32).view(6, 4), torch.arange(12.0).view(6, 2)]
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers])
    expected = [b.clone() for b in buffers]
    for b in expected:
        b[[0, 1]] = b[[1, 5]].clone()
    ops.copy_all_layer_kv_cache(data_ptrs, strides, torch.tensor([0, 1]), torch.tensor([1, 5]))
    for got, want in zip(buffers, expected, strict=True):
        assert torch.equal(got, want)


def test_tiny_target_spec_round_trip(tmp_path):
    from sglang_ecospec_cpu import tiny

    spec = tiny.TinyTargetSpec()
    ids = tiny.output_ids(spec)
    assert ids.numel() == spec.output_vocab and math.isclose(spec.copy_weight, 0.0)
    (tmp_path / tiny.MARKER).write_text(json.dumps({"kind": "target", **spec.__dict__}))
    assert tiny.target_spec_of(tmp_path) == spec
