"""The context count-table predictor: routing counts per token (every token its own row, or
hashed rows) and per (parent token, token) pair, backing off pair -> token -> the global
per-layer frequency; learnt online from the verified routing, needs no training.

Shape legend: as :mod:`sgl_ecospec.predictors.base`; R = token rows, C = pair buckets.
"""

import math

import torch

from sgl_ecospec.ops.checks import INDEX_DTYPES, check_tensor
from sgl_ecospec.predictors.base import ExpertPredictor, multi_hot
from sgl_ecospec.predictors.online import check_buckets, hash_buckets
from sgl_ecospec.predictors.state import (
    CONTEXT_FORMAT,
    STATE_VERSION,
    SavedTables,
    check_state_header,
    config_diffs,
)

# Count storage: name -> (dtype, the largest count a cell holds before its row is halved).
COUNT_DTYPES = {
    "uint8": (torch.uint8, 255.0),
    "int16": (torch.int16, 32767.0),
    "float32": (torch.float32, math.inf),
}
# The global frequency is halved past this many observations per layer (float32 stays exact).
_PRIOR_LIMIT = 2.0**22
# Odd 32-bit multipliers of the pair hash (parent and token mixed before bucketing).
_PAIR_MULT = (2654435761, 2246822519)
_MASK32 = 2**32 - 1


def _expert_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int16


