"""The ECOSPEC speculative algorithm: EAGLE-3 with EcoSpec's cost-aware verify-set selection.

Registered with ``SpeculativeAlgorithm.register("ECOSPEC", ...)`` by the plugin entry point,
so ``--speculative-algorithm ECOSPEC`` resolves in the launcher and in every scheduler
process. :class:`EcoSpecAlgo` answers SGLang's ``is_*()`` / ``supports_*()`` questions as
EAGLE3 does (``is_eagle3()`` is True: aux hidden-state capture, the draft's vocabulary map,
the V2 worker path), and :class:`EcoSpecWorker` is SGLang's ``EAGLEWorkerV2`` plus:

- at start: the startup checks (:mod:`sglang_ecospec.deployment`: draft tree, parallel
  layout, compiled CUDA ops), then, before SGLang sizes the KV pool, the EcoSpec runtime
  (:class:`sglang_ecospec.runtime.EcoSpecRuntime`: settings, expert predictor: online, or a
  trained head, selector, routing capture) sized to the largest batch, with its per-step
  memory reserved until the pool is sized (:mod:`sglang_ecospec.memory`), and the hooks
  (``organize_draft_results``, ``select_top_k_tokens``, ``capture_routed_experts_if_allowed``,
  ``TopK.forward``; :mod:`sglang_ecospec.hooks`) active in this
  process; under expert parallelism the expert -> EP rank placement from SGLang's expert
  location metadata (and the EPLB refresh hook), with ``eps=auto`` the cost model's eps
  table (with ``calibrate`` the served model calibrated on this device first:
  :mod:`sglang_ecospec.startup_calibration`);
- with the utility gate (setting ``gate``, :mod:`sglang_ecospec.gate`): SGLang's adaptive
  controller with two runtime states, the configured draft steps and plain decoding (0 steps),
  chosen per batch-size bucket before each decode step by measured utility, and each decode
  step timed;
- before each decode step: a pending EPLB refresh of the EP placement applied on the
  forward stream, the batch's bonus tokens copied into the selector (seeds of the expert
  buffer) and, for a predictor that reads context, the token verified before each (kept per
  request-pool slot from the accepted paths: :mod:`sglang_ecospec.served_predictor`);
- after each verify: whether every MoE layer's routing was captured (counted on the device),
  and the verify tokens' captured routing feeds the statistics and the online predictor,
  SGLang's accepted paths the acceptance calibrator (:mod:`sglang_ecospec.acceptance`; no
  host sync); the statistics are read (one host sync each) for SGLang's decode
  log line and /metrics (:mod:`sglang_ecospec.metrics`, once per ``--decode-log-interval``);
  the "EcoSpec:" line (every ``log_interval`` verify steps) copies them asynchronously and
  is logged after a later decode batch's results, once the copy has landed.

What EAGLE3 gets from SGLang code that tests the literal string "EAGLE3" (or "EAGLE"), and
ECOSPEC therefore does not, is listed in docs/sglang.md.
"""

import logging

import torch
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo, get_spec

from sglang_ecospec.settings import EcoSpecSettings, EcoSpecSettingsError

logger = logging.getLogger(__name__)

NAME = "ECOSPEC"


class EcoSpecAlgo(CustomSpecAlgo):
    """ECOSPEC as SGLang's scheduler and model runner see it: an EAGLE-3 algorithm."""

    def _yes(self) -> bool:
        return True

    # The EAGLE3 answers: all yes.
    is_eagle = is_eagle3 = need_topk = carries_draft_hidden_states = _yes
    supports_mixed_chunk = supports_grammar_overlap = _yes

    def create_future_map(
        self, device, req_to_token_pool, needs_cpu_seq_lens=True, needs_confidence_relay=False
    ):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(
            device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay
        )

    def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
        from sglang.srt.speculative.eagle_disaggregation import build_eagle_disagg_draft_input

        return build_eagle_disagg_draft_input(batch, last_tokens_tensor, future_map)

    def handle_server_args(self, server_args) -> None:
        """What SGLang does for the EAGLE family (auto draft parameters, max running
        requests, ...), except that on the CPU the overlap scheduler stays on."""
        from sglang.srt.arg_groups.speculative_hook import _handle_eagle_family

        keep_overlap = server_args.device == "cpu" and not server_args.disable_overlap_schedule
        _handle_eagle_family(server_args)
        if keep_overlap:
            # SGLang turns the overlap scheduler off for speculative decoding on the CPU ("not
            # implemented"), while the plain server keeps it; ECOSPEC's V2 path runs with it
            # (lossless: test/e2e), so its plain-decoding steps cost what the plain server's
            # do. --disable-overlap-schedule still turns it off.
            server_args.disable_overlap_schedule = False
            logger.info("%s on the CPU: keeping the overlap scheduler", NAME)

    def get_platform_worker_cls(self):
        return None


