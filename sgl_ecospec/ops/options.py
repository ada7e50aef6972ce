"""The scalar options of verify-set selection: one checked value carried end to end.

:class:`SelectionOptions` is built (and checked) once where a configuration enters: the
public op's keywords, the engine's ``SpecConfig``, the plugin's settings, the bench and sweep
configurations. Everything downstream (``select_step``, ``LiveRecall.weigh``,
``select_verify_set(options=)``, its reference, the C++ and CUDA ops) takes it as it is.
Each default is written here, and only here.
"""

import dataclasses

from sgl_ecospec.ops.checks import check_finite, check_positive

# The constant of the EcoSpec paper's worked example (Fig. 3, docs/selection.md);
# ``costmodel.selection_cost`` derives a better one from the fitted cost model.
DEFAULT_EPS = 0.1
# The score floor ECOSPEC serves with when none is set (the plugin's settings, ``bench``):
# the defaults sweep measured it below confidence's line at equal acceptance (docs/RESULTS.md,
# "Defaults"). The op's own default stays 0 (no floor), so a direct call selects as published.
SERVED_MIN_SCORE = 0.2
# SGLang's EAGLE-3 serves a batch's verify in one pass, so the plugin, the offline engine, the
# bench and the sweep account one expert buffer for the batch unless told otherwise; the op's
# own default stays a buffer per request.
SERVED_SHARE_BUFFER = True
# In the order of the C++ ``Policy`` enum (csrc/selection_core.h).
POLICIES = ("confidence", "ecospec", "adaptive")
# The total_weight "adaptive" selects with under EP unless told otherwise (the SGLang plugin's
# default, and the sweep's): its stopping rule weighs a candidate against the step's time,
# and an EP step waits for its busiest rank only, so experts added on the other ranks cost
# it nothing. The op's own default (1 / R) hedges for a wrongly predicted busiest rank, but
# with "adaptive" the sweep predicts it too cautious at batch 1-2 (docs/RESULTS.md, sweep
# runs 6 and 7).
ADAPTIVE_EP_TOTAL_WEIGHT = 0.0


