"""The learned predictor: a low-rank head on the drafter's hidden state and the candidate
token, trained offline (:mod:`sgl_ecospec.predictors.training`) and/or online.

Shape legend: as :mod:`sgl_ecospec.predictors.base`.
"""

import os

import torch

from sgl_ecospec.ops.checks import FLOAT_DTYPES, check_int, check_tensor
from sgl_ecospec.predictors.base import CheckedExpertPredictor, multi_hot
from sgl_ecospec.predictors.online import check_buckets, hash_buckets
from sgl_ecospec.predictors.state import (
    HEAD_FORMAT,
    STATE_VERSION,
    check_state,
    state_source,
    torch_load,
)

_RMS_EPS = 1e-6


class LowRankExpertHead(torch.nn.Module, CheckedExpertPredictor):
    """Per-layer expert logits from a candidate's context (drafter hidden state) and token.

    ``z = down(rms_normalise(hidden)) + token_embedding[bucket(token)]`` (width ``rank``),
    then ``logits = up(silu(z))`` read as ``[T, L, E]``. ``hidden`` is the drafter state that
    proposed the candidate, so siblings share it: the token term is what tells them apart
    (early MoE layers route mostly by token), the hidden term what tells apart one token in
    different contexts (which a count table per token cannot). The bottleneck keeps the head
    small (``rank * (H + buckets + L * E)`` weights) and shares what it learns across layers.
    ``predict_topk`` returns the top-K experts by logit; both it and ``observe`` require
    ``hidden`` ``[T, H]``, and take ``token_ids=None`` only without a token term.

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
        CheckedExpertPredictor.__init__(self, num_layers, num_experts, top_k)
        self.hidden_size = check_int("hidden_size", hidden_size, minimum=1)
        self.rank = check_int("rank", rank, minimum=1)
        self.token_buckets = check_buckets("token_buckets", token_buckets, minimum=0)
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
            **self._shape_config(),
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

    def _predict(self, token_ids, hidden) -> torch.Tensor:
        # Top-K experts per layer by logit, highest first.
        with torch.no_grad():
            return torch.topk(self._logits(hidden, token_ids), self.top_k, dim=-1).indices

    def _learn(self, token_ids, topk_ids: torch.Tensor, hidden) -> None:
        # One Adam step (lr = self.lr) of BCE-with-logits against the true routing; nothing
        # when the head is frozen (lr 0).
        if self.lr == 0:
            return
        if self._optimizer is None:
            self._optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        # The serving loop usually runs under inference mode, whose tensors cannot be saved
        # for backward: leave it and train on ordinary copies.
        with torch.inference_mode(False), torch.enable_grad():
            tokens = None if token_ids is None else token_ids.clone()
            loss = bce_loss(self, hidden.clone(), tokens, topk_ids.clone())
            self._optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self._optimizer.step()

    def save(self, path: str | os.PathLike) -> None:
        """Writes config, format version and weights (CPU tensors) with ``torch.save``."""
        weights = {name: value.detach().cpu() for name, value in self.state_dict().items()}
        torch.save(
            {
                "format": HEAD_FORMAT,
                "version": STATE_VERSION,
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
        return cls._from_state(
            torch_load(path), state_source(path), device=device, lr=lr, **expected
        )

    @classmethod
    def _from_state(cls, state, source: str, *, device, lr: float, **expected):
        check_state(state, source, HEAD_FORMAT, expected)
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
        check_tensor("hidden", hidden, ndim=2, dtypes=FLOAT_DTYPES)
        if hidden.shape[1] != self.hidden_size:
            raise ValueError(
                f"hidden must have shape [T, {self.hidden_size}] (the head's hidden_size), got "
                f"{tuple(hidden.shape)}"
            )

    def _check_inputs(self, token_ids, hidden, validate: bool, *, observing=False) -> int:
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


def bce_loss(head: LowRankExpertHead, hidden, token_ids, topk_ids: torch.Tensor):
    logits = head._logits(hidden, token_ids)  # inputs checked by the callers
    target = multi_hot(topk_ids.to(logits.device), head.num_experts, validate=False)
    return torch.nn.functional.binary_cross_entropy_with_logits(logits, target.to(logits.dtype))
