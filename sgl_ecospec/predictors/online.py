"""The online count-table predictor: per-token routing counts in a hashed table, plus a
global per-layer frequency prior; learns from the verified routing, needs no training.

Shape legend: as :mod:`sgl_ecospec.predictors.base`.
"""

import math

import torch

from sgl_ecospec.ops.checks import INDEX_DTYPES, check_int, check_tensor
from sgl_ecospec.predictors.base import CheckedExpertPredictor, multi_hot
from sgl_ecospec.predictors.state import (
    ONLINE_FORMAT,
    STATE_VERSION,
    SavedTables,
    check_state_header,
    config_diffs,
)

_HASH_MULT = 2654435761
_HASH_BITS = 32


def hash_buckets(token_ids: torch.Tensor, num_buckets: int, device=None) -> torch.Tensor:
    """Hash bucket of each token id (multiply-shift hashing).

    Args:
        token_ids: int32 or int64, shape ``[T]``.
        num_buckets: in [1, 2**31).
        device: where the result goes (default: the ids' device).

    Returns:
        int64, shape ``[T]``, in [0, num_buckets).
    """
    check_tensor("token_ids", token_ids, ndim=1, dtypes=INDEX_DTYPES)
    # The high bits of the 32-bit product are the well mixed ones, and scaling them by
    # num_buckets works for any bucket count, not only powers of two. int64 wraparound of
    # the product keeps every id, even negative, in range.
    hashed = (token_ids.to(device or token_ids.device, torch.int64) * _HASH_MULT) & (
        2**_HASH_BITS - 1
    )
    return (hashed * num_buckets) >> _HASH_BITS


def check_buckets(name: str, value: int, minimum: int) -> int:
    check_int(name, value, minimum=minimum)
    if value >= 2**31:
        # The bucket index is (32-bit hash * buckets) >> 32, which must fit in int64.
        raise ValueError(f"{name} must be < 2**31, got {value}")
    return value


class OnlineExpertPredictor(SavedTables, CheckedExpertPredictor):
    """Per-token routing statistics, learnt online from the target's verified routing.

    A token's prediction is the K experts it was routed to most often per layer. Counts live
    in a float32 table ``[num_buckets, L, E]`` indexed by a multiplicative hash of the token
    id, so the memory is fixed whatever the vocabulary; tokens sharing a bucket share
    statistics. A global per-layer frequency table ``[L, E]`` adds ``prior_weight``
    pseudo-counts spread by frequency: it ranks experts for unseen tokens and breaks ties
    between equally counted experts (with ``prior_weight`` < 1 it never outvotes one
    observation).

    ``predict_topk`` (most frequent experts of the token's bucket) and ``observe`` (one count
    per token, layer and routed expert) ignore ``hidden``, and run a fixed number of batched
    kernels and no host sync when ``validate=False``, so they can be captured in CUDA graphs.

    Args:
        num_layers: L.
        num_experts: E.
        top_k: K.
        num_buckets: rows of the count table (hash buckets), in [1, 2**31).
        prior_weight: pseudo-counts of the global prior (>= 0).
        halve_every: halve every count after this many ``observe`` calls, so old routing
            fades; 0 = never.
        device: where the tables live.
    """

    STATE_FORMAT = ONLINE_FORMAT

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        *,
        num_buckets: int = 4096,
        prior_weight: float = 0.05,
        halve_every: int = 0,
        device: str | torch.device = "cpu",
    ):
        super().__init__(num_layers, num_experts, top_k)
        self.num_buckets = check_buckets("num_buckets", num_buckets, minimum=1)
        if isinstance(prior_weight, bool) or not isinstance(prior_weight, int | float):
            raise TypeError(f"prior_weight must be a number, got {type(prior_weight).__name__}")
        if not (math.isfinite(prior_weight) and prior_weight >= 0):
            raise ValueError(f"prior_weight must be finite and >= 0, got {prior_weight}")
        self.prior_weight = float(prior_weight)
        self.halve_every = check_int("halve_every", halve_every, minimum=0)
        self.device = torch.device(device)
        self.counts = torch.zeros(
            (num_buckets, num_layers, num_experts), dtype=torch.float32, device=self.device
        )
        self.prior = torch.zeros((num_layers, num_experts), dtype=torch.float32, device=self.device)
        # A Python int, not a tensor, so deciding when to age needs no host sync.
        self.observe_calls = 0

    def config(self) -> dict:
        """The constructor arguments that fix the table layout and learning rule."""
        return {
            **self._shape_config(),
            "num_buckets": self.num_buckets,
            "prior_weight": self.prior_weight,
            "halve_every": self.halve_every,
        }

    def bucket_ids(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Hash bucket of each token (:func:`hash_buckets`).

        Args:
            token_ids: int32 or int64, shape ``[T]``.

        Returns:
            int64, shape ``[T]``, in [0, num_buckets), on the predictor's device.
        """
        return hash_buckets(token_ids, self.num_buckets, self.device)

    def _check_inputs(self, token_ids, hidden, validate: bool, *, observing=False) -> int:
        # hidden is ignored: this predictor reads token ids only.
        if token_ids is None:
            if observing:
                raise ValueError("OnlineExpertPredictor learns per token id: pass token_ids [T]")
            raise ValueError("OnlineExpertPredictor predicts from token ids: pass token_ids [T]")
        return self._check_token_ids(token_ids, validate)

    def _predict(self, token_ids, hidden) -> torch.Tensor:
        # Most frequent experts of each token's bucket, prior-ranked where counts tie.
        scores = self.counts[self.bucket_ids(token_ids)] + self._prior_pseudo_counts()
        return torch.topk(scores, self.top_k, dim=-1).indices

    def _learn(self, token_ids, topk_ids: torch.Tensor, hidden) -> None:
        # One count per (token, layer, routed expert) in the token's bucket.
        hot = multi_hot(topk_ids.to(self.device), self.num_experts, validate=False)
        # index_add_ accumulates repeated buckets in the batch, so a batch equals the same
        # pairs fed one at a time. Every update is in place: a CUDA graph captured around
        # predict_topk keeps reading the live tables.
        self.counts.index_add_(0, self.bucket_ids(token_ids), hot)
        self.prior += hot.sum(0)
        self.observe_calls += 1
        if self.halve_every and self.observe_calls % self.halve_every == 0:
            self.counts.mul_(0.5)
            self.prior.mul_(0.5)

    def _prior_pseudo_counts(self) -> torch.Tensor:
        total = self.prior.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        return self.prior * (self.prior_weight / total)

    def state_dict(self) -> dict:
        """Tables, config and format version, as CPU tensors and plain Python values."""
        return {
            "format": ONLINE_FORMAT,
            "version": STATE_VERSION,
            "config": self.config(),
            "counts": self.counts.cpu(),
            "prior": self.prior.cpu(),
            "observe_calls": self.observe_calls,
        }

    def load_state_dict(self, state: dict, *, source: str = "state dict") -> None:
        """Restores a :meth:`state_dict`; its config must equal this predictor's.

        Args:
            state: a dict from :meth:`state_dict`.
            source: names the origin in error messages (e.g. the file path).
        """
        check_state_header(state, source)
        diffs = config_diffs(state["config"], self.config())
        if diffs:
            raise ValueError(
                f"{source} was saved by a predictor with a different config ({diffs}); load "
                f"it with OnlineExpertPredictor.load(path) to get its own config, or start a "
                f"fresh predictor for this model"
            )
        self.counts.copy_(state["counts"])
        self.prior.copy_(state["prior"])
        self.observe_calls = int(state["observe_calls"])
