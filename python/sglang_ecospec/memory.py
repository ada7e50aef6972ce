"""ECOSPEC's device memory, accounted inside SGLang's budget.

SGLang sizes the KV pool from the memory that is free when the scheduler allocates it
(``Scheduler.init_memory_pools`` -> the target runner's ``KVCacheConfigurator.configure`` ->
``_profile_available_bytes``: free memory minus the ``--mem-fraction-static`` slack), after
the target and the draft are loaded. So the ECOSPEC worker builds its runtime in its
constructor (SGLang creates the speculative worker right before ``init_memory_pools``), and
its persistent tensors (the predictor's table, the buffers sized by the largest batch) are
charged to the KV budget like the weights are. The per-step temporaries of the draft step's
selection (kept by the draft CUDA graph's memory pool) and of the work after each verify
come later; :class:`Reservation` holds a placeholder of their size while the KV pool is
sized and frees it before the graphs are captured, so they come out of the KV pool's share,
not out of SGLang's slack. :func:`plugin_memory_bytes` computes all three up front; the
worker logs them (``ECOSPEC reserves X MiB: predictor Y MiB, buffers Z MiB, per-step
temporaries W MiB``).

The largest term of a step is the predictor's scoring of every candidate: a float ``[rows,
L, E]`` per row block (the online table's gathered counts plus the prior, or the head's
logits). The selector predicts in blocks of :func:`score_chunk_rows` rows, so that term stays
under :data:`SCORE_CHUNK_BYTES` whatever the batch (row by row the prediction is the same).

Shape legend: B = requests (the largest batch), D = verify tokens per request (ndt),
N = draft candidates per request, L = MoE layers, E = experts per layer, K = experts per
token, W = int64 words per layer bitmap.
"""

import dataclasses
import logging

import torch

from sgl_ecospec.ops import options
from sglang_ecospec import acceptance
from sglang_ecospec.deployment import num_candidates

logger = logging.getLogger(__name__)

MIB = 1 << 20
# Scoring temporaries of one prediction block (two float [rows, L, E] tensors at once).
SCORE_CHUNK_BYTES = 64 * MIB
_I64, _F64, _F32, _I16, _BOOL = 8, 8, 4, 2, 1


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The MoE shape the predictor covers: L layers, E experts each, K per token."""

    num_layers: int
    num_experts: int
    top_k: int

    @property
    def words(self) -> int:
        """W: int64 words of one layer's expert bitmap."""
        return (self.num_experts + 63) // 64


