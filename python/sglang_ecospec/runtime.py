"""What ECOSPEC adds to one scheduler process: :class:`EcoSpecRuntime`.

Built by the worker (``algorithm.EcoSpecWorker``) before SGLang sizes the KV pool, so that
its tensors are charged to it (:mod:`sglang_ecospec.memory`): the expert predictor (online,
vocab, context or a trained head: :mod:`sglang_ecospec.served_predictor`, with the tokens
verified before each request's root for the context predictors), the selector, the routing
capture and its statistics, under expert parallelism the expert -> EP rank placement, with
``eps=auto`` the cost model's eps table, with more than one rank per batch the TP agreement
(rank 0's verify set broadcast, the periodic predictor-state check:
:mod:`sglang_ecospec.tp_agreement`); with ``eps=auto`` and ``calibrate`` the cost model is
first calibrated on this device, or its cached profile reused
(:mod:`sglang_ecospec.startup_calibration`); it activates the hooks that use them
(:mod:`sglang_ecospec.hooks`) and is called before each decode step, around each verify, and
after each decode batch's results (the "EcoSpec:" line).

After a verify (:meth:`EcoSpecRuntime.after_verify`) everything stays on the device: the
step's statistics, the predictor's update (with each verify row's parent token for the
context predictors), with the recall-weighted cost the live recall, with calibrated
acceptance the calibrator's learning from SGLang's accepted paths
(:mod:`sglang_ecospec.acceptance`), every ``log_interval`` steps an asynchronous snapshot of
the statistics; about 20 small kernels (about 60 more for calibrated acceptance), no host
sync (test/plugin/test_graph_safety.py counts them).
"""

import logging

from sglang_ecospec import acceptance, memory, metrics, tp_agreement
from sglang_ecospec.deployment import num_candidates
from sglang_ecospec.settings import EcoSpecSettings

logger = logging.getLogger(__name__)


