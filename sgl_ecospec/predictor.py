"""Expert predictors: which experts each draft candidate will activate in the target.

EcoSpec ranks draft candidates by the experts they would add to the verify pass, so it needs,
for every candidate token, a guess of its top-K experts in every MoE layer of the target
before the target runs. Two predictors, both learning from the routing the target actually
produced during verification:

- :class:`OnlineExpertPredictor`: per-token routing counts in a hashed table, plus a global
  per-layer frequency prior. Costs a gather and a top-k; needs no training to start.
- :class:`LowRankExpertHead`: a small low-rank head on the drafter's hidden state and the
  candidate token, trained offline with :func:`train_expert_head` (the CLI's
  ``sgl-ecospec train-head``) and/or online through ``observe``.

:func:`load_predictor` reads a file saved by either.

Shape legend: T = tokens, L = MoE layers, E = experts per layer, K = experts per token
(top-K), H = drafter hidden size, W = ceil(E / 64) int64 words per layer bitmap.
"""

import abc
import math
import os

import torch

from sgl_ecospec._checks import INDEX_DTYPES, check_int, check_shape, check_tensor
from sgl_ecospec.bitmaps import bitmap_popcount, check_expert_ids, topk_to_bitmap

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Knuth's multiplicative constant (2**32 / golden ratio): consecutive token ids land far
# apart in the low 32 bits, so neighbouring ids rarely share a bucket.
_HASH_MULT = 2654435761
_HASH_BITS = 32
_STATE_FORMAT = "sgl_ecospec.OnlineExpertPredictor"
_HEAD_FORMAT = "sgl_ecospec.LowRankExpertHead"
_RMS_EPS = 1e-6
_STATE_VERSION = 1


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


def _check_buckets(name: str, value: int, minimum: int) -> int:
    check_int(name, value, minimum=minimum)
    if value >= 2**31:
        # The bucket index is (32-bit hash * buckets) >> 32, which must fit in int64.
        raise ValueError(f"{name} must be < 2**31, got {value}")
    return value


def topk_recall(pred_ids: torch.Tensor, true_ids: torch.Tensor, num_experts: int) -> float:
    """Mean over tokens and layers of |pred ∩ true| / |true| (repeated ids count once).

    Args:
        pred_ids: int32 or int64, shape ``[T, L, K]``: predicted expert ids in [0, E).
        true_ids: int32 or int64, shape ``[T, L, K']``: experts the target activated, in
            [0, E); K' may differ from K.
        num_experts: E.

    Returns:
        Recall in [0, 1] (a host sync: this is a metric, not a hot-path op).
    """
    check_tensor("pred_ids", pred_ids, ndim=3, dtypes=INDEX_DTYPES)
    check_tensor("true_ids", true_ids, ndim=3, dtypes=INDEX_DTYPES)
    if pred_ids.shape[:2] != true_ids.shape[:2]:
        raise ValueError(
            f"pred_ids and true_ids must agree on [T, L], got {tuple(pred_ids.shape)} and "
            f"{tuple(true_ids.shape)}"
        )
    if pred_ids.shape[0] == 0 or pred_ids.shape[1] == 0 or true_ids.shape[2] == 0:
        raise ValueError(
            f"recall needs at least one token, layer and true expert, got true_ids of shape "
            f"{tuple(true_ids.shape)}"
        )
    pred = topk_to_bitmap(pred_ids, num_experts)
    true = topk_to_bitmap(true_ids.to(pred.device), num_experts)
    hits = bitmap_popcount(pred & true).double()
    return float((hits / bitmap_popcount(true).double()).mean())


def multi_hot(topk_ids: torch.Tensor, num_experts: int, *, validate: bool = True) -> torch.Tensor:
    """Expands expert ids into multi-hot rows (repeated ids give a single 1).

    Args:
        topk_ids: int32 or int64, shape ``[T, L, K]`` (any leading dims): expert ids.
        num_experts: E.
        validate: check every id lies in [0, E) (a host sync on GPU).

    Returns:
        float32, shape ``[T, L, E]``: 1.0 where the expert is listed, else 0.0.
    """
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, min_ndim=1)
    check_int("num_experts", num_experts, minimum=1)
    if validate:
        check_expert_ids(topk_ids, num_experts)
    out = torch.zeros(
        (*topk_ids.shape[:-1], num_experts), dtype=torch.float32, device=topk_ids.device
    )
    return out.scatter_(-1, topk_ids.long(), 1.0)


