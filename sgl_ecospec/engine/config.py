"""Speculative decoding parameters (SGLang's ``--speculative-*`` flags plus the selection)."""

import dataclasses
import math

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
            selected out of N = topk + (num_steps - 1) * topk^2.
        policy: selection policy of :func:`sgl_ecospec.select_verify_set`: "confidence"
            (SGLang's own choice) or "ecospec".
        eps: EcoSpec's eps in P / (DeltaCost + eps).
        share_buffer: one expert buffer for the whole batch (see ``select_verify_set``).
        tree_attention: how draft beams attend to earlier draft steps: "sglang" (SGLang's
            per-slot KV layout) or "ancestors" (a true tree mask); see ``engine.drafter``.
    """

    topk: int = 4
    num_steps: int = 3
    num_draft_tokens: int = 5
    policy: str = "confidence"
    eps: float = 0.1
    share_buffer: bool = True
    tree_attention: str = "sglang"

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
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"eps must be finite and > 0, got {self.eps}")
        if self.tree_attention not in TREE_ATTENTION:
            raise ValueError(
                f"tree_attention must be one of {TREE_ATTENTION}, got {self.tree_attention!r}"
            )

    @property
    def num_candidates(self) -> int:
        """N, candidates in the draft tree."""
        return num_candidates(self.topk, self.num_steps)
