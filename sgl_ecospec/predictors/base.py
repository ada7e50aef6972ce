"""The expert predictor interface and the measures every predictor shares.

Shape legend: T = tokens, L = MoE layers, E = experts per layer, K = experts per token
(top-K), H = drafter hidden size, W = ceil(E / 64) int64 words per layer bitmap.
"""

import abc

import torch

from sgl_ecospec.ops.bitmaps import bitmap_popcount, check_expert_ids, topk_to_bitmap
from sgl_ecospec.ops.checks import INDEX_DTYPES, check_int, check_shape, check_tensor


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
        needs_context: whether :meth:`predict_topk` and :meth:`observe` also take
            ``context_tokens``, int ``[T]``: each row's parent token (a draft candidate's
            parent in the draft tree; for the root, the last verified token before it), -1
            where unknown. Callers pass the keyword only to such predictors, so the others
            keep the signatures below.
        live_recall: the predictor's measured recall
            (:class:`sgl_ecospec.predictors.live_recall.LiveRecall`), attached by whoever
            measures it (``LiveRecall.of``), or None.
    """

    needs_hidden = False
    needs_context = False
    live_recall = None

    def __init__(self, num_layers: int, num_experts: int, top_k: int):
        self.num_layers = check_int("num_layers", num_layers, minimum=1)
        self.num_experts = check_int("num_experts", num_experts, minimum=1)
        self.top_k = check_int("top_k", top_k, minimum=1)
        if top_k > num_experts:
            raise ValueError(f"top_k must be <= num_experts={num_experts}, got {top_k}")

    def _shape_config(self) -> dict:
        """The constructor arguments every predictor takes (L, E, K), for the ``config`` of
        the predictors that save their state."""
        return {"num_layers": self.num_layers, "num_experts": self.num_experts, "top_k": self.top_k}

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


class CheckedExpertPredictor(ExpertPredictor):
    """An :class:`ExpertPredictor` whose :meth:`predict_topk` and :meth:`observe` check their
    inputs here, once for every subclass, and hand the checked inputs to :meth:`_predict`
    and :meth:`_learn`; a subclass says what it requires in :meth:`_check_inputs`.

    The public methods keep the signatures and docstrings of :class:`ExpertPredictor`, so
    subclasses restate neither.
    """

    def predict_topk(self, token_ids, hidden=None, *, validate=False) -> torch.Tensor:
        self._check_inputs(token_ids, hidden, validate)
        return self._predict(token_ids, hidden)

    def observe(self, token_ids, topk_ids, hidden=None, *, validate=True) -> None:
        num_tokens = self._check_inputs(token_ids, hidden, validate, observing=True)
        self._check_topk_ids(topk_ids, num_tokens, validate)
        self._learn(token_ids, topk_ids, hidden)

    @abc.abstractmethod
    def _check_inputs(self, token_ids, hidden, validate: bool, *, observing=False) -> int:
        """Raises unless ``token_ids`` / ``hidden`` are what this predictor reads; returns T.

        ``observing`` is True for :meth:`observe` (error messages may say what is learnt).
        """

    @abc.abstractmethod
    def _predict(self, token_ids, hidden) -> torch.Tensor:
        """:meth:`predict_topk` on checked inputs."""

    @abc.abstractmethod
    def _learn(self, token_ids, topk_ids: torch.Tensor, hidden) -> None:
        """:meth:`observe` on checked inputs."""