class ExpertPredictor(abc.ABC):
    """Predicts, per token, the top-K experts of every MoE layer of the target.

    Attributes:
        num_layers: L, MoE layers of the target.
        num_experts: E, experts per layer.
        top_k: K, experts the target activates per token and layer (and that
            :meth:`predict_topk` returns).
        needs_hidden: whether predictions read the drafter hidden states (callers that
            have none can skip the predictor).
    """

    needs_hidden = False

    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        self.num_layers = check_int("num_layers", num_layers, minimum=1)
        self.num_experts = check_int("num_experts", num_experts, minimum=1)
        self.top_k = check_int("top_k", top_k, minimum=1)
        if top_k > num_experts:
            raise ValueError(f"top_k must be <= num_experts={num_experts}, got {top_k}")

    @abc.abstractmethod
    def predict_topk(
        self,
        token_ids: torch.Tensor | None,
        hidden: torch.Tensor | None = None,
        *,
        validate: bool = False,
    ) -> torch.Tensor:
        """Predicted experts per token and layer.

        Args:
            token_ids: int32 or int64, shape ``[T]``: candidate token ids (>= 0).
            hidden: float, shape ``[T, H]``: drafter hidden states, or None where the
                predictor does not read them.
            validate: check values (a host sync on GPU); shapes and dtypes are always
                checked.

        Returns:
            int64, shape ``[T, L, K]``: distinct expert ids per row, most likely first.
        """

    @abc.abstractmethod
    def observe(
        self,
        token_ids: torch.Tensor | None,
        topk_ids: torch.Tensor,
        hidden: torch.Tensor | None = None,
        *,
        validate: bool = True,
    ) -> None:
        """Learns from the routing the target actually produced for these tokens.

        Args:
            token_ids: int32 or int64, shape ``[T]``: verified token ids (>= 0).
            topk_ids: int32 or int64, shape ``[T, L, K]``: the target's expert ids.
            hidden: float, shape ``[T, H]``: drafter hidden states, or None where the
                predictor does not read them.
            validate: check values (a host sync on GPU).
        """

    def predict_bitmaps(
        self,
        token_ids: torch.Tensor | None,
        hidden: torch.Tensor | None = None,
        *,
        validate: bool = False,
    ) -> torch.Tensor:
        """:meth:`predict_topk` packed as bitmaps, the form verify-set selection reads.

        Args: as :meth:`predict_topk`.

        Returns:
            int64, shape ``[T, L, W]``.
        """
        ids = self.predict_topk(token_ids, hidden, validate=validate)
        # predict_topk only returns ids it produced by topk over E, so a range check here
        # would only cost a sync.
        return topk_to_bitmap(ids, self.num_experts, validate=False)

    def recall(
        self,
        token_ids: torch.Tensor | None,
        topk_ids: torch.Tensor,
        hidden: torch.Tensor | None = None,
    ) -> float:
        """:func:`topk_recall` of this predictor's guesses against the true routing.

        Args:
            token_ids: int32 or int64, shape ``[T]``.
            topk_ids: int32 or int64, shape ``[T, L, K']``: the target's expert ids.
            hidden: float, shape ``[T, H]``, or None where the predictor does not read it.
        """
        pred = self.predict_topk(token_ids, hidden, validate=True)
        return topk_recall(pred, topk_ids, self.num_experts)

    def _check_token_ids(
        self, token_ids: torch.Tensor, validate: bool, num_tokens: int | None = None
    ) -> int:
        check_tensor("token_ids", token_ids, ndim=1, dtypes=INDEX_DTYPES)
        if num_tokens is not None and token_ids.shape[0] != num_tokens:
            raise ValueError(
                f"token_ids must have shape ({num_tokens},) to match the other inputs, got "
                f"{tuple(token_ids.shape)}"
            )
        if validate and token_ids.numel() and bool((token_ids < 0).any()):
            raise ValueError(
                f"token_ids must be >= 0, got {int(token_ids.min())}: pass real vocabulary "
                f"ids (drop padding entries before calling)"
            )
        return token_ids.shape[0]

    def _check_topk_ids(self, topk_ids: torch.Tensor, num_tokens: int, validate: bool) -> None:
        check_tensor("topk_ids", topk_ids, ndim=3, dtypes=INDEX_DTYPES)
        check_shape(
            "topk_ids",
            topk_ids,
            (num_tokens, self.num_layers, self.top_k),
            "[T, L, K]: tokens x MoE layers x experts per token",
        )
        if validate:
            check_expert_ids(topk_ids, self.num_experts)


