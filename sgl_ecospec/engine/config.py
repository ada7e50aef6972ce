"""Speculative decoding parameters (SGLang's ``--speculative-*`` flags plus the selection)."""

import dataclasses
import math

import torch

from sgl_ecospec.engine.drafter import TREE_ATTENTION
from sgl_ecospec.engine.tree import num_candidates
from sgl_ecospec.selection import POLICIES


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """How the draft tree is grown and which candidates are verified.

    Attributes:
        topk: children per beam (``--speculative-eagle-topk``).
        num_steps: draft depth (``--speculative-num-steps``).
        num_draft_tokens: verified tokens per request including the root
            (``--speculative-num-draft-tokens``); num_draft_tokens - 1 candidates are
            selected out of N = topk + (num_steps - 1) * topk^2 ("adaptive" may select
            fewer).
        policy: selection policy of :func:`sgl_ecospec.select_verify_set`: "confidence"
            (SGLang's own choice), "ecospec" or "adaptive".
        eps: EcoSpec's eps in P / (DeltaCost + eps), in expert loads
            (``costmodel.selection_cost`` derives it).
        share_buffer: one expert buffer for the whole batch (see ``select_verify_set``).
        tree_attention: how draft beams attend to earlier draft steps: "sglang" (SGLang's
            per-slot KV layout) or "ancestors" (a true tree mask); see ``engine.drafter``.
        layer_weights: weight of each MoE layer's DeltaCost, L floats >= 0, or None (all
            ones). Any sequence or 1-D tensor is stored as a tuple of floats.
        expert_rank: the expert-parallel rank holding each expert, E ints (every layer) or
            L rows of E ints, or None (no EP: DeltaCost counts every expert alike). Any
            nested sequence or integer tensor is stored as (nested) tuples of ints;
            ``sgl_ecospec.placement.expert_rank_map`` builds one from SGLang's layout.
        num_ranks: R, EP ranks (>= 1); None for max(expert_rank) + 1. Only with
            ``expert_rank``.
        total_weight: in [0, 1], weight of the experts off the busiest rank; None for 1 / R.
            Only with ``expert_rank``.
        step_tokens: >= 0, "adaptive": expected tokens a request's step yields before any
            candidate (1: the bonus token).
        step_cost: > 0, "adaptive" (required there): a request's share of the step's cost
            before any candidate, in the units of eps.

    E and L are checked against the target when the engine runs.
    """

    topk: int = 4
    num_steps: int = 3
    num_draft_tokens: int = 5
    policy: str = "confidence"
    eps: float = 0.1
    share_buffer: bool = True
    tree_attention: str = "sglang"
    layer_weights: tuple[float, ...] | None = None
    expert_rank: tuple[int, ...] | tuple[tuple[int, ...], ...] | None = None
    num_ranks: int | None = None
    total_weight: float | None = None
    step_tokens: float = 1.0
    step_cost: float | None = None

    def __post_init__(self):
        if self.topk < 1 or self.num_steps < 1:
            raise ValueError(f"topk and num_steps must be >= 1, got {self.topk}, {self.num_steps}")
        candidates = num_candidates(self.topk, self.num_steps)
        if not 2 <= self.num_draft_tokens <= candidates + 1:
            raise ValueError(
                f"num_draft_tokens must be in [2, {candidates + 1}] (root + up to N = "
                f"{candidates} candidates for topk={self.topk}, num_steps={self.num_steps}), "
                f"got {self.num_draft_tokens}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not (_is_number(self.eps) and math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"eps must be finite and > 0, got {self.eps}")
        if self.tree_attention not in TREE_ATTENTION:
            raise ValueError(
                f"tree_attention must be one of {TREE_ATTENTION}, got {self.tree_attention!r}"
            )
        if self.layer_weights is not None:
            object.__setattr__(self, "layer_weights", _layer_weights(self.layer_weights))
        self._check_placement()
        self._check_step()

    def _check_placement(self):
        if self.expert_rank is None:
            for name in ("num_ranks", "total_weight"):
                if getattr(self, name) is not None:
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
        if self.total_weight is not None and not (
            _is_number(self.total_weight) and 0 <= self.total_weight <= 1
        ):
            raise ValueError(f"total_weight must lie in [0, 1], got {self.total_weight}")
        object.__setattr__(self, "expert_rank", _as_tuple(ranks.tolist()))
        object.__setattr__(self, "num_ranks", num_ranks)

    def _check_step(self):
        if not (_is_number(self.step_tokens) and math.isfinite(self.step_tokens)):
            raise ValueError(f"step_tokens must be a finite number, got {self.step_tokens!r}")
        if self.step_tokens < 0:
            raise ValueError(f"step_tokens must be >= 0, got {self.step_tokens}")
        if self.step_cost is None:
            if self.policy == "adaptive":
                raise ValueError(
                    "policy 'adaptive' needs step_cost: a request's share of the step's cost "
                    "before any candidate, in expert loads (costmodel.selection_cost gives it)"
                )
            return
        cost = self.step_cost
        if not (_is_number(cost) and math.isfinite(cost) and cost > 0):
            raise ValueError(f"step_cost must be finite and > 0, got {self.step_cost!r}")

    @property
    def num_candidates(self) -> int:
        """N, candidates in the draft tree."""
        return num_candidates(self.topk, self.num_steps)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


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