@dataclasses.dataclass(frozen=True)
class SelectionOptions:
    """The checked scalar options of :func:`sgl_ecospec.select_verify_set`.

    Attributes:
        policy: "confidence", "ecospec" or "adaptive".
        eps: > 0, added to DeltaCost so fully covered nodes keep a finite score, in units of
            one expert load in one layer (``costmodel.selection_cost`` derives it).
        share_buffer: one expert buffer (and, for "adaptive", one account) for the batch.
        total_weight: in [0, 1], weight of the experts off the busiest EP rank, or None for
            1 / R; read only with an EP placement (``expert_rank``).
        step_tokens: >= 0, expected tokens one request's step yields before any candidate.
        step_cost: > 0, one request's share of the step's cost before any candidate, in the
            units of eps; required by "adaptive" (the only policy that reads it), else None.
        candidate_cost: >= 0, what a request's first candidate costs beyond DeltaCost + eps.
        candidate_decay: in [0, 1], the factor by which each taken candidate lowers the
            request's next ``candidate_cost``.
        min_score: >= 0, the lowest score a candidate may have to be taken (0: any).
        round_sync: with ``share_buffer``, every request of a round (its k-th pick) picks
            against the buffer and account as they stood at the round's start, and the
            round's picks then enter them together; without it each request sees every pick
            made before its own. Rounds run in parallel on a GPU (budget dependent steps
            instead of B x budget); a request no longer sees its round's earlier picks.
    """

    policy: str = "ecospec"
    eps: float = DEFAULT_EPS
    share_buffer: bool = False
    total_weight: float | None = None
    step_tokens: float = 1.0
    step_cost: float | None = None
    candidate_cost: float = 0.0
    candidate_decay: float = 1.0
    min_score: float = 0.0
    round_sync: bool = False

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        object.__setattr__(self, "eps", check_positive("eps", self.eps))
        if not isinstance(self.share_buffer, bool):
            raise TypeError(f"share_buffer must be a bool, got {self.share_buffer!r}")
        if not isinstance(self.round_sync, bool):
            raise TypeError(f"round_sync must be a bool, got {self.round_sync!r}")
        if self.round_sync and not self.share_buffer:
            raise ValueError(
                "round_sync=True needs share_buffer=True: with a buffer per request every "
                "round has one pick per buffer already"
            )
        if self.total_weight is not None:
            weight = check_finite("total_weight", self.total_weight)
            if not 0 <= weight <= 1:
                raise ValueError(f"total_weight must lie in [0, 1], got {weight}")
            object.__setattr__(self, "total_weight", weight)
        if check_finite("step_tokens", self.step_tokens) < 0:
            raise ValueError(f"step_tokens must be >= 0, got {self.step_tokens}")
        if check_finite("candidate_cost", self.candidate_cost) < 0:
            raise ValueError(f"candidate_cost must be >= 0, got {self.candidate_cost}")
        if not 0 <= check_finite("candidate_decay", self.candidate_decay) <= 1:
            raise ValueError(f"candidate_decay must lie in [0, 1], got {self.candidate_decay}")
        if check_finite("min_score", self.min_score) < 0:
            raise ValueError(f"min_score must be >= 0, got {self.min_score}")
        # Python floats from here on: the ops' schema and the reference's arithmetic read them.
        for name in ("step_tokens", "candidate_cost", "candidate_decay", "min_score"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if self.step_cost is not None:
            object.__setattr__(self, "step_cost", check_positive("step_cost", self.step_cost))
        elif self.policy == "adaptive":
            raise ValueError(
                "policy 'adaptive' needs step_cost: a request's share of the step's cost "
                "before any candidate, in expert loads (sgl_ecospec.costmodel.selection_cost "
                "gives it)"
            )

    @classmethod
    def of(cls, options: "SelectionOptions | None", keywords: dict) -> "SelectionOptions":
        """The options of a call that takes either ``options=`` or the option keywords
        (``policy=``, ``eps=``, ...: the fields above), never both.

        Raises:
            TypeError: both forms, an unknown keyword, or ``options`` of another type.
        """
        if options is None:
            unknown = sorted(set(keywords) - set(OPTION_NAMES))
            if unknown:
                raise TypeError(
                    f"unknown selection option(s) {unknown}; the options are {OPTION_NAMES}"
                )
            # The keyword form has always taken any truthy value for the flags.
            flags = {name: bool(keywords[name]) for name in _FLAGS if name in keywords}
            keywords = {**keywords, **flags}
            return cls(**keywords)
        if keywords:
            raise TypeError(
                f"pass the selection options either as options= or as keywords, not both "
                f"(got options= and {sorted(keywords)})"
            )
        if not isinstance(options, cls):
            raise TypeError(f"options must be a SelectionOptions, got {type(options).__name__}")
        return options

    @property
    def stops_short(self) -> bool:
        """A request's set may hold fewer than ``budget`` candidates (:func:`stops_short`)."""
        return stops_short(self.policy, self.min_score)

    def replace(self, **changes) -> "SelectionOptions":
        """These options with ``changes`` (checked again), or these very options when
        nothing changes (e.g. the cost model's eps for a batch size that equals this one)."""
        if all(getattr(self, name) == value for name, value in changes.items()):
            return self
        return dataclasses.replace(self, **changes)


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(SelectionOptions))
_FLAGS = ("share_buffer", "round_sync")


def stops_short(policy: str, min_score: float) -> bool:
    """Whether selection under ``policy`` and ``min_score`` may give a request fewer than
    ``budget`` candidates: "adaptive" stops when a candidate no longer pays, a floor > 0
    drops the candidates below it."""
    return policy == "adaptive" or min_score > 0