class OnlineExpertPredictor(ExpertPredictor):
    """Per-token routing statistics, learnt online from the target's verified routing.

    A token's prediction is the K experts it was routed to most often per layer. Counts live
    in a float32 table ``[num_buckets, L, E]`` indexed by a multiplicative hash of the token
    id, so the memory is fixed whatever the vocabulary; tokens sharing a bucket share
    statistics. A global per-layer frequency table ``[L, E]`` adds ``prior_weight``
    pseudo-counts spread by frequency: it ranks experts for unseen tokens and breaks ties
    between equally counted experts (with ``prior_weight`` < 1 it never outvotes one
    observation).

    ``predict_topk`` and ``observe`` run a fixed number of batched kernels and no host sync
    when ``validate=False``, so they can be captured in CUDA graphs.

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
        self.num_buckets = _check_buckets("num_buckets", num_buckets, minimum=1)
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
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
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

    def predict_topk(
        self,
        token_ids: torch.Tensor | None,
        hidden: torch.Tensor | None = None,
        *,
        validate: bool = False,
    ) -> torch.Tensor:
        """Most frequent experts of each token's bucket, prior-ranked where counts tie.

        Args:
            token_ids: int32 or int64, shape ``[T]``: candidate token ids (>= 0).
            hidden: ignored (this predictor reads token ids only).
            validate: check token ids are >= 0 (a host sync on GPU).

        Returns:
            int64, shape ``[T, L, K]``, most likely first.
        """
        if token_ids is None:
            raise ValueError("OnlineExpertPredictor predicts from token ids: pass token_ids [T]")
        self._check_token_ids(token_ids, validate)
        scores = self.counts[self.bucket_ids(token_ids)] + self._prior_pseudo_counts()
        return torch.topk(scores, self.top_k, dim=-1).indices

    def observe(
        self,
        token_ids: torch.Tensor | None,
        topk_ids: torch.Tensor,
        hidden: torch.Tensor | None = None,
        *,
        validate: bool = True,
    ) -> None:
        """Adds one count per (token, layer, routed expert) to the token's bucket.

        Args:
            token_ids: int32 or int64, shape ``[T]``: verified token ids (>= 0).
            topk_ids: int32 or int64, shape ``[T, L, K]``: the target's expert ids.
            hidden: ignored.
            validate: check token ids >= 0 and expert ids in [0, E) (host syncs on GPU;
                pass False inside CUDA graphs).
        """
        if token_ids is None:
            raise ValueError("OnlineExpertPredictor learns per token id: pass token_ids [T]")
        num_tokens = self._check_token_ids(token_ids, validate)
        self._check_topk_ids(topk_ids, num_tokens, validate)
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
            "format": _STATE_FORMAT,
            "version": _STATE_VERSION,
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
        _check_state_header(state, source)
        diffs = _config_diffs(state["config"], self.config())
        if diffs:
            raise ValueError(
                f"{source} was saved by a predictor with a different config ({diffs}); load "
                f"it with OnlineExpertPredictor.load(path) to get its own config, or start a "
                f"fresh predictor for this model"
            )
        self.counts.copy_(state["counts"])
        self.prior.copy_(state["prior"])
        self.observe_calls = int(state["observe_calls"])

    def save(self, path: str | os.PathLike) -> None:
        """Writes :meth:`state_dict` to ``path`` with ``torch.save``."""
        torch.save(self.state_dict(), path)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        num_layers: int | None = None,
        num_experts: int | None = None,
        top_k: int | None = None,
    ) -> "OnlineExpertPredictor":
        """Builds a predictor from a file written by :meth:`save` (warm start).

        Args:
            path: the file.
            device: where the tables go.
            num_layers, num_experts, top_k: the target model being served; when given,
                they must match the file's config, so a table learnt on another model is
                never used silently.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not a predictor state or does not fit the model.
        """
        shape = {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k}
        return cls._from_state(_torch_load(path), _source(path), device=device, **shape)

    @classmethod
    def _from_state(cls, state, source: str, *, device, **expected) -> "OnlineExpertPredictor":
        _check_state(state, source, _STATE_FORMAT, expected)
        predictor = cls(**state["config"], device=device)
        predictor.load_state_dict(state, source=source)
        return predictor


def _check_state_header(state, source: str, fmt: str = _STATE_FORMAT) -> None:
    kind = fmt.rsplit(".", 1)[-1]
    if not isinstance(state, dict) or state.get("format") != fmt:
        raise ValueError(f"{source} is not a saved {kind} (write one with {kind}.save)")
    if state.get("version") != _STATE_VERSION:
        raise ValueError(
            f"{source} has format version {state.get('version')}, this code reads version "
            f"{_STATE_VERSION}: re-create it with this version of sgl_ecospec"
        )


def _source(path: str | os.PathLike) -> str:
    return f"predictor file {os.fspath(path)!r}"


def _check_state(state, source: str, fmt: str, expected: dict) -> None:
    """ValueError unless ``state`` is a saved predictor of format ``fmt`` whose config
    matches the non-None entries of ``expected``."""
    _check_state_header(state, source, fmt)
    wanted = {key: value for key, value in expected.items() if value is not None}
    diffs = _config_diffs(state["config"], wanted)
    if diffs:
        raise ValueError(
            f"{source} was learnt for a different model ({diffs}); delete it or point to "
            f"the file saved for this model, or start a fresh predictor"
        )


def _torch_load(path: str | os.PathLike):
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"no expert predictor file at {os.fspath(path)!r}: check the path, or write one "
            f"(OnlineExpertPredictor.save, LowRankExpertHead.save, or the CLI's "
            f"`sgl-ecospec bench --save-predictor` / `sgl-ecospec train-head`)"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises several types for a foreign file
        raise ValueError(
            f"{os.fspath(path)!r} is not a predictor file torch can read: {error}"
        ) from None


def _config_diffs(saved: dict, wanted: dict) -> str:
    return ", ".join(
        f"{key}: saved {saved.get(key)!r}, expected {value!r}"
        for key, value in wanted.items()
        if saved.get(key) != value
    )


class LowRankExpertHead(torch.nn.Module, ExpertPredictor):
    """Per-layer expert logits from a candidate's context (drafter hidden state) and token.

    ``z = down(rms_normalise(hidden)) + token_embedding[bucket(token)]`` (width ``rank``),
    then ``logits = up(silu(z))`` read as ``[T, L, E]``. ``hidden`` is the drafter state that
    proposed the candidate, so siblings share it: the token term is what tells them apart
    (early MoE layers route mostly by token), the hidden term what tells apart one token in
    different contexts (which a count table per token cannot). The bottleneck keeps the head
    small (``rank * (H + buckets + L * E)`` weights) and shares what it learns across layers.

    Args:
        hidden_size: H.
        num_layers: L.
        num_experts: E.
        top_k: K.
        rank: bottleneck width.
        token_buckets: rows of the hashed token embedding (the same hash as
            :class:`OnlineExpertPredictor`); 0 = no token term (hidden states only, and
            token ids become optional).
        lr: Adam learning rate of the online steps :meth:`observe` takes; 0 = frozen (the
            head predicts only; ``observe`` checks its inputs and changes nothing).
    """

    needs_hidden = True

    def __init__(
        self,
        hidden_size: int,
        num_layers: int,
        num_experts: int,
        top_k: int,
        *,
        rank: int = 64,
        token_buckets: int = 4096,
        lr: float = 1e-3,
    ):
        # nn.Module.__init__ does not chain to the other base, so both run explicitly.
        torch.nn.Module.__init__(self)
        ExpertPredictor.__init__(self, num_layers, num_experts, top_k)
        self.hidden_size = check_int("hidden_size", hidden_size, minimum=1)
        self.rank = check_int("rank", rank, minimum=1)
        self.token_buckets = _check_buckets("token_buckets", token_buckets, minimum=0)
        if isinstance(lr, bool) or not (isinstance(lr, int | float) and lr >= 0):
            raise ValueError(f"lr must be a number >= 0, got {lr!r}")
        self.lr = float(lr)
        self.down = torch.nn.Linear(hidden_size, rank, bias=False)
        self.token_embedding = torch.nn.Embedding(token_buckets, rank) if token_buckets else None
        self.up = torch.nn.Linear(rank, num_layers * num_experts)
        self._optimizer: torch.optim.Optimizer | None = None

    def config(self) -> dict:
        """The constructor arguments that fix the parameter shapes."""
        return {
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "rank": self.rank,
            "token_buckets": self.token_buckets,
        }

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Expert logits.

        Args:
            hidden: float, shape ``[T, H]``.
            token_ids: int32 or int64, shape ``[T]``; required when ``token_buckets > 0``.

        Returns:
            shape ``[T, L, E]``, in the head's parameter dtype.
        """
        self._check_inputs(token_ids, hidden, validate=False)
        return self._logits(hidden, token_ids)

    def _logits(self, hidden: torch.Tensor, token_ids: torch.Tensor | None) -> torch.Tensor:
        # forward without the input checks, for callers that made them once already.
        weight = self.up.weight
        hidden = hidden.to(weight.device, weight.dtype)
        # Draft states are pre-norm residual streams (norms in the hundreds on the testbed):
        # RMS-normalised, they train at ordinary learning rates.
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + _RMS_EPS)
        z = self.down(hidden)
        if self.token_embedding is not None:
            buckets = hash_buckets(token_ids, self.token_buckets, weight.device)
            z = z + self.token_embedding(buckets)
        logits = self.up(torch.nn.functional.silu(z))
        return logits.view(-1, self.num_layers, self.num_experts)

    def predict_topk(
        self,
        token_ids: torch.Tensor | None,
        hidden: torch.Tensor | None = None,
        *,
        validate: bool = False,
    ) -> torch.Tensor:
        """Top-K experts per layer by logit.

        Args:
            token_ids: int32 or int64, shape ``[T]`` (None only without a token term).
            hidden: float, shape ``[T, H]``: drafter hidden states (required).
            validate: check token ids are >= 0 (a host sync on GPU).

        Returns:
            int64, shape ``[T, L, K]``, highest logit first.
        """
        self._check_inputs(token_ids, hidden, validate)
        with torch.no_grad():
            return torch.topk(self._logits(hidden, token_ids), self.top_k, dim=-1).indices

    def observe(
        self,
        token_ids: torch.Tensor | None,
        topk_ids: torch.Tensor,
        hidden: torch.Tensor | None = None,
        *,
        validate: bool = True,
    ) -> None:
        """One Adam step (lr = ``self.lr``) of BCE-with-logits against the true routing;
        nothing when the head is frozen (lr 0).

        Args:
            token_ids: int32 or int64, shape ``[T]`` (None only without a token term).
            topk_ids: int32 or int64, shape ``[T, L, K]``: the target's expert ids.
            hidden: float, shape ``[T, H]``: drafter hidden states (required).
            validate: check token ids >= 0 and expert ids in [0, E) (host syncs on GPU).
        """
        num_tokens = self._check_inputs(token_ids, hidden, validate)
        self._check_topk_ids(topk_ids, num_tokens, validate)
        if self.lr == 0:
            return
        if self._optimizer is None:
            self._optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        # The serving loop usually runs under inference mode, whose tensors cannot be saved
        # for backward: leave it and train on ordinary copies.
        with torch.inference_mode(False), torch.enable_grad():
            tokens = None if token_ids is None else token_ids.clone()
            loss = _bce_loss(self, hidden.clone(), tokens, topk_ids.clone())
            self._optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self._optimizer.step()

    def save(self, path: str | os.PathLike) -> None:
        """Writes config, format version and weights (CPU tensors) with ``torch.save``."""
        weights = {name: value.detach().cpu() for name, value in self.state_dict().items()}
        torch.save(
            {
                "format": _HEAD_FORMAT,
                "version": _STATE_VERSION,
                "config": self.config(),
                "weights": weights,
            },
            path,
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        device: str | torch.device = "cpu",
        lr: float = 0.0,
        num_layers: int | None = None,
        num_experts: int | None = None,
        top_k: int | None = None,
        hidden_size: int | None = None,
    ) -> "LowRankExpertHead":
        """Builds a head from a file written by :meth:`save`.

        Args:
            path: the file.
            device: where the weights go.
            lr: the loaded head's online learning rate (default 0: frozen, as trained).
            num_layers, num_experts, top_k, hidden_size: the served target and drafter; when
                given they must match the file's config.

        Raises:
            FileNotFoundError: no file at ``path``.
            ValueError: the file is not a head or does not fit the model.
        """
        expected = {
            "num_layers": num_layers,
            "num_experts": num_experts,
            "top_k": top_k,
            "hidden_size": hidden_size,
        }
        return cls._from_state(_torch_load(path), _source(path), device=device, lr=lr, **expected)

    @classmethod
    def _from_state(cls, state, source: str, *, device, lr: float, **expected):
        _check_state(state, source, _HEAD_FORMAT, expected)
        head = cls(**state["config"], lr=lr)
        try:
            head.load_state_dict(state["weights"])
        except (KeyError, RuntimeError) as error:
            raise ValueError(f"{source} has weights that do not fit its config: {error}") from None
        return head.to(device).eval()

    def _check_hidden(self, hidden) -> None:
        if hidden is None:
            raise ValueError(
                "LowRankExpertHead predicts from the drafter hidden state: pass hidden "
                f"[T, {self.hidden_size}]"
            )
        check_tensor("hidden", hidden, ndim=2, dtypes=_FLOAT_DTYPES)
        if hidden.shape[1] != self.hidden_size:
            raise ValueError(
                f"hidden must have shape [T, {self.hidden_size}] (the head's hidden_size), got "
                f"{tuple(hidden.shape)}"
            )

    def _check_inputs(self, token_ids, hidden, validate: bool) -> int:
        self._check_hidden(hidden)
        if token_ids is None:
            if self.token_buckets:
                raise ValueError(
                    "this LowRankExpertHead has a token term (token_buckets="
                    f"{self.token_buckets}): pass token_ids [T] with the hidden states"
                )
        else:
            self._check_token_ids(token_ids, validate, num_tokens=hidden.shape[0])
        return hidden.shape[0]