class EcoSpecRuntime:
    """Everything ECOSPEC adds to one scheduler process, built once the pool size is known."""

    def __init__(
        self,
        settings: EcoSpecSettings,
        hf_config,
        *,
        topk: int,
        num_draft_tokens: int,
        max_batch: int,
        device,
        num_steps: int | None = None,
        target_model=None,
        ep_layout=None,
        served_model=None,
        tp_check_interval: int = tp_agreement.CHECK_INTERVAL,
    ):
        """Builds and activates everything; ``max_batch`` sizes the batch buffers,
        ``num_steps`` (S, draft steps; None: the fewest whose tree has ``num_draft_tokens``
        - 1 candidates) the per-step memory estimate (:attr:`memory`); ``ep_layout`` is
        SGLang's EP state (``ep_placement.EPLayout``; None: no EP); ``served_model`` what the
        setting ``calibrate`` times (``startup_calibration.ServedModel``; needed with it); the
        ranks sharing the batch are read from SGLang's parallel state
        (``tp_agreement.selection_group``), their predictor states compared every
        ``tp_check_interval`` verify steps. ValueError when the settings do not fit the served
        model or its parallelism."""
        from sglang_ecospec import (
            ep_placement,
            eps_table,
            fixed_width,
            hooks,
            routing,
            selection,
            served_predictor,
        )

        layer_ids, num_experts, top_k = routing.moe_layout(hf_config)
        if settings.verify_moe_kernel:
            from sglang_ecospec import verify_moe_hook

            verify_moe_hook.check_device(device)
            if target_model is None:
                raise ValueError("verify_moe_kernel needs the target model (its class is hooked)")
        ep_layout = ep_layout or ep_placement.EPLayout()
        placement = None
        if settings.ep_cost and ep_layout.ep_size > 1:
            placement = ep_placement.ExpertPlacement(ep_layout, layer_ids, num_experts, device)
        if num_steps is None:
            num_steps = 1
            while num_candidates(topk, num_steps) < num_draft_tokens - 1:
                num_steps += 1
        group = tp_agreement.selection_group()
        table = None
        if settings.eps_auto:
            profile, hardware = settings.profile, settings.hardware
            if settings.calibrate:
                from sglang_ecospec import startup_calibration

                if served_model is None:
                    raise ValueError("calibrate needs the served model (served_model=)")
                profile, hardware = startup_calibration.cost_profile(settings, served_model, group)
            table = eps_table.cost_model_eps_table(
                profile,
                hardware,
                moe_layers=len(layer_ids),
                num_experts=num_experts,
                top_k=top_k,
                verify_tokens=num_draft_tokens,
                max_batch=max_batch,
                ep_size=ep_layout.ep_size if placement is not None else 1,
                draft_steps=num_steps if settings.policy == "adaptive" else None,
            )
        predictor = served_predictor.build_predictor(settings, hf_config, device)
        self.settings = settings
        self.predictor = predictor
        self.placement = placement
        # None with one rank per batch: no broadcast, no check.
        self.tp_sync = tp_agreement.TpAgreement.for_group(group, interval=tp_check_interval)
        self.timer = metrics.PredictTimer(device)  # each draft step's prediction
        # The draft tree and batch shape the tracker and the selector are both sized by.
        shape = dict(
            topk=topk, num_draft_tokens=num_draft_tokens, max_batch=max_batch, device=device
        )
        self.acceptance = None  # setting calibrated_acceptance: used by the selector
        if settings.calibrated_acceptance:
            self.acceptance = acceptance.AcceptanceTracker(num_steps=num_steps, **shape)
        self.selector = selection.EcoSpecSelector(
            settings,
            predictor,
            **shape,
            placement=placement,
            eps_table=table,
            tp_sync=self.tp_sync,
            acceptance=self.acceptance,
            timer=self.timer,
        )
        # The token before each request's root, for a predictor that reads context.
        self.root_context = None
        if predictor.needs_context:
            self.root_context = served_predictor.RootContext(max_batch, device)
        self.capture = routing.RoutingCapture(
            layer_ids, top_k, max_batch * num_draft_tokens, device
        )
        self.stats = routing.VerifyStats(
            num_experts,
            device,
            layer_ids=layer_ids,
            acceptance=self.acceptance.totals if self.acceptance is not None else None,
        )
        # The "EcoSpec:" line (asynchronous reads); SGLang's decode log line and /metrics.
        self.log_window = self.stats.window(self.timer)
        self.decode_log_window = self.stats.window(self.timer)
        self.summaries: list[dict] = []  # what the "EcoSpec:" lines reported
        self._warned_overflow = False
        self.memory = memory.plugin_memory_bytes(
            settings,
            memory.ModelShape(len(layer_ids), num_experts, top_k),
            max_batch=max_batch,
            num_draft_tokens=num_draft_tokens,
            topk=topk,
            num_steps=num_steps,
            ep_placement=placement is not None,
            predictor=predictor,
        )
        self.verify_moe = None  # the verify-MoE kernel's route (setting verify_moe_kernel)
        # Sets that stop short ("adaptive", min_score): the copies in SGLang's fixed-width
        # verify, checked by routing (totals read with each "EcoSpec:" line's statistics).
        self.copy_check = None
        self._copy_reads: list = []  # host copies of copy_check.totals, one per request
        bindings = [
            selection.slot.bind(self.selector),
            routing.slot.bind(self.capture),
            metrics.slot.bind(self.decode_log_window),
            metrics.log_line_slot.bind(self.poll_log),
        ]
        if placement is not None:
            bindings.append(ep_placement.slot.bind(placement))
        if self.selector.copy_rows is not None:
            self.copy_check = fixed_width.CopyCheck(device)
            bindings.append(fixed_width.slot.bind(self.selector))
        if settings.verify_moe_kernel:
            self.verify_moe = verify_moe_hook.VerifyMoeRoute()
            forward = verify_moe_hook.model_forward_hook(type(target_model))
            bindings.append(verify_moe_hook.slot.bind(self.verify_moe, forward))
        self._bindings = bindings
        hooks.activate(bindings)
        logger.info(
            "ECOSPEC active: %d MoE layers x %d experts (top-%d), predictor %s, policy %s, eps %s "
            "(recall-weighted cost %s), share_buffer %s, EP cost %s, learn %s, verify-MoE "
            "kernel %s, TP agreement %s",
            len(layer_ids),
            num_experts,
            top_k,
            settings.predictor,
            settings.policy,
            settings.eps,
            "on" if settings.recall_weighted_cost else "off",
            f"{settings.share_buffer}{' (round_sync)' if settings.round_sync else ''}",
            f"over {placement.num_ranks} ranks" if placement is not None else "off",
            settings.learn,
            "on" if self.verify_moe is not None else "off",
            f"over {self.tp_sync.world_size} ranks" if self.tp_sync is not None else "off",
        )

    def before_decode(self, spec_info, req_pool_indices=None) -> None:
        """At the start of a decode step, on the forward stream: applies a pending EPLB
        refresh of the EP placement (``ep_placement``), then seeds the selector with the
        batch's bonus tokens (the draft trees' roots) and, for a predictor that reads
        context, the token verified before each (by ``req_pool_indices`` int ``[B]``, the
        batch's request-pool slots; None: unknown)."""
        if self.placement is not None:
            self.placement.apply_refresh()
        roots = None
        if spec_info is not None and spec_info.is_draft_input():
            roots = getattr(spec_info, "bonus_tokens", None)
        context = None
        if self.root_context is not None and roots is not None and req_pool_indices is not None:
            context = self.root_context.lookup(req_pool_indices)
        self.selector.set_roots(roots, context)

    def forget_requests(self, req_pool_indices) -> None:
        """A prefill (extend) forward of these request-pool slots (int ``[B]``): the tokens
        recorded before their roots belong to earlier requests."""
        if self.root_context is not None and req_pool_indices is not None:
            self.root_context.forget(req_pool_indices)

    def track_roots(self, verify_input, result, req_pool_indices) -> None:
        """Records the token before each next root from SGLang's verify ``result``
        (``accept_index``, ``accept_lens``) for a predictor that reads context; also after the
        utility gate's plain-decoding verifies, which :meth:`after_verify` skips."""
        tokens = getattr(verify_input, "draft_token", None)
        accept_index = getattr(result, "accept_index", None)
        accept_lens = getattr(result, "accept_lens", None)
        if (
            self.root_context is None
            or req_pool_indices is None
            or tokens is None
            or accept_index is None
            or accept_lens is None
            or accept_index.dim() != 2
            or accept_index.shape[0] == 0
        ):
            return
        self.root_context.after_verify(tokens, accept_index, accept_lens, req_pool_indices)

    def before_verify(self) -> None:
        """Before SGLang's verify forward: every routing row marked uncaptured (one fill)."""
        self.capture.begin_forward()

    def after_verify(self, verify_input, result=None, req_pool_indices=None) -> None:
        """Measures and learns from the routing of the verify pass that just ran, and with
        calibrated acceptance from SGLang's result (its ``accept_index``), on the device (no
        host sync; every ``log_interval`` steps an asynchronous snapshot for the "EcoSpec:"
        line, logged by :meth:`poll_log`); ``req_pool_indices`` (int ``[B]``) keys the
        tokens before the next roots (:meth:`track_roots`)."""
        tokens = getattr(verify_input, "draft_token", None)
        if tokens is None or tokens.numel() == 0:
            return
        self.track_roots(verify_input, result, req_pool_indices)
        count = tokens.numel()
        if count > self.capture.max_tokens:
            if not self._warned_overflow:
                logger.warning(
                    "ECOSPEC: %d verify tokens exceed the routing buffer; not learning", count
                )
                self._warned_overflow = True
            return
        routing_ids = self.capture.verify_routing(count)  # [T, L, K], -1: not captured
        # What selection predicted for these rows, before any learning from them.
        predicted = self.selector.verify_topk[:count]
        self.stats.update(routing_ids, predicted)
        if self.copy_check is not None:
            self.copy_check.update(routing_ids, self.selector.copy_rows.flatten()[:count])
        # Rows SGLang did not capture (counted above, logged on read) read as expert 0; the
        # live recall leaves them out, the predictor learns them.
        known = routing_ids.clamp_min(0)  # [T, L, K]
        live = self.selector.live_recall
        if live is not None:  # the recall-weighted cost's trust, from captured rows only
            captured = routing_ids.amin((1, 2)) >= 0  # [T]
            live.update(predicted.long(), known, captured)
            per_request = self.selector.num_draft_tokens  # rows of a request: root first
            rows = captured.view(-1, per_request)  # [B, D]
            if self.selector.copy_rows is not None:  # a copy's experts are its original's
                rows = rows & ~self.selector.copy_rows[: rows.shape[0]]
            placement = self.selector.placement  # n in the units of the EP cost
            routing = known.view(*rows.shape, *known.shape[1:])  # [B, D, L, K]
            live.update_cost_fit(predicted.long().view_as(routing), routing, rows)
            live.update_novel(
                routing,
                rows,
                budget=max(per_request - 1, 1),
                placement=placement,
                total_weight=None if placement is None else self.selector.options.total_weight,
            )
        if self.settings.learn and not self.predictor.needs_hidden:
            context = {}
            if self.selector.verify_context is not None:
                context = {"context_tokens": self.selector.verify_context[:count]}
            self.predictor.observe(tokens.flatten(), known, validate=False, **context)
        accept_index = getattr(result, "accept_index", None)
        if self.acceptance is not None and self.acceptance.accepts(accept_index, count):
            self.acceptance.after_verify(accept_index)  # forecast counted, then learnt
        if self.tp_sync is not None:  # every tp_check_interval steps: compare the tables
            self.tp_sync.after_verify(self.predictor)
        interval = self.settings.log_interval
        if interval and self.log_window.pending_steps >= interval:
            if self.copy_check is not None:  # copied before the window's event: there with it
                from sglang_ecospec.routing import host_copy

                self._copy_reads.append(host_copy(self.copy_check.totals))
            self.log_window.request()

    def poll_log(self) -> None:
        """Logs the "EcoSpec:" lines whose statistics have reached the host (never waits);
        called after each decode batch's results (``metrics.report_decode_stats_hook``)."""
        for summary in self.log_window.ready():
            copies = ""
            if self.copy_check is not None:
                total, differ = self._copy_reads.pop(0).tolist()
                summary["slot_copies"], summary["slot_copies_routed_differently"] = total, differ
                copies = f", slot copies {total} (routed differently {differ})"
            self.summaries.append(summary)
            logger.info(
                "EcoSpec: %d verify steps, unique experts/layer/step %.2f, predictor recall "
                "%.3f, verify tokens/step %.1f%s%s%s",
                summary["verify_steps"],
                summary["unique_experts_per_layer"],
                summary["predictor_recall"],
                summary["verify_tokens_per_step"],
                metrics.predict_log_field(summary),
                acceptance.log_fields(summary),
                copies,
            )

    def close(self) -> None:
        """Empties the hook slots this runtime still holds (SGLang's code runs again)."""
        from sglang_ecospec import hooks

        hooks.deactivate(self._bindings)
