"""EcoSpec settings of an ECOSPEC server, validated at startup.

SGLang's argument parser rejects flags it does not know, so EcoSpec's own settings come from
the environment of the server process:

- ``SGLANG_ECOSPEC_CONFIG=/path/settings.json``: a JSON object whose keys are field names of
  :class:`EcoSpecSettings` (unknown keys are an error);
- ``SGLANG_ECOSPEC_<FIELD>`` (upper case, e.g. ``SGLANG_ECOSPEC_EPS=0.2``): one field; these
  override the file. An ``SGLANG_ECOSPEC_*`` variable that names no field is an error, so a
  typo never passes silently.

The launcher validates them when it resolves ``--speculative-algorithm ECOSPEC`` (the
server does not start on a bad value) and every scheduler process reads them again (spawned
processes inherit the environment).
"""

import dataclasses
import math
import os
from typing import Any

from sgl_ecospec.costmodel.calibration import CalibrationFileError, CalibrationProfile
from sgl_ecospec.costmodel.profiles import HARDWARE, MODELS, get_hardware, get_model
from sgl_ecospec.gate import GateOptions
from sgl_ecospec.ops.options import (
    ADAPTIVE_EP_TOTAL_WEIGHT,
    DEFAULT_EPS,
    SERVED_MIN_SCORE,
    SERVED_SHARE_BUFFER,
    SelectionOptions,
)
from sgl_ecospec.predictors.catalog import ONLINE_PREDICTORS
from sglang_ecospec.setting_values import EcoSpecSettingsError, check_type, parse, read_file

ENV_PREFIX = "SGLANG_ECOSPEC_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"
POLICIES = ("ecospec", "confidence", "adaptive")
PREDICTORS = (*ONLINE_PREDICTORS, "head")
# ContextExpertPredictor's kinds: a row per token of the target's vocabulary ("context" also
# the (parent token, token) pairs; "adjacent", AdjacentExpertPredictor, also recency and the
# parent's experts for unseen tokens).
VOCAB_PREDICTORS = ("vocab", "context", "adjacent")
AUTO = "auto"  # eps from the cost model
# The calibration grid's settings (read only with calibrate); the sizes first.
CALIBRATION_GRID = (
    "calibrate_batch_sizes",
    "calibrate_tokens",
    "calibrate_unique_experts",
    "calibrate_repeats",
)


