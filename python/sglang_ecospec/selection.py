"""ECOSPEC's verify-set selection, in place of SGLang's ``organize_draft_results``.

EAGLE's draft step (``EagleDraftWorker.draft_forward``) grows a tree of candidates and then
calls ``eagle_utils.organize_draft_results(score_list, token_list, parents_list, ndt)``,
which keeps the ``ndt - 1`` candidates of highest cumulative probability. With ECOSPEC active
in the process, :func:`organize_hook` (an AROUND hook) hands the same inputs to the active
:class:`EcoSpecSelector`, which picks by P / (DeltaCost + eps) with the library's one
selection step, ``sgl_ecospec.step.select_step`` (the offline engine's too; its
``select_verify_set`` runs the CUDA op on GPU, the C++ op on CPU), and returns exactly what
SGLang expects. Without an active selector (EAGLE, EAGLE3, ...) the hook calls the original.

SGLang's tree, per request (``select_top_k_tokens``): step 0 proposes K candidates (children
of the root), each later step K*K (K children for each of the K candidates the previous step
expanded); ``scores`` are cumulative path probabilities. Flattened: N = K + (S-1) K^2
candidates, and ``parent_list = cat(parents_list[:-1])`` (``[B, 1 + (S-1) K]``: -1 for the
root, then the candidates each step expanded) gives candidate c's parent as
``parent_list[c // K]``.

Returned, as ``organize_draft_results``: ``parent_list`` unchanged, ``top_scores_index``
``[B, ndt-1]`` ascending and ancestor-closed (every chosen node's parent is chosen or the
root), ``draft_tokens`` ``[B, ndt-1]`` the chosen candidates' tokens.

Under expert parallelism the selector passes the EP placement (``expert_rank [L, E]``, a
persistent buffer that EPLB updates refresh in place, :mod:`sglang_ecospec.ep_placement`)
with ``num_ranks`` and ``total_weight``; with ``eps="auto"`` it looks eps up by batch size in
the cost model's table (:mod:`sglang_ecospec.eps_table`), on the host.

Expert predictions: the online predictor reads candidate token ids only; the ``vocab`` and
``context`` predictors (:class:`sgl_ecospec.predictors.ContextExpertPredictor`) also each row's
parent token (``needs_context``): a candidate's parent candidate's token, the root's for a
child of the root, and for the root the token verified before it (:meth:`EcoSpecSelector.
set_roots`, -1 where unknown), built by the library's ``tree_context``; the parent tokens of
the verify rows are kept for ``observe`` (:attr:`EcoSpecSelector.verify_context`). A trained
:class:`sgl_ecospec.predictors.LowRankExpertHead` also reads the draft state that proposed each
candidate, which :func:`select_hook` (an AROUND hook on SGLang's ``select_top_k_tokens``, the
per-step function that receives those states) hands to the selector: at step 0 the root's
state ``[B, H]`` proposes all K candidates, at step i the K beams' states ``[B*K, H]`` propose
K children each. The predictions of the verify rows (root, then the chosen candidates) are kept
in a persistent buffer, so the predictor's recall is measured on what selection used.

Recall-weighted cost (setting ``recall_weighted_cost``): DeltaCost trusts only what the
predictor knows, as the offline engine's: each layer's trust from the predictor's
:class:`sgl_ecospec.predictors.LiveRecall` (fed after every verify by the runtime) and the
cost of what it does not know (the new experts verified candidates really add to their
step's roots, per candidate, measured after each verify) added to eps, folded into the
layer weights on the device (``LiveRecall.weigh`` without ``host_eps``) so that nothing is
read on the host.

Calibrated acceptance (setting ``calibrated_acceptance``, :mod:`sglang_ecospec.acceptance`):
with policy "ecospec" the scores handed to ``select_step`` are the calibrated acceptance
probabilities of the library's ``AcceptanceCalibrator`` instead of the draft's cumulative
probabilities ("confidence" keeps SGLang's ranking: it is the arm that reproduces EAGLE3's
verify sets); under either policy the tree, the verified set and its forecast are kept for
learning after the verify.

Tensor parallelism: every rank of an attention-TP group selects on the same batch, but its
predictor tables are learnt from its own captured routing and may drift apart, so with more
than one rank the selector takes rank 0's result (one in-graph broadcast,
:mod:`sglang_ecospec.tp_agreement`); with one rank nothing is added.

Memory: the predictor scores every row ``[rows, L, E]`` in float before its top-K, so the
selector predicts in blocks of at most ``score_rows`` rows (:class:`BlockPredictor`; from
:func:`sglang_ecospec.memory.score_chunk_rows`, 64 MiB of scoring per block), the same
predictions whatever the block size.

Graph safety: static shapes, no host sync (``validate=False``, the batch size and eps are
Python numbers), persistent state (the predictor's tables, the root-token buffers, the
placement) updated in place; the only allocations are the op outputs, as in SGLang's own
function. ``torch.compile(fullgraph=True)`` traces :meth:`EcoSpecSelector.organize` as one
graph (test/plugin/test_graph_safety.py).

Shape legend: B = requests, N = candidates per request, K = draft top-k, S = draft steps,
L = MoE layers, W = int64 words per layer bitmap, D = num draft tokens (ndt).
"""

