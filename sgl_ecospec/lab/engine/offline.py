"""Offline tree speculative decoding on transformers, with the target's real routing.

One speculative step for a batch (all requests in lockstep, as SGLang's worker runs them):

1. draft: grow each request's candidate tree from its root (the last verified token) with
   SGLang's EAGLE-3 growth (``tree.grow_tree``);
2. predict: the expert predictor guesses every candidate's and root's top-K experts per MoE
   layer (the oracle first runs the target over the whole tree to learn the truth);
3. select: ``select_verify_set`` picks num_draft_tokens - 1 ancestor-closed candidates per
   request (policy "confidence" is SGLang's ``organize_draft_results``; "adaptive" may pick
   fewer, down to none; "evict" cuts confidence's choice to its best prefix,
   ``engine.evict``), with the spec's eps, layer weights, EP placement and adaptive
   account; P is the draft's cumulative probability, or with ``calibrated_acceptance`` the
   calibrated acceptance probability (``sgl_ecospec.acceptance``);
4. verify: one target forward over root + selected rows, tree-masked over the KV cache,
   capturing logits, EAGLE-3 aux states and per-layer routing;
5. accept: the longest path whose tokens equal the target's argmax, plus the bonus token;
   the target cache keeps exactly the root and the accepted tokens;
6. record and learn: accepted counts, distinct experts per layer over all verified tokens
   of the batch (and their union bitmap, for per-rank loads), predictor recall on them;
   the predictor observes their routing (with their draft states, and their parent tokens
   for predictors that read context, ``engine.predictor_inputs``) and its live recall per
   layer is updated (``SpecConfig.recall_weighted_cost`` selects with it); the acceptance
   calibrator learns which verified nodes were accepted, after the step recorded its
   predicted accepted tokens (raw and calibrated); with a paired selection (``compare``),
   the true expert unions of both verify sets (below);
7. draft extend: the draft reads the accepted rows' aux states, which seeds the next root.

Paired selections. ``generate_speculative(..., compare=other_spec)`` (or a tuple of specs)
also runs each one's selection on every step's tree and predictions, without verifying it,
and records the true expert union and accepted tokens of every verify set, read from one
extra target pass over the whole tree (as the oracle's): policies compared on the same
steps, free of the noise of decodes drifting apart.

Shape legend: B = requests, P = longest prompt, T = verify rows, N = candidates, L = MoE
layers, K = experts per token, W = bitmap words per layer.
"""