class ContextExpertPredictor(SavedTables, ExpertPredictor):
    """Routing counts per token and per (parent, token) pair, with back-off.

    A token row counts, per layer and expert, how often the token was routed there
    (``vocab_size`` rows: every token its own row; otherwise ``token_buckets`` rows indexed
    by :func:`hash_buckets`, shared by colliding tokens). A pair row counts the same for one
    (parent token, token) key; pair rows live in ``pair_buckets`` slots indexed by a hash of
    the key, each slot holding one key (a new key evicts the old one, so colliding keys never
    mix their counts). Scores back off as in smoothed language models:

    - a token row ranks experts by ``counts + prior_weight * p_global`` (``p_global`` the
      global per-layer frequency scaled to sum to K: it ranks experts for unseen tokens and
      breaks ties);
    - a pair row by ``counts + pair_weight * p_token``, ``p_token`` the token row's smoothed
      distribution (also summing to K): with one observation and ``pair_weight`` <= 1 the
      pair's own experts lead, with more weight the token's habits can outvote a single pair
      observation.

    Each row's top-K is cached when the row learns (``observe`` updates only the rows of the
    tokens it sees), so a prediction is a few gathers, whatever L and E: a known pair's cached
    experts, else the token's, else the global top-K.

    Counts are compact (``count_dtype``): a row whose largest count would pass the dtype's
    limit is halved, which also lets old routing fade.

    ``predict_topk`` and ``observe`` take ``context_tokens`` ``[T]``: each row's parent token
    (the draft tree's parent of a candidate; for the root, the last verified token before
    it), -1 where unknown (the row then backs off to its token). Both run a fixed number of
    batched kernels and no host sync when ``validate=False``, and every update is in place, so
    a CUDA graph captured around ``predict_topk`` keeps reading the live tables.

    Args:
        num_layers: L.
        num_experts: E.
        top_k: K.
        vocab_size: token ids are in [0, vocab_size) and each gets its own row; None: hashed
            rows (``token_buckets``).
        token_buckets: rows of the hashed token table when ``vocab_size`` is None.
        pair_buckets: slots of the pair table; 0 = no pair table (token counts only).
        pair_weight: pseudo-counts of the token distribution in a pair row's score (> 0).
        prior_weight: pseudo-counts of the global distribution in a token row's score (> 0).
        count_dtype: "uint8", "int16" or "float32".
        device: where the tables live.
    """

    STATE_FORMAT = CONTEXT_FORMAT

    needs_context = True

    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        top_k: int,
        *,
        vocab_size: int | None = None,
        token_buckets: int = 4096,
        pair_buckets: int = 0,
        pair_weight: float = 1.0,
        prior_weight: float = 0.05,
        count_dtype: str = "uint8",
        device: str | torch.device = "cpu",
    ):
        super().__init__(num_layers, num_experts, top_k)
        if vocab_size is not None:
            check_buckets("vocab_size", vocab_size, minimum=1)
        self.vocab_size = vocab_size
        self.token_buckets = check_buckets("token_buckets", token_buckets, minimum=1)
        self.pair_buckets = check_buckets("pair_buckets", pair_buckets, minimum=0)
        self.pair_weight = _check_weight("pair_weight", pair_weight)
        self.prior_weight = _check_weight("prior_weight", prior_weight)
        if count_dtype not in COUNT_DTYPES:
            raise ValueError(
                f"count_dtype must be one of {tuple(COUNT_DTYPES)}, got {count_dtype!r}"
            )
        self.count_dtype = count_dtype
        dtype, self._count_limit = COUNT_DTYPES[count_dtype]
        self.device = torch.device(device)
        rows = vocab_size if vocab_size is not None else token_buckets
        shape, experts = (num_layers, num_experts), _expert_dtype(num_experts)
        kw = {"device": self.device}
        # One extra row per table: the scratch row that duplicate and invalid writes go to.
        self.token_counts = torch.zeros((rows + 1, *shape), dtype=dtype, **kw)
        self.token_topk = torch.zeros((rows + 1, num_layers, top_k), dtype=experts, **kw)
        self.token_seen = torch.zeros(rows + 1, dtype=torch.bool, **kw)
        self.pair_keys = torch.full((self.pair_buckets + 1,), -1, dtype=torch.int64, **kw)
        self.pair_counts = torch.zeros((self.pair_buckets + 1, *shape), dtype=dtype, **kw)
        self.pair_topk = torch.zeros(
            (self.pair_buckets + 1, num_layers, top_k), dtype=experts, **kw
        )
        self.prior = torch.zeros(shape, dtype=torch.float32, **kw)
        self.prior_topk = torch.arange(top_k, dtype=experts, **kw).expand(num_layers, -1).clone()

    @property
    def num_rows(self) -> int:
        """R, token rows (the vocabulary, or the hash buckets)."""
        return self.token_counts.shape[0] - 1

    def config(self) -> dict:
        """The constructor arguments that fix the table layout and learning rule."""
        return {
            **self._shape_config(),
            "vocab_size": self.vocab_size,
            "token_buckets": self.token_buckets,
            "pair_buckets": self.pair_buckets,
            "pair_weight": self.pair_weight,
            "prior_weight": self.prior_weight,
            "count_dtype": self.count_dtype,
        }

    def memory_bytes(self) -> int:
        """Bytes of every table."""
        return sum(t.numel() * t.element_size() for t in self._tables().values())

    def token_rows(self, token_ids: torch.Tensor) -> torch.Tensor:
        """int64 ``[T]`` in [0, R): each token's row (its id, or its hash bucket)."""
        if self.vocab_size is None:
            return hash_buckets(token_ids, self.token_buckets, self.device)
        # Ids are checked to be in range when validating; the remainder keeps a stray id
        # from reading out of bounds without a host sync.
        return token_ids.to(self.device, torch.int64).remainder(self.vocab_size)

    def pair_slots(self, context_tokens: torch.Tensor, token_ids: torch.Tensor):
        """(key int64 ``[T]``, slot int64 ``[T]`` in [0, C)) of each (parent, token) pair;
        the key is -1 where the parent is unknown (< 0)."""
        parent = context_tokens.to(self.device, torch.int64)
        token = token_ids.to(self.device, torch.int64)
        key = torch.where(parent >= 0, (parent << 32) | (token & _MASK32), -1)
        mixed = (parent * _PAIR_MULT[0] + token * _PAIR_MULT[1]) & _MASK32
        return key, (mixed * self.pair_buckets) >> 32

    # --- ExpertPredictor ---------------------------------------------------------------------

    def predict_topk(self, token_ids, hidden=None, *, validate=False, context_tokens=None):
        """As :meth:`ExpertPredictor.predict_topk`; ``context_tokens`` int ``[T]`` (or None:
        no context): each row's parent token, -1 where unknown."""
        self._check(token_ids, context_tokens, validate)
        rows = self._lookup_rows(self.token_rows(token_ids), context_tokens)
        seen = self.token_seen[rows][:, None, None]
        pred = torch.where(seen, self.token_topk[rows], self.prior_topk)  # [T, L, K]
        if self.pair_buckets and context_tokens is not None:
            key, slot = self.pair_slots(context_tokens, token_ids)
            known = ((self.pair_keys[slot] == key) & (key >= 0))[:, None, None]
            pred = torch.where(known, self.pair_topk[slot], pred)
        return pred.long()

    def observe(self, token_ids, topk_ids, hidden=None, *, validate=True, context_tokens=None):
        """As :meth:`ExpertPredictor.observe`; ``context_tokens`` int ``[T]`` (or None: the
        pair table learns nothing): each row's parent token, -1 where unknown."""
        num_tokens = self._check(token_ids, context_tokens, validate)
        self._check_topk_ids(topk_ids, num_tokens, validate)
        if num_tokens == 0:
            return
        hot = multi_hot(topk_ids.to(self.device), self.num_experts, validate=False)  # [T, L, E]
        self.prior += hot.sum(0)
        too_many = self.prior.sum(-1, keepdim=True) > _PRIOR_LIMIT  # [L, 1]
        self.prior.mul_(torch.where(too_many, 0.5, 1.0))
        global_dist = self._global_distribution()  # [L, E]
        self.prior_topk.copy_(torch.topk(global_dist, self.top_k, dim=-1).indices)

        rows = self.token_rows(token_ids)
        token = self._accumulate(self.token_counts, rows, rows, hot)  # [T, L, E]
        # The token's smoothed distribution, summing to K per layer like the pair's counts.
        seen = token.sum(-1, keepdim=True) / self.top_k + self.prior_weight
        token_dist = (token + self.prior_weight * global_dist) / seen
        target = torch.where(_last_of_each(rows), rows, self.num_rows)
        self.token_counts[target] = token.to(self.token_counts.dtype)
        # Only each group's last row writes, so ``hot`` there is the row's latest routing.
        self.token_topk[target] = self._cached_topk(token_dist, hot)
        self.token_seen[target] = True
        if not self.pair_buckets or context_tokens is None:
            return
        key, slot = self.pair_slots(context_tokens, token_ids)
        valid = key >= 0
        # Rows without a parent get distinct negative keys so they group with no other row.
        key = torch.where(valid, key, -1 - torch.arange(num_tokens, device=self.device))
        stored = self.pair_keys[slot] == key
        pair = self._accumulate(self.pair_counts, slot, key, hot, keep=stored)
        pair_seen = pair.sum(-1, keepdim=True) / self.top_k + self.pair_weight
        keep = valid & _last_of_each(torch.where(valid, slot, key))
        target = torch.where(keep, slot, self.pair_buckets)
        self.pair_keys[target] = torch.where(keep, key, -1)
        self.pair_counts[target] = pair.to(self.pair_counts.dtype)
        pair_dist = (pair + self.pair_weight * token_dist) / pair_seen
        self.pair_topk[target] = self._cached_topk(pair_dist, hot)

    # --- internals ---------------------------------------------------------------------------

    def _check(self, token_ids, context_tokens, validate: bool) -> int:
        if token_ids is None:
            raise ValueError("ContextExpertPredictor reads token ids: pass token_ids [T]")
        num_tokens = self._check_token_ids(token_ids, validate)
        if validate and self.vocab_size is not None and token_ids.numel():
            if bool((token_ids >= self.vocab_size).any()):
                raise ValueError(
                    f"token_ids must be < vocab_size={self.vocab_size}, got "
                    f"{int(token_ids.max())}: build the predictor with the target's vocab size"
                )
        if context_tokens is not None:
            check_tensor("context_tokens", context_tokens, ndim=1, dtypes=INDEX_DTYPES)
            if context_tokens.shape[0] != num_tokens:
                raise ValueError(
                    f"context_tokens must have shape ({num_tokens},) like token_ids, got "
                    f"{tuple(context_tokens.shape)}"
                )
        return num_tokens

    def _accumulate(self, table, slot, group, hot, keep=None) -> torch.Tensor:
        """float32 ``[T, L, E]``: each row's counts after this batch (``table[slot]``, or zero
        where ``keep`` is False, plus the routing of every row of its ``group``), halved
        where a count would pass the dtype's limit."""
        same = group[:, None] == group[None, :]  # [T, T]
        # argmax returns the first maximal index: the first row of each group sums it.
        first = same.to(torch.int8).argmax(1)
        summed = torch.zeros_like(hot).index_add_(0, first, hot)[first]
        old = table[slot].float()
        if keep is not None:
            old = old * keep[:, None, None]
        counts = old + summed
        peak = counts.amax(-1, keepdim=True).clamp_min(1.0)
        # Past the limit the row shrinks to half the limit (a halving for one more count).
        scale = torch.where(peak > self._count_limit, 0.5 * self._count_limit / peak, 1.0)
        return torch.floor(counts * scale) if math.isfinite(self._count_limit) else counts

    def _lookup_rows(self, rows: torch.Tensor, context_tokens: torch.Tensor | None):
        """int64 ``[T]``: the token row whose cached experts each row reads, its own
        (``rows`` int64 ``[T]``) here; a subclass may read another row, chosen from the rows'
        parent tokens (``context_tokens`` int ``[T]``, -1 where unknown, or None)."""
        return rows

    def _topk(self, score: torch.Tensor) -> torch.Tensor:
        return torch.topk(score, self.top_k, dim=-1).indices.to(self.token_topk.dtype)

    def _cached_topk(self, dist: torch.Tensor, latest: torch.Tensor) -> torch.Tensor:
        """The experts a token or pair row caches, ``[T, L, K]`` in the cache's dtype.

        Args:
            dist: float32 ``[T, L, E]``: each row's smoothed distribution (sums to K per
                layer), whose top-K this table caches.
            latest: float32 ``[T, L, E]``: multi-hot of each row's latest routing; unused
                here, the hook through which a subclass favours recent routing.
        """
        return self._topk(dist)

    def _global_distribution(self) -> torch.Tensor:
        total = self.prior.sum(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        return self.prior * (self.top_k / total)

    def _tables(self) -> dict:
        names = ("token_counts", "token_topk", "token_seen", "pair_keys", "pair_counts")
        return {n: getattr(self, n) for n in (*names, "pair_topk", "prior", "prior_topk")}

    # --- state -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Tables, config and format version, as CPU tensors and plain Python values."""
        tables = {name: t.cpu() for name, t in self._tables().items()}
        return {
            "format": self.STATE_FORMAT,
            "version": STATE_VERSION,
            "config": self.config(),
            **tables,
        }

    def load_state_dict(self, state: dict, *, source: str = "state dict") -> None:
        """Restores a :meth:`state_dict`; its config must equal this predictor's."""
        check_state_header(state, source, self.STATE_FORMAT)
        diffs = config_diffs(state["config"], self.config())
        if diffs:
            raise ValueError(
                f"{source} was saved by a predictor with a different config ({diffs}); load "
                f"it with {type(self).__name__}.load(path) to get its own config"
            )
        for name, table in self._tables().items():
            table.copy_(state[name])


def _last_of_each(group: torch.Tensor) -> torch.Tensor:
    """bool ``[T]``: rows with no later row of the same ``group`` value (one writer per
    slot, so the in-place writes are deterministic)."""
    later = torch.ones(group.shape[0], group.shape[0], dtype=torch.bool, device=group.device)
    later = later.triu(1) & (group[:, None] == group[None, :])
    return ~later.any(1)


def _check_weight(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return float(value)