import logging

import torch

from sgl_ecospec.predictors import ExpertPredictor, LiveRecall
from sgl_ecospec.step import batch_index, fill_unused_slots, select_step, verify_rows
from sglang_ecospec.acceptance import AcceptanceTracker
from sglang_ecospec.ep_placement import ExpertPlacement
from sglang_ecospec.eps_table import BatchOptions, EpsTable
from sglang_ecospec.fixed_width import copy_rows
from sglang_ecospec.hooks import HookSlot
from sglang_ecospec.memory import ModelShape, score_chunk_rows
from sglang_ecospec.settings import EcoSpecSettings
from sglang_ecospec.tp_agreement import TpAgreement

logger = logging.getLogger(__name__)

ORGANIZE_TARGET = "sglang.srt.speculative.eagle_utils.organize_draft_results"
SELECT_TARGET = "sglang.srt.speculative.spec_utils.select_top_k_tokens"


def candidate_parents(parent_list: torch.Tensor, num_candidates: int, topk: int) -> torch.Tensor:
    """Parent candidate of every candidate (-1 = the root).

    Args:
        parent_list: int, ``[B, 1 + (S-1) K]`` (``[B, 0]`` for one draft step).
        num_candidates: N.
        topk: K.

    Returns:
        int64 ``[B, N]``.
    """
    batch = parent_list.shape[0]
    if parent_list.shape[1] == 0:
        return torch.full((batch, num_candidates), -1, dtype=torch.int64, device=parent_list.device)
    slots = torch.arange(num_candidates, device=parent_list.device) // topk  # [N]
    return parent_list[:, slots].long()


class BlockPredictor:
    """A predictor's ``predict_topk`` over at most ``rows`` rows at a time (the predictions
    are per row, so the result is the same; only the peak of the float scoring temporaries
    changes), timed by ``timer`` (a :class:`sglang_ecospec.metrics.PredictTimer`, or None).
    What ``sgl_ecospec.step.select_step`` reads of a predictor."""

    def __init__(self, predictor: ExpertPredictor, rows: int, timer=None):
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.predictor = predictor
        self.rows = rows
        self.timer = timer
        self.num_layers = predictor.num_layers
        self.num_experts = predictor.num_experts
        self.top_k = predictor.top_k
        self.needs_hidden = predictor.needs_hidden
        self.needs_context = predictor.needs_context

    def predict_topk(
        self, token_ids, hidden=None, *, validate=False, context_tokens=None
    ) -> torch.Tensor:
        """``predict_topk`` of the wrapped predictor, block by block; int64 ``[T, L, K]``
        (``context_tokens`` int64 ``[T]`` only for a predictor that ``needs_context``)."""
        started = None if self.timer is None else self.timer.start()
        predict = self.predictor.predict_topk
        extra = {} if context_tokens is None else {"context_tokens": context_tokens}
        if token_ids.shape[0] <= self.rows:
            out = predict(token_ids, hidden, validate=validate, **extra)
        else:
            ids = token_ids.split(self.rows)
            states = [None] * len(ids) if hidden is None else hidden.split(self.rows)
            contexts = [None] * len(ids)
            if context_tokens is not None:
                contexts = context_tokens.split(self.rows)
            blocks = [
                predict(i, h, validate=validate, **({} if c is None else {"context_tokens": c}))
                for i, h, c in zip(ids, states, contexts, strict=True)
            ]
            out = torch.cat(blocks)
        if self.timer is not None:
            self.timer.stop(started)
        return out