import os
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sgl_ecospec.acceptance import AcceptanceCalibrator
from sgl_ecospec.lab.engine.calibration import predicted_acceptance, resolve_calibrator
from sgl_ecospec.lab.engine.config import SpecConfig
from sgl_ecospec.lab.engine.drafter import Drafter
from sgl_ecospec.lab.engine.evict import EVICT, evict_step, reselect
from sgl_ecospec.lab.engine.oracle import OracleExpertPredictor
from sgl_ecospec.lab.engine.predictor_inputs import (
    last_prompt_tokens,
    next_root_context,
    record_recall,
    verified_context,
)
from sgl_ecospec.lab.engine.requests import Requests
from sgl_ecospec.lab.engine.stats import (
    GreedyResult,
    SpecResult,
    StepStats,
    overall_recall,
    selected_score,
    selection_union,
    step_stats,
)
from sgl_ecospec.lab.engine.tree import (
    DraftTree,
    VerifyTree,
    accepted_within,
    build_verify_tree,
    greedy_accept,
)
from sgl_ecospec.models.eagle3 import Eagle3Draft
from sgl_ecospec.models.kvcache import BatchKVCache, padded_causal_mask
from sgl_ecospec.models.target import TargetModel
from sgl_ecospec.predictors import ExpertPredictor, LiveRecall, OnlineExpertPredictor, topk_recall
from sgl_ecospec.step import (
    Placement,
    SelectionOptions,
    batch_index,
    select_step,
    verify_rows,
)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class OfflineEngine:
    """A Hugging Face MoE target plus an EAGLE-3 draft, decoding batches greedily.

    Args:
        target_dir: transformers checkpoint of the target (e.g. ``Qwen2MoeForCausalLM``).
        draft_dir: EAGLE-3 draft directory (``Eagle3Draft.save_pretrained`` / SGLang
            format), or None for plain greedy decoding only.
        device, dtype: where and in which float type both models run.
        attn_implementation: the target's attention, "sdpa" or "eager".

    Attributes:
        tokenizer: the target's tokenizer, or None when the directory has none.
        num_layers: L, MoE layers of the target (routing rows per token).
        num_experts: E, experts per MoE layer.
        top_k: K, experts per token.
        eos_token_ids: tokens that end a request (from the target's configs; may be edited).
    """

    def __init__(
        self,
        target_dir: str,
        draft_dir: str | None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        attn_implementation: str = "sdpa",
    ):
        self.device = torch.device(device)
        model = AutoModelForCausalLM.from_pretrained(
            target_dir, dtype=dtype, attn_implementation=attn_implementation
        )
        self.target = TargetModel(model, device=device)
        self.draft: Eagle3Draft | None = None
        if draft_dir is not None:
            self.draft = Eagle3Draft.from_pretrained(draft_dir, dtype=dtype, device=device).eval()
            if self.draft.config.vocab_size != self.target.config.vocab_size:
                raise ValueError(
                    f"draft vocab_size {self.draft.config.vocab_size} differs from the "
                    f"target's {self.target.config.vocab_size}"
                )
            self.target.set_aux_layers(self.draft.config.aux_layer_ids)
        has_tokenizer = any(os.path.exists(os.path.join(target_dir, f)) for f in _TOKENIZER_FILES)
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir) if has_tokenizer else None
        self.num_layers = len(self.target.moe_layers)
        self.num_experts = self.target.num_experts
        self.top_k = self.target.top_k
        self.eos_token_ids = _eos_token_ids(self.target.model)

    @torch.no_grad()
    def generate_greedy(self, prompts: list[list[int]], max_new_tokens: int) -> GreedyResult:
        """The target alone, one token per request per step (the lossless reference).

        Args:
            prompts: token ids per request (each non-empty).
            max_new_tokens: output cap per request.

        Returns:
            outputs per prompt and one :class:`StepStats` per decode step (accepted all 0).
        """
        requests = Requests(len(prompts), max_new_tokens, self.eos_token_ids)
        if not requests.active:
            return GreedyResult(requests.outputs, [])
        cache, roots, _ = self._prefill(prompts)
        rows = requests.emit(roots[:, None].tolist())
        steps = []
        while requests.active:
            if rows is not None:
                cache.select(rows)
                roots = roots[rows]
            batch = roots.shape[0]
            ids = list(requests.active)
            out = self.target.forward(
                roots[:, None],
                cache.lengths[:, None],
                cache,
                torch.ones(batch, 1, 1, dtype=torch.bool, device=self.device),
            )
            cache.commit(torch.zeros(batch, 1, dtype=torch.int64, device=self.device))
            roots = out.logits[:, 0].argmax(-1)
            routing = out.routing.flatten(0, 1)  # [B, L, K]
            steps.append(
                step_stats(routing, self.num_experts, accepted=[0] * batch, request_ids=ids)
            )
            rows = requests.emit(roots[:, None].tolist())
        return GreedyResult(requests.outputs, steps)

    @torch.no_grad()
    def generate_speculative(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        spec: SpecConfig,
        predictor: ExpertPredictor | str = "online",
        progress: Callable[[StepStats], None] | None = None,
        compare: SpecConfig | tuple[SpecConfig, ...] | None = None,
        calibrator: AcceptanceCalibrator | None = None,
        exchange=None,
    ) -> SpecResult:
        """Tree speculative decoding; greedy, so outputs equal :meth:`generate_greedy`'s.

        Args:
            prompts: token ids per request (each non-empty).
            max_new_tokens: output cap per request.
            spec: tree shape and selection policy.
            predictor: an :class:`ExpertPredictor` (used and updated in place), "online" (a
                fresh :class:`OnlineExpertPredictor`) or "oracle" (the true routing, at the
                cost of one extra target forward over the whole tree per step).
            progress: called with each step's :class:`StepStats` as it completes.
            compare: another selection (or a tuple of them), scored on every step's tree
                and predictions but not verified (``evict``'s cut applied); each step then
                records ``paired_bitmaps``, ``paired_scores``, ``paired_accepted`` and
                ``paired_verified``, this run's set first (one extra target forward over the
                whole tree per step, shared with the oracle's). Their tree growth (topk,
                num_steps, tree_attention) must be ``spec``'s.
            calibrator: the acceptance calibrator (used and updated in place, so it can
                carry over between calls), or None for a fresh one; it learns whether or
                not ``spec.calibrated_acceptance`` lets selection read it.
            exchange: the testbed experts' measured prices in the priced profile's loads
                (``bench.expert_exchange.ExpertExchange``: ``adjust(options, extra)`` and
                ``update(routing, valid)``; used and updated in place), or None: with it
                every step selects with ``spec.layer_weights`` (required then) and, under
                EP, ``total_weight`` at those prices.

        Returns:
            outputs, one :class:`StepStats` per verify step, and the predictor's recall
            over every verified token.
        """
        if self.draft is None:
            raise ValueError("speculative decoding needs a draft: pass draft_dir to the engine")
        selection = self._selection_arguments(spec)
        if exchange is not None and spec.layer_weights is None:
            raise ValueError("exchange scales spec.layer_weights: set them (the prior weights)")
        compared = (compare,) if isinstance(compare, SpecConfig) else (compare or ())
        paired = tuple(self._paired_arguments(spec, c) for c in compared) or None
        predictor = self._resolve_predictor(predictor)
        calibrator = resolve_calibrator(calibrator, spec.num_steps, self.device)
        requests = Requests(len(prompts), max_new_tokens, self.eos_token_ids)
        if not requests.active:
            return SpecResult(requests.outputs, [], None)
        cache, roots, aux = self._prefill(prompts)
        drafter = Drafter(
            self.draft, self.target.embed, len(prompts), spec.topk, spec.tree_attention
        )
        # Draft extend over the prompt: row t reads the target state at x_t and embeds
        # x_{t+1}; the last row embeds the first generated token.
        lengths = cache.lengths.clone()
        next_tokens = torch.nn.functional.pad(self._pad(prompts)[:, 1:], (0, 1))
        next_tokens.scatter_(1, (lengths - 1)[:, None], roots[:, None])
        drafter.extend(next_tokens, aux, lengths)
        rows = requests.emit(roots[:, None].tolist())
        root_context = last_prompt_tokens(prompts, self.device)  # [B]: the token before each root
        steps = []
        while requests.active:
            if rows is not None:
                cache.select(rows)
                drafter.select(rows)
                roots, root_context = roots[rows], root_context[rows]
            step, next_roots, new_tokens = self._speculative_step(
                spec,
                selection,
                predictor,
                drafter,
                cache,
                roots,
                paired,
                calibrator,
                root_context,
                exchange,
            )
            root_context, roots = next_root_context(roots, new_tokens), next_roots
            step.request_ids = list(requests.active)
            steps.append(step)
            if progress is not None:
                progress(step)
            rows = requests.emit(new_tokens)
        return SpecResult(requests.outputs, steps, overall_recall(steps))

    def _speculative_step(
        self,
        spec: SpecConfig,
        selection: dict,
        predictor: ExpertPredictor,
        drafter: Drafter,
        cache: BatchKVCache,
        roots: torch.Tensor,
        paired: tuple[tuple[SpecConfig, tuple], ...] | None,
        calibrator: AcceptanceCalibrator,
        root_context: torch.Tensor | None = None,
        exchange=None,
    ) -> tuple[StepStats, torch.Tensor, list[list[int]]]:
        """Draft, select, verify, accept, record, learn and draft-extend once.

        Args:
            selection: the keyword arguments of ``select_verify_set`` that come from
                ``spec`` (``_selection_arguments``).
            roots: int64 ``[B]``: each request's last verified token (not yet in the cache).
            paired: (config, selection keywords) of each compared selection, or None.
            calibrator: the acceptance calibrator; learns from this step's verify result.
            root_context: int64 ``[B]``: the token before each root (for predictors that
                read context), or None (unknown).
            exchange: the measured exchange rate, or None (``generate_speculative``).

        Returns:
            the step's stats, the next roots ``[B]`` and each request's new tokens (accepted
            drafts then the bonus token).
        """
        tree = drafter.grow(spec.num_steps)
        tokens = torch.cat([roots[:, None], tree.tokens], 1)  # [B, 1 + N], root first
        # The draft states behind the predictions: the root's own (after reading the root),
        # then the one that proposed each candidate.
        hidden = None  # [B, 1 + N, H], gathered only for predictors that read it
        if predictor.needs_hidden:
            hidden = torch.cat([drafter.root_hidden[:, None], tree.hidden], 1)
        truth = None  # [B, 1 + N, L, K]: the target's routing of the whole tree
        if paired is not None or isinstance(predictor, OracleExpertPredictor):
            truth, whole, whole_predictions = self._whole_tree(roots, tree, cache)
        if isinstance(predictor, OracleExpertPredictor):
            predictor.prime(tokens.flatten(), truth.flatten(0, 1))
        options, extra = selection
        if spec.recall_weighted_cost:
            extra = {**extra, "live_recall": LiveRecall.of(predictor, self.device)}
        if exchange is not None:
            options, extra = exchange.adjust(options, extra)
        calibrated = calibrator.calibrate(tree.scores, tree.parents, validate=False)  # [B, N]
        chosen = select_step(
            predictor,
            tokens,
            calibrated if spec.calibrated_acceptance else tree.scores,
            tree.parents,
            spec.budget,
            options,
            states=hidden,
            root_context=root_context,
            host_eps=True,
            **extra,
        )
        if spec.policy == EVICT:
            chosen = evict_step(chosen, spec.evict_seconds)
        selected = chosen.selected
        # "adaptive" and "evict" may select fewer than the budget (-1 padding): padding rows
        # run in the forward but see only themselves, are never accepted and are not counted.
        verify = build_verify_tree(roots, tree, selected)
        out = self.target.forward(
            verify.tokens, cache.lengths[:, None] + verify.depth, cache, verify.mask
        )
        predictions = out.logits.argmax(-1)  # [B, T]
        path = greedy_accept(verify, predictions)  # [B, D + 1]
        counts = (path >= 0).sum(1)
        emitted = predictions.gather(1, path.clamp_min(0))  # [B, D + 1]

        # Every verified row's routing is real (rejected rows ran too), so all of it counts
        # for the experts loaded and feeds the predictor.
        routing = out.routing[verify.valid]  # [verified, L, K]
        batch = batch_index(selected)
        rows = verify_rows(selected)
        recall = topk_recall(chosen.verify_predicted[verify.valid], routing, self.num_experts)
        # n in the units of the EP cost this step selected with (the exchange's total_weight)
        placement = selection[1].get("placement")
        record_recall(
            predictor,
            chosen,
            verify.valid,
            out.routing,
            budget=spec.budget,
            placement=placement,
            total_weight=None if placement is None else options.total_weight,
        )
        if exchange is not None:
            exchange.update(out.routing, verify.valid)
        row_hidden = None if hidden is None else hidden[batch, rows][verify.valid]  # [verified, H]
        context = verified_context(chosen, verify.valid)  # the rows' parent tokens, if read
        predictor.observe(
            verify.tokens[verify.valid], routing, row_hidden, validate=False, **context
        )

        predicted = predicted_acceptance(tree.scores, calibrated, selected)
        calibrator.observe(tree.scores, tree.parents, selected, path, validate=False)

        cache.commit(path)
        drafter.extend(emitted, out.aux[batch, path.clamp_min(0)], counts)
        step = step_stats(
            routing, self.num_experts, accepted=(counts - 1).tolist(), recall=recall, **predicted
        )
        if paired is not None:
            sets = (selected, *(reselect(chosen, *each) for each in paired))
            step.paired_bitmaps = torch.stack(
                [selection_union(truth, s, self.num_experts) for s in sets]
            ).cpu()
            step.paired_scores = [selected_score(tree.scores, s) for s in sets]
            step.paired_accepted = [
                int(accepted_within(whole, whole_predictions, s).sum()) for s in sets
            ]
            step.paired_verified = [int((s >= 0).sum()) + s.shape[0] for s in sets]
        new_tokens = [row[:n] for row, n in zip(emitted.tolist(), counts.tolist(), strict=True)]
        return step, emitted[batch[:, 0], counts - 1], new_tokens

    def _selection_arguments(self, spec: SpecConfig) -> tuple[SelectionOptions, dict]:
        """``spec``'s selection options, and the tensors ``select_step`` takes besides
        (``placement``, ``layer_weights``), checked against the target's L and E and put on
        the engine's device."""
        extra = {}
        if spec.layer_weights is not None:
            if len(spec.layer_weights) != self.num_layers:
                raise ValueError(
                    f"layer_weights has {len(spec.layer_weights)} entries, the target has "
                    f"{self.num_layers} MoE layers"
                )
            extra["layer_weights"] = torch.tensor(
                spec.layer_weights, dtype=torch.float64, device=self.device
            )
        if spec.expert_rank is not None:
            ranks = torch.tensor(spec.expert_rank, dtype=torch.int64, device=self.device)
            if ranks.shape[-1] != self.num_experts or (
                ranks.dim() == 2 and ranks.shape[0] != self.num_layers
            ):
                raise ValueError(
                    f"expert_rank has shape {tuple(ranks.shape)}; the target needs [E] = "
                    f"[{self.num_experts}] or [L, E] = [{self.num_layers}, {self.num_experts}]"
                )
            extra["placement"] = Placement(ranks, spec.num_ranks)
        return spec.selection, extra

    def _paired_arguments(self, spec: SpecConfig, compare: SpecConfig) -> tuple[SpecConfig, tuple]:
        """(``compare``, its ``_selection_arguments``); its tree must be ``spec``'s (both
        selections read the same tree)."""
        if not isinstance(compare, SpecConfig):
            raise TypeError(f"compare must be a SpecConfig, got {type(compare).__name__}")
        fields = ("topk", "num_steps", "tree_attention")
        if any(getattr(spec, f) != getattr(compare, f) for f in fields):
            raise ValueError(
                "compare must grow the same tree as spec: "
                + ", ".join(f"{f} {getattr(compare, f)!r} vs {getattr(spec, f)!r}" for f in fields)
            )
        return compare, self._selection_arguments(compare)

    def _prefill(self, prompts: list[list[int]]):
        """Runs the prompts; returns the cache (holding them), the first generated token
        ``[B]`` and the aux states ``[B, P, A*H]`` (None without a draft)."""
        if not prompts or min(len(p) for p in prompts) < 1:
            raise ValueError("every prompt needs at least one token")
        ids = self._pad(prompts)
        batch, width = ids.shape
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        index = torch.arange(width, device=self.device)
        mask = padded_causal_mask(lengths, width)
        cache = self.target.new_cache(batch)
        out = self.target.forward(ids, index.expand(batch, -1), cache, mask)
        cache.commit(torch.where(index < lengths[:, None], index, -1))
        roots = out.logits[torch.arange(batch), lengths - 1].argmax(-1)
        return cache, roots, out.aux

    def _pad(self, prompts: list[list[int]]) -> torch.Tensor:
        width = max(len(p) for p in prompts)
        return torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=self.device)

    def _whole_tree(
        self, roots: torch.Tensor, tree: DraftTree, cache: BatchKVCache
    ) -> tuple[torch.Tensor, VerifyTree, torch.Tensor]:
        """One forward over the whole tree (each row sees the prefix and its ancestors, as in
        any verify pass; the cache keeps nothing of it): the target's routing
        ``[B, 1 + N, L, K]`` of every root and candidate, the tree's rows and the target's
        argmax ``[B, 1 + N]`` at each row (what any subset's acceptance reads)."""
        everything = torch.arange(tree.tokens.shape[1], device=self.device)
        whole = build_verify_tree(roots, tree, everything.expand(roots.shape[0], -1))
        out = self.target.forward(
            whole.tokens, cache.lengths[:, None] + whole.depth, cache, whole.mask
        )
        cache.commit(cache.lengths.new_empty(roots.shape[0], 0))
        return out.routing, whole, out.logits.argmax(-1)

    def _resolve_predictor(self, predictor: ExpertPredictor | str) -> ExpertPredictor:
        shape = (self.num_layers, self.num_experts, self.top_k)
        if predictor == "online":
            return OnlineExpertPredictor(*shape, device=self.device)
        if predictor == "oracle":
            return OracleExpertPredictor(*shape)
        if not isinstance(predictor, ExpertPredictor):
            raise TypeError(
                f"predictor must be an ExpertPredictor, 'online' or 'oracle', got {predictor!r}"
            )
        if (predictor.num_layers, predictor.num_experts, predictor.top_k) != shape:
            raise ValueError(
                f"predictor is for (layers, experts, top_k) = "
                f"{(predictor.num_layers, predictor.num_experts, predictor.top_k)}, the target "
                f"has {shape}"
            )
        draft_size = self.draft.config.hidden_size
        size = getattr(predictor, "hidden_size", None)  # a head's; a wrapper may have none
        if predictor.needs_hidden and size is not None and size != draft_size:
            raise ValueError(
                f"predictor reads draft states of size {size}, the draft's "
                f"are {draft_size}: train it on this draft (sgl-ecospec train-head)"
            )
        return predictor


def _eos_token_ids(model) -> set[int]:
    ids = set()
    for config in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(config, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    return ids