def _bce_loss(head: LowRankExpertHead, hidden, token_ids, topk_ids: torch.Tensor):
    logits = head._logits(hidden, token_ids)  # inputs checked by the callers
    target = multi_hot(topk_ids.to(logits.device), head.num_experts, validate=False)
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, target.to(logits.dtype))


def load_predictor(
    path: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    num_layers: int | None = None,
    num_experts: int | None = None,
    top_k: int | None = None,
    hidden_size: int | None = None,
) -> ExpertPredictor:
    """A predictor saved by :meth:`OnlineExpertPredictor.save` or
    :meth:`LowRankExpertHead.save` (a head loads frozen), whichever the file holds.

    Args: as the two ``load`` methods; ``hidden_size`` is checked for a head only.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file is neither kind or does not fit the model.
    """
    state, source = _torch_load(path), _source(path)
    shape = {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k}
    if isinstance(state, dict) and state.get("format") == _HEAD_FORMAT:
        return LowRankExpertHead._from_state(
            state, source, device=device, lr=0.0, hidden_size=hidden_size, **shape
        )
    return OnlineExpertPredictor._from_state(state, source, device=device, **shape)


def train_expert_head(
    head: LowRankExpertHead,
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    token_ids: torch.Tensor | None = None,
    *,
    epochs: int = 5,
    batch_size: int = 32,
    lr: float = 3e-3,
    val_fraction: float = 0.1,
    holdout: str = "random",
    seed: int = 0,
    init_bias: bool = True,
    progress: bool = True,
) -> list[dict]:
    """Trains ``head`` offline on recorded (hidden state, token, routing) triples.

    A random ``val_fraction`` of the tokens is held out; each epoch shuffles the rest,
    takes Adam steps of BCE-with-logits against multi-hot targets, then measures top-K
    recall on the held-out tokens.

    Args:
        head: the head to train (in place).
        hidden: float, shape ``[T, H]``: drafter hidden states.
        topk_ids: int32 or int64, shape ``[T, L, K]``: the target's expert ids per token.
        token_ids: int32 or int64, shape ``[T]``; required when the head has a token term.
        epochs: passes over the training tokens (>= 1).
        batch_size: tokens per step (>= 1).
        lr: Adam learning rate.
        val_fraction: share of tokens held out, in [0, 1).
        holdout: "random" (a random share) or "last" (the last tokens: with triples
            recorded in decoding order, whole later prompts, unseen contexts).
        seed: fixes the split and the shuffling.
        init_bias: first set the output bias to the logit of each (layer, expert)'s rate in
            the training routing (for a fresh head; False keeps a trained head's bias).
        progress: print one line per epoch.

    Returns:
        One dict per epoch: ``epoch`` (1-based), ``train_loss`` (mean over the epoch's
        tokens) and ``val_recall`` (:func:`topk_recall`; NaN when nothing is held out).
    """
    if not isinstance(head, LowRankExpertHead):
        raise TypeError(f"head must be a LowRankExpertHead, got {type(head).__name__}")
    num_tokens = head._check_inputs(token_ids, hidden, validate=True)
    head._check_topk_ids(topk_ids, num_tokens, validate=True)
    check_int("epochs", epochs, minimum=1)
    check_int("batch_size", batch_size, minimum=1)
    check_int("seed", seed, minimum=0)
    if not (isinstance(lr, int | float) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    if not (isinstance(val_fraction, int | float) and 0 <= val_fraction < 1):
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")
    if holdout not in ("random", "last"):
        raise ValueError(f"holdout must be 'random' or 'last', got {holdout!r}")
    num_val = int(num_tokens * val_fraction)
    if num_tokens - num_val < 1:
        raise ValueError(
            f"no training tokens left: {num_tokens} tokens with val_fraction={val_fraction}"
        )

    def tokens(index):
        return None if token_ids is None else token_ids[index]

    generator = torch.Generator().manual_seed(seed)
    if holdout == "last":
        order = torch.arange(num_tokens)
        train_idx, val_idx = order[: num_tokens - num_val], order[num_tokens - num_val :]
    else:
        order = torch.randperm(num_tokens, generator=generator)
        val_idx, train_idx = order[:num_val], order[num_val:]
    # Start every (layer, expert) logit at the training routing's base rate, so the steps go
    # to what distinguishes tokens and contexts rather than to the marginal.
    if init_bias:
        rate = multi_hot(topk_ids[train_idx], head.num_experts, validate=False).mean(0)  # [L, E]
        with torch.no_grad():
            head.up.bias.copy_(torch.logit(rate.clamp(1e-4, 1 - 1e-4)).flatten())
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    history = []
    for epoch in range(1, epochs + 1):
        head.train()
        shuffled = train_idx[torch.randperm(train_idx.numel(), generator=generator)]
        loss_sum = torch.zeros((), dtype=torch.float64, device=head.up.weight.device)
        for start in range(0, shuffled.numel(), batch_size):
            batch = shuffled[start : start + batch_size]
            loss = _bce_loss(head, hidden[batch], tokens(batch), topk_ids[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            # Summed on the device and read once per epoch, not synced once per step.
            loss_sum += loss.detach().double() * batch.numel()
        head.eval()
        val_recall = (
            head.recall(tokens(val_idx), topk_ids[val_idx], hidden[val_idx])
            if num_val
            else float("nan")
        )
        record = {
            "epoch": epoch,
            "train_loss": float(loss_sum) / train_idx.numel(),
            "val_recall": val_recall,
        }
        history.append(record)
        if progress:
            print(
                f"epoch {epoch}/{epochs}: train loss {record['train_loss']:.4f}, "
                f"val recall {val_recall:.3f}",
                flush=True,
            )
    return history
