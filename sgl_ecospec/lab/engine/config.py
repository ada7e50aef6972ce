"""Speculative decoding parameters (SGLang's ``--speculative-*`` flags plus the selection)."""

import dataclasses

import torch

from sgl_ecospec.lab.engine.drafter import TREE_ATTENTION
from sgl_ecospec.lab.engine.evict import EVICT
from sgl_ecospec.lab.engine.tree import num_candidates
from sgl_ecospec.ops.options import OPTION_NAMES, SERVED_SHARE_BUFFER, SelectionOptions

# The engine's selection when a SpecConfig names none: SGLang's own choice (confidence), with
# one expert buffer for the batch as served; every other option is the op's.
ENGINE_SELECTION = SelectionOptions(policy="confidence", share_buffer=SERVED_SHARE_BUFFER)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """How the draft tree is grown and which candidates are verified.

    Attributes:
        topk: children per beam (``--speculative-eagle-topk``).
        num_steps: draft depth (``--speculative-num-steps``).
        budget: candidates verified per request besides the root, out of N = topk +
            (num_steps - 1) * topk^2 (a policy that stops short may select fewer); SGLang's
            ``--speculative-num-draft-tokens`` is budget + 1 (:attr:`num_draft_tokens`).
        selection: the checked options of :func:`sgl_ecospec.select_verify_set` (policy,
            eps, share_buffer, total_weight, the "adaptive" account, min_score), carried to
            the op as they are; :data:`ENGINE_SELECTION` when not given.
        evict_seconds: the benchmark's EVICT peer (``engine.evict``): confidence's choice cut
            to its best prefix, by budget + 1 predicted seconds > 0 of a step in which every
            request verifies its root and k candidates, k = 0..budget
            (``bench.peers.evict_step_seconds``); needs ``selection.policy`` "confidence".
            None: no cut.
        tree_attention: how draft beams attend to earlier draft steps: "sglang" (SGLang's
            per-slot KV layout) or "ancestors" (a true tree mask); see ``engine.drafter``.
        layer_weights: weight of each MoE layer's DeltaCost, L floats >= 0, or None (all
            ones). Any sequence or 1-D tensor is stored as a tuple of floats.
        expert_rank: the expert-parallel rank holding each expert, E ints (every layer) or
            L rows of E ints, or None (no EP: DeltaCost counts every expert alike). Any
            nested sequence or integer tensor is stored as (nested) tuples of ints;
            ``sgl_ecospec.placement.expert_rank_map`` builds one from SGLang's layout.
            ``selection.total_weight`` is read only with it.
        num_ranks: R, EP ranks (>= 1); None for max(expert_rank) + 1. Only with
            ``expert_rank``.
        calibrated_acceptance: selection weighs each candidate by its calibrated probability
            of being accepted, learnt online from the verify results
            (``sgl_ecospec.acceptance``), instead of its cumulative draft probability. The
            output stays the target's own either way.
        recall_weighted_cost: DeltaCost trusts only what the expert predictor knows: each
            layer weighted by the predictor's live recall above chance, and the experts it
            misses and the step's buffer does not hold yet, which every candidate brings
            alike, added to eps (``sgl_ecospec.predictors.LiveRecall.weigh``); as recall
            falls, "ecospec" approaches "confidence".

    E and L are checked against the target when the engine runs.
    """

    topk: int = 4
    num_steps: int = 3
    budget: int = 4
    selection: SelectionOptions = ENGINE_SELECTION
    evict_seconds: tuple[float, ...] | None = None
    tree_attention: str = "sglang"
    layer_weights: tuple[float, ...] | None = None
    expert_rank: tuple[int, ...] | tuple[tuple[int, ...], ...] | None = None
    num_ranks: int | None = None
    calibrated_acceptance: bool = False
    recall_weighted_cost: bool = False

    def __post_init__(self):
        if self.topk < 1 or self.num_steps < 1:
            raise ValueError(f"topk and num_steps must be >= 1, got {self.topk}, {self.num_steps}")
        candidates = num_candidates(self.topk, self.num_steps)
        if isinstance(self.budget, bool) or not isinstance(self.budget, int):
            raise TypeError(f"budget must be an int, got {self.budget!r}")
        if not 1 <= self.budget <= candidates:
            raise ValueError(
                f"budget must be in [1, {candidates}] (up to N = {candidates} candidates for "
                f"topk={self.topk}, num_steps={self.num_steps}), got {self.budget}"
            )
        if not isinstance(self.selection, SelectionOptions):
            raise TypeError(
                f"selection must be a SelectionOptions, got {type(self.selection).__name__} "
                "(SpecConfig.from_fields takes the options as flat fields)"
            )
        for name in ("recall_weighted_cost", "calibrated_acceptance"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.tree_attention not in TREE_ATTENTION:
            raise ValueError(
                f"tree_attention must be one of {TREE_ATTENTION}, got {self.tree_attention!r}"
            )
        if self.layer_weights is not None:
            object.__setattr__(self, "layer_weights", _layer_weights(self.layer_weights))
        self._check_placement()
        self._check_evict_seconds()

    @classmethod
    def from_fields(cls, **fields) -> "SpecConfig":
        """A SpecConfig from one flat record, its own fields and the selection options side
        by side, as the bench and the sweep plan their runs (and write them to JSON).

        The options not given are :data:`ENGINE_SELECTION`'s; policy "evict" is EVICT
        (confidence's selection cut by ``evict_seconds``, which it needs and only it takes).
        """
        options = {name: fields.pop(name) for name in OPTION_NAMES if name in fields}
        if options.get("policy") == EVICT:
            options["policy"] = "confidence"
            if fields.get("evict_seconds") is None:
                raise ValueError(
                    "policy 'evict' needs evict_seconds: budget + 1 finite step seconds > 0 "
                    "(k = 0..budget candidates per request)"
                )
        elif fields.get("evict_seconds") is not None:
            policy = options.get("policy", ENGINE_SELECTION.policy)
            raise ValueError(f"evict_seconds is for policy 'evict', not {policy!r}")
        return cls(**fields, selection=ENGINE_SELECTION.replace(**options))

    @property
    def policy(self) -> str:
        """The selection's policy, or "evict" for the EVICT peer."""
        return EVICT if self.evict_seconds is not None else self.selection.policy

    def _check_evict_seconds(self):
        if self.evict_seconds is None:
            return
        if self.selection.policy != "confidence":
            raise ValueError(
                "evict_seconds cuts confidence's choice, but selection.policy is "
                f"{self.selection.policy!r}"
            )
        seconds = tuple(float(s) for s in self.evict_seconds)
        if len(seconds) != self.budget + 1 or not all(0 < s < float("inf") for s in seconds):
            raise ValueError(
                f"policy 'evict' needs evict_seconds: budget + 1 = {self.budget + 1} finite "
                f"step seconds > 0 (k = 0..budget candidates per request), got "
                f"{self.evict_seconds!r}"
            )
        object.__setattr__(self, "evict_seconds", seconds)

    def _check_placement(self):
        if self.expert_rank is None:
            given = {"num_ranks": self.num_ranks, "total_weight": self.selection.total_weight}
            for name, value in given.items():
                if value is not None:
                    raise ValueError(f"{name} needs expert_rank (the expert -> EP rank placement)")
            return
        ranks = torch.as_tensor(self.expert_rank)
        if ranks.numel() == 0:
            raise ValueError("expert_rank is empty: give the rank of every expert")
        if ranks.dtype.is_floating_point or ranks.dtype == torch.bool or ranks.dim() not in (1, 2):
            raise ValueError(
                "expert_rank must be integers shaped [E] or [L, E], got dtype "
                f"{ranks.dtype} and shape {tuple(ranks.shape)}"
            )
        num_ranks = int(ranks.max()) + 1 if self.num_ranks is None else self.num_ranks
        if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
            raise ValueError(f"num_ranks must be an int >= 1, got {self.num_ranks!r}")
        if bool(((ranks < 0) | (ranks >= num_ranks)).any()):
            raise ValueError(f"expert_rank values must lie in [0, num_ranks={num_ranks})")
        object.__setattr__(self, "expert_rank", _as_tuple(ranks.tolist()))
        object.__setattr__(self, "num_ranks", num_ranks)

    @property
    def num_draft_tokens(self) -> int:
        """Verified tokens per request including the root: SGLang's
        ``--speculative-num-draft-tokens``."""
        return self.budget + 1

    @property
    def num_candidates(self) -> int:
        """N, candidates in the draft tree."""
        return num_candidates(self.topk, self.num_steps)


def _layer_weights(weights) -> tuple[float, ...]:
    values = torch.as_tensor(weights, dtype=torch.float64)
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"layer_weights must be L >= 1 floats, got shape {tuple(values.shape)}")
    if not bool(torch.isfinite(values).all()) or bool((values < 0).any()):
        raise ValueError("layer_weights must be finite and >= 0")
    return tuple(values.tolist())


def _as_tuple(value):
    """Nested lists -> nested tuples (hashable, comparable)."""
    return tuple(_as_tuple(v) for v in value) if isinstance(value, list) else value