def validate_server_args(server_args) -> None:
    """Startup check in the launcher: EcoSpec settings and the needed server flags."""
    from sglang.srt.arg_groups.overrides import resolving_view

    try:
        settings = EcoSpecSettings.from_env()
    except EcoSpecSettingsError as exc:
        raise ValueError(f"--speculative-algorithm {NAME}: {exc}") from None
    cfg = resolving_view(server_args)
    ep_size = cfg.ep_size or 1
    if settings.eps_auto and settings.ep_cost and ep_size > 1:
        from sglang_ecospec.eps_table import check_hardware_covers

        try:
            check_hardware_covers(settings.hardware, ep_size)
        except ValueError as exc:
            raise ValueError(
                f"--speculative-algorithm {NAME}: SGLANG_ECOSPEC_HARDWARE: {exc}"
            ) from None
    if cfg.speculative_draft_model_path is None:
        raise ValueError(
            f"--speculative-algorithm {NAME} needs an EAGLE-3 draft: pass "
            "--speculative-draft-model-path"
        )
    # Tree flags given on the command line are checked now; SGLang's automatic choice (made
    # after this check) and the rest of the deployment when the worker starts.
    from sglang_ecospec.deployment import check_draft_tree

    check_draft_tree(
        getattr(cfg, "speculative_eagle_topk", None),
        getattr(cfg, "speculative_num_steps", None),
        getattr(cfg, "speculative_num_draft_tokens", None),
    )
    logger.info("%s settings: %s", NAME, settings.to_dict())


def register_algorithm() -> None:
    """Registers ECOSPEC with SGLang (idempotent)."""
    if get_spec(NAME) is not None:
        return

    @SpeculativeAlgorithm.register(
        NAME,
        supports_overlap=True,
        validate_server_args=validate_server_args,
        spec_class=EcoSpecAlgo,
    )
    def _worker_factory(server_args):
        return worker_class()


_worker_class = None


def worker_class():
    """:class:`EcoSpecWorker`, built on first use (importing SGLang's worker is heavy)."""
    global _worker_class
    if _worker_class is None:
        _worker_class = _make_worker_class()
    return _worker_class