@dataclasses.dataclass(frozen=True)
class EcoSpecSettings:
    """What ECOSPEC does differently from EAGLE3 (docs/sglang.md, "Settings").

    Attributes:
        policy: "ecospec" (P / (DeltaCost + eps), the paper's rule), "confidence" (top
            cumulative probability: SGLang's own selection, through our machinery; an A/B
            switch that keeps everything else equal) or "adaptive" (ecospec's choice, and per
            request how many nodes: each only while it raises the step's tokens per
            predicted cost; the unused slots of SGLang's fixed-width verify hold copies of a
            chosen leaf, :mod:`sglang_ecospec.fixed_width`; needs eps "auto").
        eps: > 0, added to DeltaCost (predicted new experts summed over MoE layers), or
            "auto": derived per batch-size bucket from the cost model of ``profile`` on
            ``hardware`` (``sgl_ecospec.costmodel.selection_cost``) at startup.
        profile, hardware: the cost model's model profile (a name of
            ``sgl_ecospec.costmodel.profiles.MODELS``, matching the served model) and
            hardware (``h200``, or ``<n>xh200`` for the n GPUs of one model replica): the
            roofline prior, the fallback. Or ``profile`` is a calibration profile file
            (``sgl-ecospec calibrate --out FILE``: the served model timed on this device, the
            fitted model used as is; then no ``hardware``). Read only with eps "auto", and
            then required unless ``calibrate`` is on (then optional: the fallback prior).
        calibrate: with eps "auto", calibrate the served model on this process's device at
            startup (:mod:`sglang_ecospec.startup_calibration`: ``sgl-ecospec calibrate`` in a
            child process, one per node, its profile cached for the next start) and price
            with the fit; a failed calibration is logged and the prior of ``profile`` and
            ``hardware`` (model-profile names) is the fallback, without them the start
            fails. Excludes a calibration profile file. On a GPU the child loads a second,
            whole copy of the target with transformers next to the server's weights (before
            the KV pool is allocated): it fits only where that copy fits, or it fails and the
            fallback is used (the CPU development mode has no such limit).
        calibrate_batch_sizes, calibrate_tokens, calibrate_unique_experts, calibrate_repeats:
            the calibration grid (the command's ``--batch-sizes``, ``--tokens``,
            ``--unique-experts`` as comma-separated integers >= 1, ``--repeats``); None: the
            command's default. Read only with ``calibrate``.
        calibrate_timeout: seconds the calibration may take (> 0); past it the child is
            stopped and the fallback used.
        share_buffer: one expert buffer for the whole batch, seeded with every request's
            bonus token (a batched verify pass loads the union); False: one per request.
        round_sync: with share_buffer, the batch's requests pick each candidate at once
            against the buffer of the round's start (``SelectionOptions.round_sync``): on a
            GPU budget parallel rounds instead of batch x budget sequential turns, for
            "ecospec" and "adaptive" at large batches.
        ep_cost: under expert parallelism (SGLang's ep_size > 1) price a candidate by the
            rise of the busiest EP rank's expert loads (``select_verify_set(expert_rank=)``);
            False: count experts as without EP.
        total_weight: in [0, 1], weight of the experts off the busiest rank in the EP cost,
            or None for the policy's default: ``ADAPTIVE_EP_TOTAL_WEIGHT`` (0) with
            "adaptive", whose stopping rule weighs the step's time, which the busiest rank
            alone sets; 1 / ep_size with the others. Read only under EP with ep_cost.
        predictor: "online" (:class:`sgl_ecospec.predictors.OnlineExpertPredictor`: routing
            counts per token in hashed rows, learnt while serving), "vocab" or "context"
            (:class:`sgl_ecospec.predictors.ContextExpertPredictor` from the library's
            catalog, a row per token of the target's vocabulary; "context" adds the (parent
            token, token) pair table), "adjacent" (``context`` as
            :class:`sgl_ecospec.predictors.AdjacentExpertPredictor`: cached experts lean to
            each row's latest routing, an unseen token takes its parent's) or "head" (a trained
            :class:`sgl_ecospec.predictors.LowRankExpertHead`, from ``sgl-ecospec train-head``:
            reads each candidate's token and the draft state that proposed it; used as
            trained).
        predictor_file: for "online", "vocab", "context" and "adjacent" a warm start written by the
            predictor's ``save``, or None; for "head" the head (required). Its layer count,
            experts and top-k (a vocab table's vocabulary, a head's hidden size) must match
            the served model.
        learn: update a count-table predictor from the routing of every verify pass (a head
            is not updated).
        recall_weighted_cost: DeltaCost trusts only what the predictor knows: each MoE
            layer's predicted experts weighted by how far they track the verified candidates'
            true new experts there (:class:`sgl_ecospec.predictors.LiveRecall`, fed from the
            verify routing), so that as that trust falls selection approaches "confidence".
            Needs policy "ecospec" or "adaptive"; None (the default): on with them, off with
            "confidence", which reads no cost.
        min_score: >= 0, the lowest draft probability (cumulative along the path; the
            calibrated one with ``calibrated_acceptance`` under "ecospec" and "adaptive") a
            candidate needs to be verified; 0: no floor; None (the default):
            ``SERVED_MIN_SCORE`` with "ecospec" and "adaptive", 0 with "confidence" (SGLang's
            selection as published). With a floor a request may verify
            fewer nodes than SGLang's fixed width, whose unused slots hold copies of a chosen
            leaf (:mod:`sglang_ecospec.fixed_width`), as with "adaptive".
        num_buckets, prior_weight, halve_every: the online predictor's table size, prior
            pseudo-count and ageing period (see its docstring); ignored with predictor_file,
            which carries its own, and by the other predictors.
        log_interval: verify steps between two "EcoSpec:" log lines (unique experts per
            layer per verify step, predictor recall, prediction time per step); 0 = never.
            The statistics are copied to the host asynchronously and logged once there (no
            host sync); SGLang's decode log line reads them once per
            ``--decode-log-interval``.
        verify_moe_kernel: compute the routed experts of the target's MoE layers in verify
            forwards with EcoSpec's Triton kernel (:mod:`sglang_ecospec.verify_moe_hook`);
            needs a CUDA device, or the CPU development mode (Triton's interpreter).
        calibrated_acceptance: policy "ecospec" weighs each node by its calibrated
            acceptance probability, learnt online from the verify results, instead of its
            cumulative draft probability ("confidence" keeps SGLang's ranking), and the
            statistics report the forecast acceptance length next to the measured one
            (:mod:`sglang_ecospec.acceptance`). On by default: lossless, the draft's own
            probabilities until the first verify result, a few dozen small kernels per step
            and no host sync.
        gate: the utility gate (:mod:`sglang_ecospec.gate`): per batch-size bucket, decode
            plainly (no draft model, one-token verify) while speculation's measured tokens
            per second fall below plain decoding's; False: always speculate.
        gate_narrow: the gate may also run the narrow level, one draft step verifying the
            draft's most likely token per request, where it decodes faster than both plain
            decoding and the configured tree (needs ``--speculative-num-steps`` > 1; one more
            runtime state: attention backends and, on a GPU, CUDA graphs).
        gate_probe_interval, gate_max_probe_interval, gate_probe_steps, gate_min_samples:
            the gate's first and longest re-probing period, the probes' length, and the
            requests' tokens measured of each level before a fresh bucket's first decision
            (:class:`sgl_ecospec.gate.GateOptions`).
        gate_probe_budget: the largest share of a bucket's time its probes may lose, in
            (0, 1]; probes of a level that loses by far come less often.
        gate_memory: where the gate keeps its settled decisions, so that a restarted server
            of the same model, draft, tree, settings and device starts from them rather than
            measuring again (:mod:`sglang_ecospec.gate_memory`): "auto"
            (``$SGL_ECOSPEC_CACHE/gate``, default ``~/.cache/sgl-ecospec/gate``), a directory,
            or "off".
        selection: derived, not set: the checked ``SelectionOptions`` of policy, eps,
            share_buffer, total_weight and min_score, which every batch selects with; None
            with eps "auto" (``eps_table.BatchOptions`` builds one per batch-size bucket).
    """

    policy: str = "ecospec"
    eps: float | str = DEFAULT_EPS
    profile: str | None = None
    hardware: str | None = None
    calibrate: bool = False
    calibrate_batch_sizes: str | None = None
    calibrate_tokens: str | None = None
    calibrate_unique_experts: str | None = None
    calibrate_repeats: int | None = None
    calibrate_timeout: float = 1800.0
    share_buffer: bool = SERVED_SHARE_BUFFER
    round_sync: bool = False
    ep_cost: bool = True
    total_weight: float | None = None
    predictor: str = "online"
    predictor_file: str | None = None
    learn: bool = True
    recall_weighted_cost: bool | None = None
    min_score: float | None = None
    num_buckets: int = 4096
    prior_weight: float = 0.05
    halve_every: int = 0
    log_interval: int = 50
    verify_moe_kernel: bool = False
    calibrated_acceptance: bool = True
    gate: bool = True
    gate_narrow: bool = True
    # The gate's defaults are GateOptions' own.
    gate_probe_interval: int = GateOptions.probe_interval
    gate_max_probe_interval: int = GateOptions.max_probe_interval
    gate_probe_steps: int = GateOptions.probe_steps
    gate_min_samples: int = GateOptions.min_samples
    gate_probe_budget: float = GateOptions.probe_budget
    gate_memory: str = "auto"
    selection: SelectionOptions | None = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.policy == "adaptive" and self.eps != AUTO:
            raise EcoSpecSettingsError(
                "policy 'adaptive' sizes each request's verify set by the cost model's step "
                "cost: set eps=auto with profile and hardware (or a calibration profile file "
                "from `sgl-ecospec calibrate`)"
            )
        if self.policy not in POLICIES:
            raise EcoSpecSettingsError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        self._check_calibrate()
        self._check_eps()
        if self.recall_weighted_cost and self.policy == "confidence":
            raise EcoSpecSettingsError(
                "recall_weighted_cost weights EcoSpec's DeltaCost, but policy "
                f"{self.policy!r} reads no cost: set policy 'ecospec' or 'adaptive', or unset "
                "recall_weighted_cost"
            )
        # The defaults the sweep chose (docs/RESULTS.md, "Defaults") for the policies that
        # read a cost; "confidence" stays SGLang's EAGLE-3 selection.
        costed = self.policy != "confidence"
        if self.recall_weighted_cost is None:
            object.__setattr__(self, "recall_weighted_cost", costed)
        if self.min_score is None:
            object.__setattr__(self, "min_score", SERVED_MIN_SCORE if costed else 0.0)
        # The fields the cost model does not set are checked now; with eps "auto" the rest
        # (eps, "adaptive"'s step cost) come per batch size (eps_table.BatchOptions),
        # and policy is checked above.
        fields = self.selection_fields()
        if self.eps_auto:
            fields.pop("policy")
        try:
            selection = SelectionOptions(**fields)
        except (TypeError, ValueError) as exc:
            hint = f" (eps may also be {AUTO!r})" if str(exc).startswith("eps") else ""
            raise EcoSpecSettingsError(f"{exc}{hint}") from None
        object.__setattr__(self, "selection", None if self.eps_auto else selection)
        if self.predictor not in PREDICTORS:
            raise EcoSpecSettingsError(
                f"predictor must be one of {PREDICTORS}, got {self.predictor!r}"
            )
        if self.predictor == "head" and self.predictor_file is None:
            raise EcoSpecSettingsError(
                "predictor 'head' needs predictor_file: the LowRankExpertHead file written by "
                "`sgl-ecospec train-head --out FILE` for this target and draft"
            )
        if self.predictor_file is not None and not os.path.isfile(self.predictor_file):
            raise EcoSpecSettingsError(
                f"predictor_file {self.predictor_file!r} does not exist; write one with "
                "OnlineExpertPredictor.save (online), ContextExpertPredictor.save (vocab, "
                "context) or `sgl-ecospec train-head` (head), or leave it unset to start from "
                "an empty table"
            )
        if not 1 <= self.num_buckets < 2**31:
            raise EcoSpecSettingsError(f"num_buckets must be in [1, 2**31), got {self.num_buckets}")
        if not (math.isfinite(self.prior_weight) and self.prior_weight >= 0):
            raise EcoSpecSettingsError(f"prior_weight must be >= 0, got {self.prior_weight}")
        for name in ("halve_every", "log_interval"):
            if getattr(self, name) < 0:
                raise EcoSpecSettingsError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.gate_memory.strip():
            raise EcoSpecSettingsError(
                'gate_memory must be "auto", "off" or a directory, got an empty string'
            )
        try:
            self.gate_options()
        except ValueError as exc:
            raise EcoSpecSettingsError(str(exc).replace("gate ", "gate_", 1)) from None

    def gate_options(self) -> GateOptions:
        """The utility gate's checked options."""
        return GateOptions(
            probe_interval=self.gate_probe_interval,
            max_probe_interval=self.gate_max_probe_interval,
            probe_steps=self.gate_probe_steps,
            min_samples=self.gate_min_samples,
            probe_budget=self.gate_probe_budget,
        )

    def selection_fields(self) -> dict:
        """The selection options these settings fix, as ``SelectionOptions`` fields: all but
        the cost model's with eps "auto" (eps, and for "adaptive" the step and candidate
        costs), which :class:`sglang_ecospec.eps_table.BatchOptions` adds per
        batch-size bucket."""
        total_weight = self.total_weight
        if total_weight is None and self.policy == "adaptive":
            total_weight = ADAPTIVE_EP_TOTAL_WEIGHT
        fields = dict(
            policy=self.policy,
            share_buffer=self.share_buffer,
            round_sync=self.round_sync,
            total_weight=total_weight,
            min_score=self.min_score,
        )
        if not self.eps_auto:
            fields["eps"] = self.eps
        return fields

    @property
    def eps_auto(self) -> bool:
        """eps comes from the cost model (``eps="auto"``)."""
        return self.eps == AUTO

    def _check_eps(self) -> None:
        if isinstance(self.eps, str):
            if self.eps != AUTO:
                raise EcoSpecSettingsError(
                    f"eps must be a finite number > 0 or {AUTO!r}, got {self.eps!r}"
                )
            wanted = {
                "profile": f"the cost model's profile of the served model (one of "
                f"{', '.join(MODELS)}), or a calibration profile file from `sgl-ecospec "
                "calibrate`, or calibrate=on to fit one at startup",
                "hardware": f"its GPUs (one of {', '.join(HARDWARE)}, or <n>x<name> for the n "
                "GPUs of one replica)",
            }
            if self.profile is not None and is_calibration_file(self.profile):
                self._check_calibration_file()
                return
            if self.calibrate and self.profile is None and self.hardware is None:
                return  # calibrated at startup, without a fallback prior
            missing = [name for name in wanted if getattr(self, name) is None]
            if missing:
                raise EcoSpecSettingsError(
                    f"eps={AUTO!r} needs {' and '.join(missing)}: "
                    + "; ".join(f"{name}: {wanted[name]}" for name in missing)
                )
            try:
                get_model(self.profile)
                get_hardware(self.hardware)
            except ValueError as exc:
                raise EcoSpecSettingsError(
                    f"eps={AUTO!r}: {exc} (or profile may be a calibration profile file)"
                ) from None
            return
        given = [name for name in ("profile", "hardware") if getattr(self, name) is not None]
        if given:
            raise EcoSpecSettingsError(
                f"{' and '.join(given)} set but eps = {self.eps}: they are read only with "
                f"eps={AUTO!r}"
            )

    def _check_calibrate(self) -> None:
        grid = [name for name in CALIBRATION_GRID if getattr(self, name) is not None]
        if not self.calibrate:
            if grid:
                raise EcoSpecSettingsError(
                    f"{' and '.join(grid)} set but calibrate is off: they are read only with "
                    "calibrate=on"
                )
            return
        if not self.eps_auto:
            raise EcoSpecSettingsError(
                f"calibrate=on fits the cost model that eps={AUTO!r} reads, but eps = "
                f"{self.eps}: set eps={AUTO!r}, or calibrate=off"
            )
        if self.profile is not None and is_calibration_file(self.profile):
            raise EcoSpecSettingsError(
                f"calibrate=on and the calibration profile file {self.profile!r}: choose one, "
                "the file (calibrate=off) or calibration at startup (unset profile, or name a "
                "model profile for the fallback prior)"
            )
        for name in CALIBRATION_GRID[:3]:
            text = getattr(self, name)
            if text is not None:
                calibration_sizes(name, text)
        if self.calibrate_repeats is not None and self.calibrate_repeats < 1:
            raise EcoSpecSettingsError(
                f"calibrate_repeats must be >= 1, got {self.calibrate_repeats}"
            )
        if not (math.isfinite(self.calibrate_timeout) and self.calibrate_timeout > 0):
            raise EcoSpecSettingsError(
                f"calibrate_timeout must be a finite number of seconds > 0, got "
                f"{self.calibrate_timeout}"
            )

    def _check_calibration_file(self) -> None:
        try:
            CalibrationProfile.load(self.profile)
        except CalibrationFileError as exc:
            raise EcoSpecSettingsError(f"eps={AUTO!r}: profile: {exc}") from None
        if self.hardware is not None:
            raise EcoSpecSettingsError(
                f"hardware = {self.hardware!r} set with the calibration profile "
                f"{self.profile!r}: a calibrated profile carries the device it was timed on; "
                "unset hardware, or name a model profile for the roofline prior"
            )

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "EcoSpecSettings":
        """Reads the settings file and the ``SGLANG_ECOSPEC_*`` variables (see module doc)."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        path = environ.get(CONFIG_ENV)
        if path:
            values.update(read_file(path, CONFIG_ENV))
        fields = _setting_fields()
        for key, raw in environ.items():
            if not key.startswith(ENV_PREFIX) or key == CONFIG_ENV:
                continue
            name = key[len(ENV_PREFIX) :].lower()
            if name not in fields and environ.get("SGL_" + key[len("SGLANG_") :]) == raw:
                # SGLang copies every SGL_* variable to SGLANG_* at import, so the lab's
                # SGL_ECOSPEC_CACHE (not a setting) shows up here as well.
                continue
            if name not in fields:
                raise EcoSpecSettingsError(
                    f"unknown EcoSpec setting {key}; known: "
                    + ", ".join(ENV_PREFIX + n.upper() for n in fields)
                    + f", {CONFIG_ENV}"
                )
            values[name] = parse(key, raw, fields[name].type)
        return cls._build(values, source=f"{path} and environment" if path else "environment")

    @classmethod
    def _build(cls, values: dict[str, Any], source: str) -> "EcoSpecSettings":
        fields = _setting_fields()
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise EcoSpecSettingsError(
                f"unknown EcoSpec settings {unknown} in {source}; known: {sorted(fields)}"
            )
        for name, value in values.items():
            check_type(name, value, fields[name].type, source)
        return cls(**values)

    def to_dict(self) -> dict:
        """The settings as given (what the log shows), without the derived ``selection``."""
        return {name: getattr(self, name) for name in _setting_fields()}


def _setting_fields() -> dict[str, dataclasses.Field]:
    """The fields a user sets (not the derived ones), by name."""
    return {f.name: f for f in dataclasses.fields(EcoSpecSettings) if f.init}


def calibration_sizes(name: str, text: str) -> tuple[int, ...]:
    """The distinct integers >= 1 of the comma-separated ``text`` of the setting ``name``."""
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise EcoSpecSettingsError(
            f"{name} must hold distinct comma-separated integers >= 1 (e.g. 1,2,4), got {text!r}"
        )
    return values


def is_calibration_file(profile: str) -> bool:
    """``profile`` names a calibration profile file rather than a model profile: not a
    ``MODELS`` name, and an existing path or one that looks like a path (a folder separator or
    ".json"), so that a mistyped path is reported as a missing file."""
    if profile.strip().lower() in MODELS:
        return False
    return os.path.exists(profile) or os.sep in profile or profile.endswith(".json")
