"""The expert predictor an ECOSPEC server runs: built from the settings (:func:`build_predictor`)
and, for the predictors that read context, the token verified before each request's root
(:class:`RootContext`).

``vocab`` and ``context`` (:class:`sgl_ecospec.predictors.ContextExpertPredictor`, built by
the library's catalog) give every token of the target's vocabulary its own row and read each
row's parent token. The selector builds the candidates' parents from the draft tree (a child
of the root has the root, the bonus token, as its parent); the root's own parent, the token
verified before it, is known only from the previous step's accepted path, which SGLang does
not keep. :class:`RootContext` keeps it per request-pool slot (``req_pool_indices``: a
request keeps its slot while it lives, whatever the batch order), written after each verify
from SGLang's ``accept_index``/``accept_lens`` and read before the next draft step, on the
device (no host sync). A prefill forgets its requests' slots (-1: unknown, the predictor backs
off to the token), so a reused slot never lends a finished request's token.

Shape legend: B = requests, D = verify rows per request, P = request-pool slots.
"""

import torch

from sgl_ecospec.predictors import (
    AdjacentExpertPredictor,
    ContextExpertPredictor,
    ExpertPredictor,
    LowRankExpertHead,
    OnlineExpertPredictor,
    make_predictor,
)
from sglang_ecospec import routing
from sglang_ecospec.settings import VOCAB_PREDICTORS, EcoSpecSettings


def vocab_size(hf_config) -> int:
    """The target's vocabulary size (its token ids lie below it)."""
    return int(routing.text_config(hf_config).vocab_size)


def build_predictor(settings: EcoSpecSettings, hf_config, device) -> ExpertPredictor:
    """The predictor of ``settings`` for the served model (``hf_config``), on ``device``.

    Raises:
        ValueError: a ``predictor_file`` that does not fit the served model.
    """
    layer_ids, num_experts, top_k = routing.moe_layout(hf_config)
    shape = {"num_layers": len(layer_ids), "num_experts": num_experts, "top_k": top_k}
    if settings.predictor == "head":
        # The draft reads the target's token embeddings: its hidden size is the target's.
        return LowRankExpertHead.load(
            settings.predictor_file,
            device=device,
            hidden_size=routing.text_config(hf_config).hidden_size,
            **shape,
        )
    if settings.predictor in VOCAB_PREDICTORS:
        vocab = vocab_size(hf_config)
        if not settings.predictor_file:
            return make_predictor(
                settings.predictor, *shape.values(), vocab_size=vocab, device=device
            )
        adjacent = settings.predictor == "adjacent"
        kind = AdjacentExpertPredictor if adjacent else ContextExpertPredictor
        predictor = kind.load(settings.predictor_file, device=device, **shape)
        check_vocab_file(settings, predictor, vocab)
        return predictor
    if settings.predictor_file:
        return OnlineExpertPredictor.load(settings.predictor_file, device=device, **shape)
    return OnlineExpertPredictor(
        *shape.values(),
        num_buckets=settings.num_buckets,
        prior_weight=settings.prior_weight,
        halve_every=settings.halve_every,
        device=device,
    )


def check_vocab_file(settings: EcoSpecSettings, predictor: ContextExpertPredictor, vocab: int):
    """A saved ``vocab``/``context`` table must be the kind the settings name, with a row per
    token of the served vocabulary (a hashed or smaller table would mix tokens silently)."""
    source = f"predictor_file {settings.predictor_file!r}"
    if predictor.vocab_size != vocab:
        raise ValueError(
            f"{source} has vocab_size {predictor.vocab_size}, the served model {vocab}: save "
            "the table from a predictor built for this target's vocabulary"
        )
    kind = "context" if predictor.pair_buckets else "vocab"
    if isinstance(predictor, AdjacentExpertPredictor):
        kind = "adjacent"
    if kind != settings.predictor:
        raise ValueError(
            f"{source} holds a {kind!r} table ({predictor.pair_buckets} pair slots); serve it "
            f"with predictor {kind!r}"
        )


class RootContext:
    """The token verified before each request's root (bonus) token, per request-pool slot.

    Args:
        slots: P, rows of SGLang's request pool (``req_to_token``); a larger slot index is
            clamped to the last row (it then shares that row: predictions back off, output
            is unaffected).
        device: where the tokens live.

    Attributes:
        tokens: int64 ``[P]``: each slot's token, -1 unknown.
    """

    def __init__(self, slots: int, device):
        self.tokens = torch.full((slots,), -1, dtype=torch.int64, device=device)

    def _slots(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        # SGLang keeps the slots on the device; a host copy must not wait for the stream.
        index = req_pool_indices.to(self.tokens.device, torch.int64, non_blocking=True)
        return index.clamp(0, self.tokens.shape[0] - 1)

    def forget(self, req_pool_indices: torch.Tensor) -> None:
        """Marks these slots unknown (a prefill: the requests' first decode step follows).

        Args:
            req_pool_indices: int ``[B]``.
        """
        self.tokens.index_fill_(0, self._slots(req_pool_indices), -1)

    def lookup(self, req_pool_indices: torch.Tensor) -> torch.Tensor:
        """int64 ``[B]``: the token before each request's root (``req_pool_indices`` int
        ``[B]``, the decode batch's order), -1 unknown."""
        return self.tokens[self._slots(req_pool_indices)]

    def after_verify(
        self,
        draft_tokens: torch.Tensor,
        accept_index: torch.Tensor,
        accept_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
    ) -> None:
        """Records, per request, the last accepted verify row's token: the new bonus token
        follows it (the root itself when no draft was accepted).

        Args:
            draft_tokens: int ``[B * D]``: the verify rows (``EagleVerifyInput.draft_token``).
            accept_index: int ``[B, S + 1]``: each request's accepted path as flat rows of
                ``draft_tokens``, root first, -1 padding (SGLang's ``accept_index``).
            accept_lens: int ``[B]``: accepted rows per request, root included (>= 1).
            req_pool_indices: int ``[B]``: the requests' pool slots.
        """
        last = (accept_lens.to(accept_index.device, torch.int64) - 1).clamp_min(0)
        row = accept_index.gather(1, last[:, None])[:, 0].long().clamp_min(0)  # [B]
        before = draft_tokens.flatten()[row.to(draft_tokens.device)]
        self.tokens[self._slots(req_pool_indices)] = before.to(self.tokens)
