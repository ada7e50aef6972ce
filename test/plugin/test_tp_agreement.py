"""TP agreement: every rank of a group verifies rank 0's selection, and the periodic check
reports (and repairs) predictor tables that drifted apart. Two real ranks on the CPU (SGLang's
parallel state over gloo, in forked children), and the one-rank case without any collective."""

import logging
import multiprocessing
import os
import socket
import traceback
from types import SimpleNamespace

import pytest
import torch
from sglang_ecospec import routing, selection, tp_agreement
from sglang_ecospec.settings import EcoSpecSettings

from plugin._helpers import sglang_draft_tree

BATCH, TOPK, STEPS, NDT = 3, 3, 3, 6


# --- checksums and construction -------------------------------------------------------------


def test_checksum_sees_any_changed_or_swapped_element(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    table = torch.randint(0, 5, (7, 3, 4), generator=gen).float()
    base = tp_agreement.tensor_checksum(table)
    assert tp_agreement.tensor_checksum(table.clone()) == base
    changed = table.clone()
    changed[3, 1, 2] += 0.5
    assert tp_agreement.tensor_checksum(changed) != base
    # One count on expert 1 instead of expert 2: the same sum, another checksum.
    moved, other = torch.zeros(4), torch.zeros(4)
    moved[1] = other[2] = 1.0
    assert tp_agreement.tensor_checksum(moved) != tp_agreement.tensor_checksum(other)
    # Chunked or not, the same value (exact integer arithmetic, order-independent).
    monkeypatch.setattr(tp_agreement, "_CHUNK", 5)
    assert tp_agreement.tensor_checksum(table) == base
    for tensor in (torch.tensor([True, False]), torch.arange(9), torch.ones(3, dtype=torch.half)):
        assert tp_agreement.tensor_checksum(tensor).dtype == torch.int64


def test_one_rank_adds_no_collective(monkeypatch):
    from sglang.srt.distributed.parallel_state import GroupCoordinator
    from sglang_ecospec.runtime import EcoSpecRuntime
    from transformers import Qwen2MoeConfig

    from sgl_ecospec.predictors import OnlineExpertPredictor

    calls = []

    def refuse(name):
        def spy(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} called with one rank")

        return spy

    for name in ("broadcast", "all_gather", "all_reduce", "all_gather_object"):
        monkeypatch.setattr(torch.distributed, name, refuse(name))
    monkeypatch.setattr(GroupCoordinator, "broadcast", refuse("GroupCoordinator.broadcast"))
    assert tp_agreement.selection_group() is None  # no distributed state in this process
    assert tp_agreement.TpAgreement.for_group(None) is None
    assert tp_agreement.TpAgreement.for_group(SimpleNamespace(world_size=1)) is None
    with pytest.raises(ValueError, match="more than one rank"):
        tp_agreement.TpAgreement(SimpleNamespace(world_size=1))

    config = Qwen2MoeConfig(num_hidden_layers=2, num_experts=16, num_experts_per_tok=2)
    settings = EcoSpecSettings(
        policy="ecospec", log_interval=1, num_buckets=64, recall_weighted_cost=False, min_score=0.0
    )
    runtime = EcoSpecRuntime(
        settings, config, topk=TOPK, num_draft_tokens=NDT, max_batch=4, device="cpu",
        tp_check_interval=1,
    )  # fmt: skip
    try:
        assert runtime.tp_sync is None and runtime.selector.tp_sync is None
        assert isinstance(runtime.predictor, OnlineExpertPredictor)
        for step in range(3):
            roots = torch.arange(BATCH) + 100 * step
            _, _, draft_tokens = _select(runtime, roots, seed=step)
            _verify(runtime, roots, draft_tokens, _routing_by_token)
    finally:
        runtime.close()
    assert calls == [] and len(runtime.summaries) == 3


# --- two ranks ------------------------------------------------------------------------------


def _routing_by_token(tokens: torch.Tensor) -> torch.Tensor:
    """Deterministic routing ``[T, L=2, K=2]`` from the token id (what every rank captures)."""
    first = (tokens * 7) % 16
    second = (first + 1 + tokens % 5) % 16
    layer = torch.stack([first, second], 1)  # [T, K]
    return torch.stack([layer, (layer + 3) % 16], 1)


def _random_routing(tokens: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(16, generator=gen)[:2] for _ in range(tokens.numel() * 2)]
    return torch.stack(rows).view(tokens.numel(), 2, 2)


def _verify(runtime, roots, draft_tokens, route, result=None) -> None:
    """One verify pass as SGLang runs it: each MoE layer's routing goes through the capture
    hook, then the worker calls ``after_verify`` with the verify tokens (root first) and
    SGLang's ``result`` (its ``accept_index``; None: nothing for calibrated acceptance), and
    the batch's results reach the decode-stats report (which logs the "EcoSpec:" line)."""
    tokens = torch.cat([roots[:, None], draft_tokens], 1).flatten()
    ids = route(tokens)  # [T, L, K]
    capture_config = SimpleNamespace(allow_routed_experts_capture=True)
    runtime.before_verify()
    for layer in range(ids.shape[1]):
        routing.after_capture(None, capture_config, layer, ids[:, layer])
    runtime.after_verify(SimpleNamespace(draft_token=tokens), result)
    runtime.poll_log()


def _select(runtime, roots, seed, *, local=False):
    """The draft step's selection through SGLang's hook; ``local``: without the broadcast
    (what this rank alone would choose)."""
    runtime.before_decode(SimpleNamespace(is_draft_input=lambda: True, bonus_tokens=roots))
    tree = sglang_draft_tree(BATCH, TOPK, STEPS, seed=seed)
    selector = runtime.selector
    sync, selector.tp_sync = selector.tp_sync, None if local else selector.tp_sync
    try:
        return selection.organize_hook(None, *tree, NDT)
    finally:
        selector.tp_sync = sync


def _rank_facts(rank: int, port: int) -> dict:
    """Runs in rank ``rank``'s process: SGLang's parallel state over gloo (TP 2), one runtime,
    rank 1's routing different for one verify step."""
    from sglang.srt.distributed import parallel_state
    from sglang.test.test_utils import publish_build_topology
    from sglang_ecospec.runtime import EcoSpecRuntime
    from transformers import Qwen2MoeConfig

    torch.set_num_threads(1)
    # No NCCL on the CPU: SGLang leaves PyNccl off, as on a machine without the library.
    os.environ["SGLANG_NCCL_SO_PATH"] = "/nonexistent/libnccl.so.2"
    parallel_state.init_distributed_environment(
        world_size=2,
        rank=rank,
        local_rank=rank,
        backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )
    publish_build_topology(world_rank=rank, tp_size=2, ep_size=1, pp_size=1)
    parallel_state.initialize_model_parallel(backend="gloo")
    errors = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = lambda record: errors.append(record.getMessage())
    logging.getLogger(tp_agreement.__name__).addHandler(handler)

    config = Qwen2MoeConfig(num_hidden_layers=2, num_experts=16, num_experts_per_tok=2)
    settings = EcoSpecSettings(
        policy="ecospec", eps=0.01, log_interval=0, recall_weighted_cost=False, min_score=0.0
    )
    runtime = EcoSpecRuntime(
        settings, config, topk=TOPK, num_draft_tokens=NDT, num_steps=STEPS, max_batch=12,
        device="cpu", tp_check_interval=2,
    )  # fmt: skip
    facts = {"group_size": runtime.tp_sync.world_size, "rank_in_group": runtime.tp_sync.rank}
    try:
        roots = torch.tensor([5, 6, 7])
        tree_tokens = torch.cat(sglang_draft_tree(BATCH, TOPK, STEPS, seed=1)[1], 1)  # [B, N]
        # Verify step 1 over the tree's tokens; rank 1's router breaks ties differently once.
        _verify(runtime, roots, tree_tokens, lambda t: _random_routing(t, seed=rank))
        facts["checks_after_step_1"] = runtime.tp_sync.checks
        facts["local"] = _select(runtime, roots, seed=1, local=True)[1].tolist()
        calibrator = runtime.acceptance.calibrator
        if rank == 1:  # rank 1's acceptance calibrator far from rank 0's (cold) one
            calibrator.promised.fill_(100.0)  # likely edges (q >= 0.5) rarely accepted
            calibrator.accepted.fill_(100.0)[:, 5:] = 1.0
        parent_list, index, draft_tokens = _select(runtime, roots, seed=1)
        facts["synced"] = [parent_list.tolist(), index.tolist(), draft_tokens.tolist()]
        facts["forecast"] = runtime.acceptance.forecast[:BATCH].tolist()  # of the synced set
        calibrator.accepted.zero_()  # cold again on both ranks
        calibrator.promised.zero_()
        # The recall buffer holds this rank's predictions of the rows actually verified.
        verify_tokens = torch.cat([roots[:, None], draft_tokens], 1).flatten()
        facts["verify_topk_matches"] = torch.equal(
            runtime.selector.verify_topk[: verify_tokens.numel()].long(),
            runtime.predictor.predict_topk(verify_tokens),
        )
        # Verify step 2: the same routing everywhere; the check runs and repairs rank 1. Every
        # request accepts its first verified candidate (SGLang's accept_index, flat rows).
        accept_index = torch.full((BATCH, STEPS + 1), -1, dtype=torch.int32)
        accept_index[:, :2] = torch.arange(BATCH)[:, None] * NDT + torch.tensor([0, 1])
        result = SimpleNamespace(accept_index=accept_index)
        _verify(runtime, roots, draft_tokens, _routing_by_token, result)
        # Both ranks learnt from rank 0's verify set and the same accepted paths.
        facts["calibrator"] = [calibrator.accepted.tolist(), calibrator.promised.tolist()]
        facts["checks"] = runtime.tp_sync.checks
        facts["diverged"] = runtime.tp_sync.last_diverged
        facts["divergences"] = runtime.tp_sync.divergences
        facts["errors"] = errors
        facts["checksum_after"] = tp_agreement.state_checksum(runtime.predictor).tolist()
        facts["local_after"] = _select(runtime, roots, seed=1, local=True)[1].tolist()
        facts["check_again"] = runtime.tp_sync.check(runtime.predictor)
    finally:
        runtime.close()
        parallel_state.destroy_model_parallel()
        parallel_state.destroy_distributed_environment()
    return facts


def _rank_main(rank: int, port: int, queue) -> None:
    try:
        queue.put((rank, _rank_facts(rank, port)))
    except BaseException:
        queue.put((rank, {"error": traceback.format_exc()}))


def test_two_ranks_verify_rank0s_selection_and_the_check_reports_divergence():
    # Imported here so that the forked ranks inherit the modules instead of importing them.
    import sglang.srt.layers.dp_attention  # noqa: F401
    import sglang.test.test_utils  # noqa: F401
    import sglang_ecospec.runtime  # noqa: F401

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    ranks = [context.Process(target=_rank_main, args=(r, port, queue)) for r in (0, 1)]
    for process in ranks:
        process.start()
    try:
        facts = dict(queue.get(timeout=180) for _ in ranks)
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
    for rank in (0, 1):
        assert "error" not in facts[rank], facts[rank].get("error")
    rank0, rank1 = facts[0], facts[1]
    assert [rank0["group_size"], rank0["rank_in_group"], rank1["rank_in_group"]] == [2, 0, 1]
    # After the one different routing step, rank 1 alone would verify another set...
    assert rank0["checks_after_step_1"] == 0
    assert rank1["local"] != rank0["local"]
    # ...but both ranks verify rank 0's: same tree, indices and tokens.
    assert rank1["synced"] == rank0["synced"]
    assert rank0["synced"][1] == rank0["local"]
    # Rank 1's skewed acceptance calibrator prices that set differently (its forecast), yet
    # the verified set is rank 0's.
    assert rank1["forecast"] != pytest.approx(rank0["forecast"])
    # Learning from rank 0's verify set and the same accept_index keeps the calibrators equal.
    assert rank1["calibrator"] == rank0["calibrator"] and sum(rank0["calibrator"][1][0]) > 0
    assert rank0["verify_topk_matches"] and rank1["verify_topk_matches"]
    # The check at step 2 finds rank 1's tables different on both ranks, logs it as an
    # error, and copies rank 0's state: the tables and the local choices agree again.
    for rank in (rank0, rank1):
        assert rank["checks"] == 1 and rank["diverged"] == [1] and rank["divergences"] == 1
        assert len(rank["errors"]) == 1 and "differs from rank 0" in rank["errors"][0]
        assert rank["check_again"] == []
    assert rank1["checksum_after"] == rank0["checksum_after"]
    assert rank1["local_after"] == rank0["local_after"]