def score_chunk_rows(shape: ModelShape) -> int:
    """Rows the selector predicts at once: two float ``[rows, L, E]`` within
    :data:`SCORE_CHUNK_BYTES` (at least one row)."""
    return max(1, SCORE_CHUNK_BYTES // (2 * shape.num_layers * shape.num_experts * _F32))


@dataclasses.dataclass(frozen=True)
class PluginMemory:
    """ECOSPEC's device memory in one scheduler process, in bytes.

    Attributes:
        predictor: the predictor's state (the online table ``[buckets, L, E]`` and prior, or
            the head's weights).
        buffers: the persistent buffers sized by the largest batch (routing capture,
            predicted experts of the verify rows, root tokens, statistics, EP placement).
        step: per-step temporaries at the largest batch: the draft step's selection plus
            the work after a verify (both can be held at once: the draft CUDA graph keeps
            its pool).
    """

    predictor: int
    buffers: int
    step: int

    @property
    def persistent(self) -> int:
        return self.predictor + self.buffers

    @property
    def total(self) -> int:
        return self.predictor + self.buffers + self.step

    def describe(self) -> str:
        """The startup log line."""
        return (
            f"ECOSPEC reserves {self.total / MIB:.1f} MiB: predictor {self.predictor / MIB:.1f} "
            f"MiB, buffers {self.buffers / MIB:.1f} MiB, per-step temporaries "
            f"{self.step / MIB:.1f} MiB"
        )


def predictor_bytes(predictor) -> int:
    """Bytes of a built predictor's state tensors: the size it reports (``memory_bytes``,
    the context predictor's tables), else a module's state dict or the tensor attributes
    (the online predictor's ``counts`` and ``prior``)."""
    if hasattr(predictor, "memory_bytes"):
        return int(predictor.memory_bytes())
    from sglang_ecospec.tp_agreement import predictor_tensors

    return sum(t.numel() * t.element_size() for t in predictor_tensors(predictor))


def buffer_bytes(
    shape: ModelShape,
    *,
    max_batch: int,
    num_draft_tokens: int,
    ep_placement: bool,
    context: bool = False,
    live_recall: bool = False,
    stops_short: bool = False,
):
    """Bytes of the runtime's persistent buffers (each term names its owner); ``context``: a
    predictor that reads context, ``live_recall``: the recall-weighted cost's recall,
    ``stops_short``: sets that may stop short (``adaptive`` or a score floor) and so copy a
    leaf into SGLang's unused verify slots."""
    layers, experts, top_k = shape.num_layers, shape.num_experts, shape.top_k
    rows = max_batch * num_draft_tokens
    return (
        rows * layers * top_k * _I64  # routing.RoutingCapture.buffer
        + rows * layers * top_k * _I16  # selection.EcoSpecSelector.verify_topk
        + max_batch * (_I64 + _BOOL)  # selector.root_tokens, root_valid
        + (2 + layers) * _I64 * 2  # routing.VerifyStats.totals, _signs
        + layers * _I64
        + _BOOL  # VerifyStats._layer_index, _true
        + (layers * experts * _I64 if ep_placement else 0)  # ExpertPlacement.expert_rank
        # selector.root_context, verify_context; served_predictor.RootContext.tokens
        + ((2 * max_batch + rows) * _I64 if context else 0)
        # LiveRecall novel, trust, cost_fit (5 rows), hits, rows, novel_steps
        + (layers * (7 * _F32 + _F64) + _F64 + _F32 if live_recall else 0)
        # selector.copy_rows, fixed_width.CopyCheck.totals
        + (rows * _BOOL + 2 * _I64 if stops_short else 0)
    )


def selection_step_bytes(
    shape: ModelShape,
    *,
    batch: int,
    num_draft_tokens: int,
    topk: int,
    num_steps: int,
    predictor: str = "online",
) -> int:
    """An upper bound of the draft step's selection temporaries for ``batch`` requests (sum
    of its tensors, as if all were alive at once) with the ``predictor`` of the settings."""
    layers, experts, top_k, words = shape.num_layers, shape.num_experts, shape.top_k, shape.words
    n = num_candidates(topk, num_steps)
    rows = batch * (1 + n)  # root first, then the candidates
    chunk = min(rows, score_chunk_rows(shape))
    blocks = -(-rows // chunk)
    budget = num_draft_tokens - 1
    tree = batch * n * (_F32 + 3 * _I64) + batch * (1 + n) * _I64 + n * _I64  # scores, ids, parents
    tree += batch * (1 + (num_steps - 1) * topk) * _I64  # parent_list
    if predictor in ("vocab", "context", "adjacent"):
        # Cached top-K rows gathered (token, pair, chosen) and the pair hashes; each row's
        # parent token (the tree's context), and the verify rows' for observe.
        scoring = chunk * (layers * top_k * (3 * _BOOL + _I64) + 16 * _I64)
        scoring += 2 * rows * _I64 + batch * num_draft_tokens * 2 * _I64
    else:
        scoring = chunk * (4 * _I64 + 2 * layers * experts * _F32 + layers * top_k * _F32)
        scoring += 3 * layers * experts * _F32  # the prior's pseudo-counts
    predicted = rows * layers * top_k * _I64 * (2 if blocks > 1 else 1)  # blocks, then cat
    bitmaps = (2 * rows + batch * n + batch) * layers * words * _I64  # masked, op inputs
    op = batch * n * (_F32 * 2 + _BOOL) + batch * budget * _I64 + batch * layers * words * _I64
    verify = (
        batch * num_draft_tokens * (3 * _I64 + layers * top_k * _I64) + batch * budget * 2 * _I64
    )
    return tree + scoring + predicted + bitmaps + op + verify


def after_verify_bytes(
    shape: ModelShape,
    *,
    batch: int,
    num_draft_tokens: int,
    predictor: str = "online",
    live_recall: bool = False,
) -> int:
    """An upper bound of the temporaries after a verify of ``batch`` requests: the statistics,
    then the larger of the ``predictor``'s update (the online table's multi-hot ``[T, L, E]``;
    the context table's count updates, several ``[T, L, E]``) and, with ``live_recall``, the
    recall's (its multi-hot ``[T, L, E]``), which is freed before the predictor learns."""
    layers, experts, top_k = shape.num_layers, shape.num_experts, shape.top_k
    tokens = batch * num_draft_tokens
    stats = layers * experts * _BOOL + tokens * layers * top_k * top_k * _BOOL
    stats += (8 + 3 * layers) * _I64
    observe = tokens * layers * top_k * _I64  # routing with uncaptured rows clamped
    if predictor in ("vocab", "context", "adjacent"):
        observe += context_observe_bytes(
            shape, tokens, pairs=predictor != "vocab", recency=predictor == "adjacent"
        )
    else:
        observe += tokens * (layers * experts * _F32 + 5 * _I64) + 2 * layers * experts * _F32
    recall = 0
    if live_recall:  # LiveRecall.update: both ids as int64, two bitmaps, their overlap, counts
        recall = tokens * layers * (2 * top_k * _I64 + 3 * shape.words * _I64 + 4 * _F32)
        recall += tokens * (3 * _F32 + _BOOL) + 4 * layers * _F32
        # update_novel: the rows' multi-hot and their ids as int64; per request the other
        # roots' counts, then their union and its masks, and under EP the int64 copy the rank
        # loads are counted from and the loads; per-layer sums
        recall += tokens * layers * (experts * _F32 + top_k * _I64)
        recall += batch * layers * experts * (_F32 + 3 * _BOOL + 2 * _I64)
        recall += 6 * layers * (experts + 1) * _F32
        # update_cost_fit runs before it, one multi-hot at a time: within the bound above
    return stats + max(observe, recall)  # the recall is measured and freed before observe


def context_observe_bytes(
    shape: ModelShape, tokens: int, *, pairs: bool, recency: bool = False
) -> int:
    """``ContextExpertPredictor.observe``'s temporaries for ``tokens`` rows, at its peak: the
    float ``[T, L, E]`` alive inside a count update (the multi-hot, then the old, summed,
    new, scaled and floored counts), with a pair table also the token's counts and scores
    (8 of them, 6 without; with ``recency``, AdjacentExpertPredictor's, one more: the cached
    scores plus the latest routing), the gathered table rows, the ``[T, T]`` group masks, the
    top-K and per-row numbers."""
    layers, experts, top_k = shape.num_layers, shape.num_experts, shape.top_k
    dense = tokens * layers * experts
    floats = (8 if pairs else 6) + int(recency)
    return (
        floats * dense * _F32
        + dense * _BOOL
        + 2 * tokens * tokens * _BOOL
        + tokens * layers * (top_k * (_F32 + _I64 + _BOOL) + 4 * _F32)
        + 16 * tokens * _I64
        + 4 * layers * experts * _F32
    )


def plugin_memory_bytes(
    settings,
    shape: ModelShape,
    *,
    max_batch: int,
    num_draft_tokens: int,
    topk: int,
    num_steps: int,
    ep_placement: bool = False,
    predictor=None,
    vocab_size: int | None = None,
) -> PluginMemory:
    """ECOSPEC's device memory for these settings and this served model.

    Args:
        settings: the :class:`~sglang_ecospec.settings.EcoSpecSettings`.
        shape: the target's MoE shape.
        max_batch: rows of the batch-sized buffers (the most requests of one decode batch).
        num_draft_tokens: D; topk, num_steps: the draft tree (K, S).
        ep_placement: an expert -> EP rank map is kept (EP cost under expert parallelism).
        predictor: the built predictor, measured; None: the fresh table of ``settings``
            (a ``predictor_file`` or a head needs the built predictor).
        vocab_size: the target's vocabulary, which sizes a fresh ``vocab`` or ``context``
            table (with ``predictor`` None).
    """
    from sglang_ecospec.settings import VOCAB_PREDICTORS

    fresh = predictor is None and settings.predictor_file is None
    if predictor is not None:
        table = predictor_bytes(predictor)
    elif fresh and settings.predictor == "online":
        table = (settings.num_buckets + 1) * shape.num_layers * shape.num_experts * _F32
    elif fresh and settings.predictor in VOCAB_PREDICTORS and vocab_size is not None:
        from sgl_ecospec.predictors import make_predictor

        # The library's own table, on the meta device: its size without its memory.
        table = make_predictor(
            settings.predictor,
            shape.num_layers,
            shape.num_experts,
            shape.top_k,
            vocab_size=vocab_size,
            device="meta",
        ).memory_bytes()
    elif fresh and settings.predictor in VOCAB_PREDICTORS:
        raise ValueError(
            f"predictor {settings.predictor!r} is sized by the vocabulary: pass vocab_size"
        )
    else:
        raise ValueError("a predictor read from a file is measured: pass the built predictor")
    context = settings.predictor in VOCAB_PREDICTORS
    buffers = buffer_bytes(
        shape,
        max_batch=max_batch,
        num_draft_tokens=num_draft_tokens,
        ep_placement=ep_placement,
        context=context,
        live_recall=settings.recall_weighted_cost,
        stops_short=options.stops_short(settings.policy, settings.min_score),
    )
    sizes = {"batch": max_batch, "num_draft_tokens": num_draft_tokens}
    step = selection_step_bytes(
        shape, topk=topk, num_steps=num_steps, predictor=settings.predictor, **sizes
    ) + after_verify_bytes(
        shape, predictor=settings.predictor, live_recall=settings.recall_weighted_cost, **sizes
    )
    if settings.calibrated_acceptance:
        tree = {"topk": topk, "num_steps": num_steps, "num_draft_tokens": num_draft_tokens}
        buffers += acceptance.buffer_bytes(max_batch=max_batch, **tree)
        step += acceptance.step_bytes(batch=max_batch, **tree)
    return PluginMemory(predictor=table, buffers=buffers, step=step)


def max_batch_bound() -> int | None:
    """The most requests one decode batch of this scheduler can hold, from SGLang's resolved
    configuration, before the pools exist: ``--max-running-requests`` per attention-DP rank
    (SGLang sets 48 for the EAGLE family when none is given; the pool may allow fewer), plus
    the request pool's reserved slot 0, as ``req_to_token`` counts rows. None when unknown."""
    from sglang.srt.runtime_context import get_parallel, get_schedule

    requests = get_schedule().max_running_requests
    if not requests:
        return None
    return max(1, requests // max(1, get_parallel().attn_dp_size)) + 1


class Reservation:
    """A placeholder of ``nbytes`` on ``device``, held while SGLang sizes the KV pool.

    On a CUDA device the bytes are allocated at once and returned to the device by
    :meth:`release` (``empty_cache``), so the KV pool is sized without them and the
    per-step temporaries find them free later. On the CPU nothing is allocated.
    """

    def __init__(self, nbytes: int, device):
        self.nbytes = int(nbytes)
        self.device = torch.device(device)
        self.held = True
        self._placeholder = None
        if self.device.type == "cuda" and self.nbytes > 0:
            self._placeholder = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)

    def release(self) -> None:
        """Frees the placeholder (once; later calls do nothing)."""
        if self._placeholder is not None:
            self._placeholder = None
            torch.cuda.empty_cache()
        self.held = False
