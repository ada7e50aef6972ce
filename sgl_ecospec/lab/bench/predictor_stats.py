"""What ``bench`` reports of the expert predictor besides its recall: the recall per MoE
layer and the prediction time per verify step."""

import time

import torch

from sgl_ecospec.predictors import ExpertPredictor


class TimedPredictor(ExpertPredictor):
    """``inner`` with every ``predict_topk`` call timed (the engine makes one per verify
    step, over every request's root and candidates). Other attributes are ``inner``'s
    (``save``, ``hidden_size``, ...); the engine attaches the live recall to this wrapper.

    On a GPU each timed call synchronises the device before and after (benchmarking only).
    """

    def __init__(self, inner: ExpertPredictor):
        super().__init__(inner.num_layers, inner.num_experts, inner.top_k)
        self.inner = inner
        self.needs_hidden = inner.needs_hidden
        self.needs_context = inner.needs_context
        self.seconds = 0.0
        self.calls = 0

    def __getattr__(self, name):
        # Only reached for attributes this wrapper lacks.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def predict_topk(self, token_ids, hidden=None, *, validate=False, **context):
        """``inner.predict_topk``, timed."""
        on_gpu = token_ids is not None and token_ids.is_cuda
        if on_gpu:
            torch.cuda.synchronize(token_ids.device)
        started = time.perf_counter()
        out = self.inner.predict_topk(token_ids, hidden, validate=validate, **context)
        if on_gpu:
            torch.cuda.synchronize(token_ids.device)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return out

    def observe(self, token_ids, topk_ids, hidden=None, *, validate=True, **context):
        """``inner.observe``."""
        self.inner.observe(token_ids, topk_ids, hidden, validate=validate, **context)


def timed(predictor):
    """``predictor`` wrapped in :class:`TimedPredictor`; the oracle (``prime``) is kept, since
    the engine primes it with each step's true routing."""
    return predictor if hasattr(predictor, "prime") else TimedPredictor(predictor)


def predictor_fields(predictor) -> dict:
    """A run's ``predict_ms_per_step`` (mean milliseconds of one prediction per verify
    step) and ``predictor_recall_per_layer`` (recall over every verified row, per MoE
    layer); None where not measured (the oracle, which is not timed)."""
    if not isinstance(predictor, TimedPredictor):
        return {"predict_ms_per_step": None, "predictor_recall_per_layer": None}
    live = predictor.live_recall
    return {
        "predict_ms_per_step": 1e3 * predictor.seconds / predictor.calls
        if predictor.calls
        else None,
        "predictor_recall_per_layer": None if live is None else live.per_layer(),
    }