def _make_worker_class():
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    class EcoSpecWorker(EAGLEWorkerV2):
        """SGLang's EAGLE-3 worker with EcoSpec's selection and online predictor."""

        def __init__(self, server_args, gpu_id, nccl_port, target_worker):
            from sglang_ecospec.deployment import check_startup
            from sglang_ecospec.memory import max_batch_bound

            # Server arguments are final here (SGLang's automatic choices made): refuse what
            # ECOSPEC cannot serve before the draft model is loaded.
            check_startup(server_args)
            super().__init__(server_args, gpu_id, nccl_port, target_worker)
            self.ecospec_settings = EcoSpecSettings.from_env()
            self.ecospec = None  # runtime.EcoSpecRuntime
            self.ecospec_reservation = None  # memory.Reservation, held until the KV pool
            self.ecospec_gate = None  # gate.GatePolicy (setting gate)
            if self.ecospec_settings.gate and self._draft_worker is not None:
                self._install_gate(server_args)
            max_batch = max_batch_bound() if self._draft_worker is not None else None
            if max_batch is not None:
                # SGLang creates this worker right before Scheduler.init_memory_pools sizes
                # the KV pool from the free memory: what is allocated (and reserved) now
                # is charged to the pool, not to --mem-fraction-static's slack.
                self._build_ecospec(max_batch, reserve=True)

        def _build_ecospec(self, max_batch: int, *, reserve: bool) -> None:
            from sglang_ecospec.ep_placement import sglang_layout
            from sglang_ecospec.memory import Reservation
            from sglang_ecospec.runtime import EcoSpecRuntime
            from sglang_ecospec.startup_calibration import ServedModel

            runner = self._target_worker.model_runner
            device = torch.device(self.device)
            served = None  # what the setting calibrate times
            if self.ecospec_settings.calibrate:
                served = ServedModel.from_server(
                    self.server_args, runner.model_config.dtype, device
                )
            self.ecospec = EcoSpecRuntime(
                self.ecospec_settings,
                runner.model_config.hf_config,
                topk=self.topk,
                num_draft_tokens=self.speculative_num_draft_tokens,
                num_steps=self.speculative_num_steps,
                max_batch=max_batch,
                device=device,
                target_model=runner.model,
                ep_layout=sglang_layout(),
                served_model=served,
            )
            usage = self.ecospec.memory
            if reserve:
                self.ecospec_reservation = Reservation(usage.step, self.device)
            logger.info(
                "%s (batches of up to %d requests; %s)",
                usage.describe(),
                max_batch,
                "before the KV pool is sized" if reserve else "NOT in the KV pool's budget",
            )

        def _install_gate(self, server_args) -> None:
            from sglang.srt.arg_groups.model_override_base import resolved_view

            from sgl_ecospec.costmodel.calibration import device_name
            from sglang_ecospec import gate, gate_memory, hooks, metrics, tp_agreement

            reason = gate.unsupported_reason(resolved_view(server_args))
            if reason is not None:
                logger.warning(
                    "%s: utility gate OFF with %s: speculation runs in every step, also where "
                    "it is slower than plain decoding (SGLANG_ECOSPEC_GATE=0 silences this)",
                    NAME,
                    reason,
                )
                return
            settings = self.ecospec_settings
            memory = None
            directory = gate_memory.memory_dir(settings.gate_memory)
            if directory is not None:
                levels = gate.gate_levels(self.speculative_num_steps, settings.gate_narrow)
                dtype = self._target_worker.model_runner.model_config.dtype
                device = device_name(torch.device(self.device))
                key = gate_memory.memory_key(server_args, settings, levels, dtype, device)
                memory = (gate_memory.memory_file(directory, key), key)
            self.ecospec_gate = gate.install(
                self,
                settings.gate_options(),
                tp_agreement.selection_group(),
                narrow=settings.gate_narrow,
                memory=memory,
            )
            hooks.activate([metrics.gate_slot.bind(self.ecospec_gate)])

        def alloc_memory_pool(self, *args, **kwargs):
            super().alloc_memory_pool(*args, **kwargs)
            if self._draft_worker is None:
                return
            if self.ecospec is None:  # no max batch known before the pool: built now
                pool = kwargs.get("req_to_token_pool") or self.req_to_token_pool
                logger.warning(
                    "%s: the largest batch was unknown before the KV pool was sized; its "
                    "memory comes out of --mem-fraction-static's slack",
                    NAME,
                )
                self._build_ecospec(pool.req_to_token.shape[0], reserve=False)
            if self.ecospec_reservation is not None:  # the KV pool is sized: free for steps
                self.ecospec_reservation.release()

        def forward_batch_generation(self, batch, *args, **kwargs):
            decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch)
            slots = getattr(batch, "req_pool_indices", None)  # int [B], a request's for life
            if self.ecospec is not None and decode:
                self.ecospec.before_decode(batch.spec_info, slots)
            elif self.ecospec is not None:  # a prefill: the slots' earlier tokens are stale
                self.ecospec.forget_requests(slots)
            timed = self.ecospec_gate is not None and decode and not batch.forward_mode.is_idle()
            if not timed:
                return super().forward_batch_generation(batch, *args, **kwargs)
            started = self.ecospec_gate.step_started()
            output = super().forward_batch_generation(batch, *args, **kwargs)
            self.ecospec_gate.step_finished(batch.seq_lens.shape[0], started)
            return output

        def verify(self, batch, *args, **kwargs):
            # A plain-decoding step of the utility gate (0 draft steps) verifies the bonus
            # tokens alone: nothing was selected, so EcoSpec measures and learns nothing.
            slots = getattr(batch, "req_pool_indices", None)
            if self.speculative_num_steps == 0:
                verify_input = getattr(batch, "spec_info", None)
                output = self._verify_one_node(batch, *args, **kwargs)
                if self.ecospec is not None:  # the token before the next root, for context
                    self.ecospec.track_roots(verify_input, output, slots)
                return output
            verify_input = batch.spec_info
            if self.ecospec is None:
                return super().verify(batch, *args, **kwargs)
            if not self.ecospec.selector.selects(self.speculative_num_draft_tokens):
                # The gate's narrow level: SGLang's own chain, nothing to measure or learn.
                output = super().verify(batch, *args, **kwargs)
                self.ecospec.track_roots(verify_input, output, slots)
                return output
            self.ecospec.before_verify()
            output = super().verify(batch, *args, **kwargs)
            self.ecospec.after_verify(verify_input, output, slots)  # output.accept_index: learnt
            return output

        def _verify_one_node(self, batch, *args, **kwargs):
            # SGLang compacts a tree's accepted path to the front of each request's block
            # (a KV move over every layer) whenever topk > 1; a one-node tree's path is
            # there already, as a chain's is, so the verify runs as for topk 1.
            topk, self.topk = self.topk, 1
            try:
                return super().verify(batch, *args, **kwargs)
            finally:
                self.topk = topk

    EcoSpecWorker.__qualname__ = "EcoSpecWorker"
    return EcoSpecWorker