class EcoSpecSelector:
    """Cost-aware verify-set selection with persistent, graph-safe state.

    Args:
        settings: the validated EcoSpec settings (policy, eps, share_buffer, total_weight).
        predictor: expert predictor (token ids, plus draft states when it ``needs_hidden``).
        topk: K (``--speculative-eagle-topk``).
        num_draft_tokens: D (``--speculative-num-draft-tokens``): verify rows per request.
        max_batch: most requests of one decode batch (sizes the root and prediction buffers).
        device: where the buffers live.
        placement: the EP placement (its ``expert_rank`` int64 ``[L, E]`` on ``device``,
            ``num_ranks``), or None: experts priced without EP.
        eps_table: eps by batch size, required with ``settings.eps == "auto"`` and only
            then.
        tp_sync: with more than one rank sharing the batch, the group's
            :class:`~sglang_ecospec.tp_agreement.TpAgreement`: every rank returns rank 0's
            selection. None (one rank): no collective.
        score_rows: rows predicted at once (:class:`BlockPredictor`); None:
            :func:`sglang_ecospec.memory.score_chunk_rows` of the predictor's shape.
        acceptance: the calibrated acceptance (setting ``calibrated_acceptance``): policy
            "ecospec" weighs calibrated acceptance probabilities, and the tree, verify set
            and forecast are kept for learning after the verify; None: the draft's
            cumulative probabilities, nothing kept.
        timer: times each step's prediction (:class:`sglang_ecospec.metrics.PredictTimer`),
            or None.
    """

    def __init__(
        self,
        settings: EcoSpecSettings,
        predictor: ExpertPredictor,
        *,
        topk: int,
        num_draft_tokens: int,
        max_batch: int,
        device,
        placement: ExpertPlacement | None = None,
        eps_table: EpsTable | None = None,
        tp_sync: TpAgreement | None = None,
        score_rows: int | None = None,
        acceptance: AcceptanceTracker | None = None,
        timer=None,
    ):
        if settings.eps_auto != (eps_table is not None):
            raise ValueError("eps_table is required with eps='auto' and only then")
        if placement is not None and tuple(placement.expert_rank.shape) != (
            predictor.num_layers,
            predictor.num_experts,
        ):
            raise ValueError(
                f"placement covers {tuple(placement.expert_rank.shape)} (layers, experts), "
                f"the predictor ({predictor.num_layers}, {predictor.num_experts})"
            )
        self.settings = settings
        self.predictor = predictor
        if score_rows is None:
            shape = ModelShape(predictor.num_layers, predictor.num_experts, predictor.top_k)
            score_rows = score_chunk_rows(shape)
        self.block_predictor = BlockPredictor(predictor, score_rows, timer)
        self.topk = topk
        self.num_draft_tokens = num_draft_tokens
        self.placement = placement
        self.tp_sync = tp_sync
        self.acceptance = acceptance
        self.options_for = BatchOptions(settings, eps_table)
        # The options of a batch of one: what every batch size shares (policy, floor, EP
        # weight) is read from them.
        self.options = self.options_for(1)
        self.eps_table = eps_table
        # Predicted experts of the last selection's verify rows, in SGLang's verify order
        # (per request: the root, then the chosen candidates); int16 holds any expert id.
        self.verify_topk = torch.zeros(
            max_batch * num_draft_tokens,
            predictor.num_layers,
            predictor.top_k,
            dtype=torch.int16,
            device=device,
        )  # [Bmax * D, L, K]
        # Sets that may stop short ("adaptive", min_score): which verify rows of the last
        # selection copy a chosen leaf.
        self.copy_rows = None
        if self.options.stops_short:
            self.copy_rows = torch.zeros(
                max_batch, num_draft_tokens, dtype=torch.bool, device=device
            )  # [Bmax, D]
        # Draft states of the tree being grown, one entry per step (select_hook).
        self._states: list[torch.Tensor] = []
        # Each request's root (bonus) token, copied in before the draft step; padded rows of
        # a graph replay are marked invalid so they neither seed nor take experts.
        self.root_tokens = torch.zeros(max_batch, dtype=torch.int64, device=device)  # [Bmax]
        self.root_valid = torch.zeros(max_batch, dtype=torch.bool, device=device)  # [Bmax]
        self.root_context = None  # int64 [Bmax]: the token before each root, -1 unknown
        self.verify_context = None  # int64 [Bmax * D]: the verify rows' parent tokens
        if predictor.needs_context:
            self.root_context = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
            self.verify_context = torch.full(
                (max_batch * num_draft_tokens,), -1, dtype=torch.int64, device=device
            )
        # The predictor's live recall, which the runtime updates after each verify.
        self.live_recall = None
        if settings.recall_weighted_cost:
            self.live_recall = LiveRecall.of(predictor, device)

    @property
    def max_batch(self) -> int:
        return self.root_tokens.shape[0]

    def set_roots(
        self, bonus_tokens: torch.Tensor | None, root_context: torch.Tensor | None = None
    ) -> None:
        """Records the batch's bonus tokens ``[B]`` (None: unknown, seed nothing) and, for a
        predictor that reads context, the token verified before each (int64 ``[B]``, -1
        unknown; None: all unknown)."""
        if bonus_tokens is None or bonus_tokens.dim() != 1:
            self.root_valid.zero_()
            return
        count = min(bonus_tokens.shape[0], self.max_batch)
        self.root_tokens[:count].copy_(bonus_tokens[:count])
        self.root_valid[:count] = True
        self.root_valid[count:] = False
        if self.root_context is not None:
            if root_context is None:
                self.root_context.fill_(-1)
            else:
                self.root_context[:count].copy_(root_context[:count])

    def record_draft_states(self, step: int, hidden_states: torch.Tensor) -> None:
        """Keeps the draft states that propose step ``step``'s candidates (``[B, H]`` at step
        0, the beams' ``[B*K, H]`` after), when the predictor reads them."""
        if not self.predictor.needs_hidden:
            return
        if step == 0:
            self._states = []
        self._states.append(hidden_states)

    def _candidate_states(self, batch: int, num_candidates: int):
        """(root states ``[B, H]``, candidate states ``[B, N, H]``) of the current tree."""
        if not self._states:
            raise RuntimeError(
                "the expert head needs the draft states, but select_top_k_tokens reported "
                "none (SGLang's topk-1 chain path skips it: serve with --speculative-eagle-topk "
                "> 1, or use SGLANG_ECOSPEC_PREDICTOR=online)"
            )
        root = self._states[0]
        per_step = [root[:, None].expand(-1, self.topk, -1)]
        per_step += [
            s.view(batch, self.topk, -1).repeat_interleave(self.topk, 1) for s in self._states[1:]
        ]
        states = torch.cat(per_step, 1)
        size = getattr(self.predictor, "hidden_size", states.shape[-1])
        if states.shape[:2] != (batch, num_candidates) or states.shape[-1] != size:
            raise ValueError(
                f"draft states of shape {tuple(states.shape)} do not fit {num_candidates} "
                f"candidates of {batch} requests with the head's hidden size {size}: the head "
                "must be trained on this draft model (sgl-ecospec train-head)"
            )
        return root, states

    def selects(self, num_draft_tokens: int) -> bool:
        """Whether a step verifying ``num_draft_tokens`` rows per request is EcoSpec's to
        select: only the configured width; another is the utility gate's narrow level, whose
        one slot per request takes the draft's most likely token as SGLang's code does."""
        return num_draft_tokens == self.num_draft_tokens

    def organize(
        self,
        score_list: list[torch.Tensor],
        token_list: list[torch.Tensor],
        parents_list: list[torch.Tensor],
        num_draft_token: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``organize_draft_results`` with EcoSpec's selection (same arguments, same results)."""
        scores = torch.cat(score_list, dim=1).flatten(1)  # [B, N]
        tokens = torch.cat(token_list, dim=1)  # [B, N]
        batch, num_candidates = scores.shape
        if len(parents_list) > 1:
            parent_list = torch.cat(parents_list[:-1], dim=1)  # [B, 1 + (S-1) K]
        else:
            parent_list = torch.empty(batch, 0, dtype=torch.long, device=scores.device)
        budget = num_draft_token - 1
        if budget > num_candidates:
            raise ValueError(
                f"speculative_num_draft_tokens - 1 = {budget} exceeds the {num_candidates} "
                "draft candidates"
            )
        parents = candidate_parents(parent_list, num_candidates, self.topk)  # [B, N]
        root_context = None
        if batch <= self.max_batch:
            roots, valid = self.root_tokens[:batch], self.root_valid[:batch]
            if self.root_context is not None:
                root_context = self.root_context[:batch]
        else:  # an eager batch past the captured maximum: no seeds, no root context
            roots = torch.zeros(batch, dtype=torch.int64, device=scores.device)
            valid = torch.zeros(batch, dtype=torch.bool, device=scores.device)
        states = None
        if self.predictor.needs_hidden:
            root_states, candidate_states = self._candidate_states(batch, num_candidates)
            states = torch.cat([root_states[:, None], candidate_states], 1)  # [B, 1 + N, H]
        options = self.options_for(batch)
        raw = probs = scores.float()  # [B, N]
        calibrated = self.acceptance is not None and self.acceptance.fits(num_candidates)
        if calibrated:
            probs = self.acceptance.calibrate(raw, parents)
        # "confidence" stays SGLang's ranking (the A/B arm that verifies EAGLE3's sets); the
        # calibration weighs P against DeltaCost + eps, and forecasts under either policy.
        weights = raw if self.settings.policy == "confidence" else probs
        step = select_step(
            self.block_predictor,
            torch.cat([roots[:, None], tokens.long()], 1),  # [B, 1 + N], root first
            weights,
            parents,
            budget,
            options,
            states=states,
            valid=valid,
            placement=self.placement,
            root_context=root_context,
            live_recall=self.live_recall,
        )
        index = step.selected  # [B, D-1] ascending; complete, every candidate is reachable
        stops_short = self.options.stops_short
        if stops_short:  # SGLang's verify is fixed-width: unused slots copy a chosen leaf
            index = fill_unused_slots(index, weights, parents)
        draft_tokens = torch.gather(tokens, 1, index.clamp_min(0))  # [B, D-1]
        predicted = step.verify_predicted  # [B, D, L, K]: root, then the chosen candidates
        if stops_short or self.tp_sync is not None:
            # Rank 0's tree on every rank of the group; this rank's predictions of its rows.
            if self.tp_sync is not None:
                parent_list, index, draft_tokens = self.tp_sync.broadcast_selection(
                    parent_list, index, draft_tokens
                )
            rows = verify_rows(index)  # [B, D]
            predicted = step.predicted[batch_index(rows), rows]
        if batch <= self.max_batch and num_draft_token == self.num_draft_tokens:
            verified = predicted.shape[0] * predicted.shape[1]
            self.verify_topk[:verified].copy_(predicted.flatten(0, 1))
            if self.verify_context is not None:  # for observe after the verify
                rows = verify_rows(index)  # [B, D]
                context = step.context[batch_index(rows), rows]  # [B, D]
                self.verify_context[:verified].copy_(context.flatten())
            copies = None
            if stops_short:  # for the tree hook and the routing check after the verify
                copies = copy_rows(index)  # [B, D]
                self.copy_rows[:batch].copy_(copies)
            if calibrated:  # the verified set (rank 0's), for learning after the verify
                # Copies are never visited by verification: learnt as not verified.
                kept = index if copies is None else index.masked_fill(copies[:, 1:], -1)
                self.acceptance.record(raw, parents, probs, kept)
        return parent_list, index, draft_tokens


# The selector of this process's ECOSPEC worker; empty, both hooks run SGLang's code.
slot: HookSlot[EcoSpecSelector] = HookSlot("selector")


@slot.hook(SELECT_TARGET)
def select_hook(original, i, topk_p, topk_index, hidden_states, scores, topk):
    """AROUND hook on ``select_top_k_tokens``: hands step ``i``'s draft states (``[B, H]`` at
    step 0, ``[B*K, H]`` after) to the active selector, then runs SGLang's function
    unchanged."""
    selector = slot.active()
    if selector is not None:
        selector.record_draft_states(i, hidden_states)
    return original(i, topk_p, topk_index, hidden_states, scores, topk)


@slot.hook(ORGANIZE_TARGET)
def organize_hook(original, score_list, token_list, parents_list, num_draft_token):
    """AROUND hook on ``organize_draft_results``: ECOSPEC's selection when a selector is
    active and the step verifies the configured width (arguments and results as
    :meth:`EcoSpecSelector.organize`)."""
    selector = slot.active()
    if selector is None or not selector.selects(num_draft_token):
        return original(score_list, token_list, parents_list, num_draft_token)
    return selector.organize(score_list, token_list, parents_list, num_draft_token)
