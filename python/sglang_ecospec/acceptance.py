"""Calibrated acceptance in the server: the library's :class:`AcceptanceCalibrator`
(``sgl_ecospec.acceptance``, docs/selection.md) in the draft step's selection, learning from
every verify result, and the forecast acceptance length it makes.

With the setting ``calibrated_acceptance`` (default on) the runtime builds one
:class:`AcceptanceTracker` and hands it to the selector; in the draft step
(``selection.EcoSpecSelector.organize``):

- :meth:`AcceptanceTracker.calibrate` maps the tree's cumulative draft probabilities to
  calibrated acceptance probabilities, which ``select_step`` weighs in their place as the
  ``P`` of P / (DeltaCost + eps) (policy "ecospec"; "confidence" keeps SGLang's ranking, the
  A/B arm that reproduces EAGLE3's verify sets, and only forecasts);
- :meth:`AcceptanceTracker.record` keeps the tree (raw scores, parents), the verify set and
  each request's forecast (the verify set's expected accepted drafts under the calibrated
  probabilities) in persistent buffers, as the selector keeps the verify rows' predictions.

After SGLang's verify, :meth:`AcceptanceTracker.after_verify` reads its ``accept_index``
(``GenerationBatchResult.accept_index``: per request the accepted path's flat verify rows
``b * D + r``, root first, -1 padding), adds the step's forecast and measured acceptance
lengths to device totals (read by ``routing.StatsWindow``: the "EcoSpec:" line, SGLang's
decode log line, /metrics) and only then lets the calibrator learn, so every forecast is made
before its own step's result is known.

Why on by default: it is lossless (verification is unchanged; only which nodes are verified
can change), a cold calibrator returns the draft's own probabilities (up to rounding), so a
fresh server starts with EAGLE's ranking, and calibrated P never rises along a path (the
selection stays ancestor-closed). Its cost: about 30 small kernels in the draft step (inside
the draft CUDA graph) and about 60 small eager ones after each verify (the library's
``observe`` is 49 of them at 2 draft steps), no host sync, and O(max_batch x candidates)
bytes of buffers (:func:`buffer_bytes`): tenths of a millisecond of launches per step, next
to a MoE verify forward of tens of milliseconds (not yet timed on a GPU). In exchange the P
that eps is weighed against is an acceptance probability (an earlier testbed draft promised
about 4x the tokens it delivered, issue 15; with the shipped draft the two agree within a
few percent and selection barely changes, docs/RESULTS.md) and the forecast shows how far
the draft's promise is off. ``SGLANG_ECOSPEC_CALIBRATED_ACCEPTANCE=0`` turns it off.

Tensor parallelism: the calibrator shapes only this rank's own choice, which rank 0's
broadcast selection replaces (:mod:`sglang_ecospec.tp_agreement`), so no calibrator state can
make the ranks verify different trees. Every rank learns from rank 0's verify set and SGLang's
``accept_index`` (the same on every rank: computed from the same all-gathered logits, or
broadcast by SGLang's sampling path); the tables are not in the agreement checksum (float sums
of draft probabilities could differ in their last bits across ranks without consequence).

Graph safety: static shapes, ``validate=False``, persistent buffers written in place;
``calibrate`` and ``record`` trace into the draft step's one graph, and the tables are updated
in place, so a captured draft graph keeps reading the live counts.

Shape legend: B = requests, Bmax = the largest batch, N = candidates per request (K + (S-1)
K^2), D = verify rows per request (ndt), S = draft steps.
"""

import logging

import torch

from sgl_ecospec.acceptance import AcceptanceCalibrator, expected_accepted
from sglang_ecospec.deployment import num_candidates

logger = logging.getLogger(__name__)

_F32, _F64, _I64 = 4, 8, 8


def buffer_bytes(*, topk: int, num_steps: int, num_draft_tokens: int, max_batch: int) -> int:
    """Bytes of an :class:`AcceptanceTracker`'s persistent tensors (each term names its
    owner)."""
    n = num_candidates(topk, num_steps)
    return (
        2 * num_steps * AcceptanceTracker.NUM_BINS * _F32  # calibrator accepted, promised
        + max_batch * n * (_F32 + _I64)  # scores, parents
        + max_batch * (num_draft_tokens - 1) * _I64  # selected
        + max_batch * (_F64 + _I64)  # forecast, row_offsets
        + 3 * _F64  # totals
    )


class AcceptanceTracker:
    """The server's acceptance calibrator, the last draft tree it selected from, and the
    forecast-vs-measured totals.

    Args:
        topk: K, num_steps: S (``--speculative-eagle-topk``, ``--speculative-num-steps``):
            the trees calibrated; another tree shape is selected uncalibrated (warned once).
        num_draft_tokens: D (``--speculative-num-draft-tokens``).
        max_batch: Bmax, the rows of the buffers.
        device: where everything lives.

    Attributes:
        calibrator: the library's :class:`AcceptanceCalibrator` (``max_depth`` = S).
        totals: float64 ``[3]`` on the device: request-steps, expected accepted drafts (the
            forecast less the bonus token) and accepted tokens (drafts + bonus), summed over
            the verify steps learnt from; never reset (readers take differences).
    """

    NUM_BINS = 10  # the library's default: equal-width bins of the edge probability

    def __init__(self, *, topk: int, num_steps: int, num_draft_tokens: int, max_batch: int, device):
        self.topk = topk
        self.num_steps = num_steps
        self.num_draft_tokens = num_draft_tokens
        self.num_candidates = num_candidates(topk, num_steps)
        self.calibrator = AcceptanceCalibrator(num_steps, num_bins=self.NUM_BINS, device=device)
        shape = (max_batch, self.num_candidates)
        # The tree of the last selection, raw: the calibrator learns from draft probabilities.
        self.scores = torch.zeros(shape, dtype=torch.float32, device=device)  # [Bmax, N]
        self.parents = torch.full(shape, -1, dtype=torch.int64, device=device)  # [Bmax, N]
        self.selected = torch.full(
            (max_batch, num_draft_tokens - 1), -1, dtype=torch.int64, device=device
        )  # [Bmax, D-1]
        self.forecast = torch.zeros(max_batch, dtype=torch.float64, device=device)  # [Bmax]
        # b * D: SGLang's accept_index counts verify rows over the whole batch.
        self.row_offsets = torch.arange(max_batch, device=device)[:, None] * num_draft_tokens
        self.totals = torch.zeros(3, dtype=torch.float64, device=device)
        self._warned_shape = False

    @property
    def max_batch(self) -> int:
        return self.scores.shape[0]

    def fits(self, num_nodes: int) -> bool:
        """Whether a tree of ``num_nodes`` candidates is the one calibrated (warns once when
        not: that tree is selected on its draft probabilities and nothing is learnt)."""
        if num_nodes == self.num_candidates:
            return True
        if not self._warned_shape:
            logger.warning(
                "ECOSPEC: a draft tree of %d candidates, the calibrator was built for %d (topk "
                "%d, %d steps): selecting on the draft's probabilities",
                num_nodes,
                self.num_candidates,
                self.topk,
                self.num_steps,
            )
            self._warned_shape = True
        return False

    def calibrate(self, scores: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """float32 ``[B, N]``: each candidate's calibrated acceptance probability.

        Args:
            scores: float32 ``[B, N]``: cumulative draft probabilities.
            parents: int64 ``[B, N]``: parent candidate, -1 for the root's children.
        """
        return self.calibrator.calibrate(scores, parents, validate=False)

    def record(
        self,
        scores: torch.Tensor,
        parents: torch.Tensor,
        probs: torch.Tensor,
        selected: torch.Tensor,
    ) -> None:
        """Keeps the step's tree, verify set and forecast for :meth:`after_verify`.

        Args:
            scores: float32 ``[B, N]``: the raw cumulative draft probabilities.
            parents: int64 ``[B, N]``.
            probs: float32 ``[B, N]``: the calibrated probabilities (:meth:`calibrate`).
            selected: int ``[B, D-1]``: the verify set actually verified (rank 0's under TP),
                -1 padding; B <= Bmax.
        """
        batch = scores.shape[0]
        self.scores[:batch].copy_(scores)
        self.parents[:batch].copy_(parents)
        self.selected[:batch].copy_(selected)
        self.forecast[:batch].copy_(expected_accepted(probs, selected))

    def after_verify(self, accept_index: torch.Tensor) -> None:
        """Adds the step's forecast and measured acceptance to :attr:`totals`, then learns.

        Args:
            accept_index: int32 or int64 ``[B, S+1]``: SGLang's accepted verify rows, flat
                over the batch (``b * D + r``, r = 0 the root), -1 padding; B <= Bmax, the
                requests of the tree last recorded.
        """
        batch = accept_index.shape[0]
        accepted = accept_index >= 0  # [B, S+1]
        rows = torch.where(accepted, accept_index - self.row_offsets[:batch], -1)
        counts = torch.stack((self.forecast[:batch].sum(), accepted.sum().double()))
        self.totals[0].add_(batch)
        self.totals[1:].add_(counts)
        # After the forecast: the step is learnt only once it has been predicted.
        self.calibrator.observe(
            self.scores[:batch],
            self.parents[:batch],
            self.selected[:batch],
            rows,
            validate=False,
        )

    def accepts(self, accept_index, num_tokens: int) -> bool:
        """Whether ``accept_index`` (SGLang's, or None) of a verify pass over ``num_tokens``
        tokens belongs to a tree this tracker recorded: ``[B, S+1]`` with 1 <= B <= Bmax,
        this tracker's S, and B * D verify tokens (shapes only, no host sync)."""
        if not isinstance(accept_index, torch.Tensor) or accept_index.dim() != 2:
            return False
        batch, width = accept_index.shape
        return (
            0 < batch <= self.max_batch
            and width == self.num_steps + 1
            and num_tokens == batch * self.num_draft_tokens
        )


def window_summary(before: list[float], now: list[float]) -> dict:
    """The summary fields of a statistics window from two host copies of
    :attr:`AcceptanceTracker.totals`: ``accept_length`` (measured: accepted drafts + bonus per
    request-step) and ``forecast_accept_length`` (1 + the verified nodes' calibrated
    probabilities, each made before its step was learnt), over the window's request-steps;
    empty when none was learnt (e.g. every step decoded plainly by the gate)."""
    requests, expected, accepted = (a - b for a, b in zip(now, before, strict=True))
    if requests <= 0:
        return {}
    return {
        "accept_length": accepted / requests,
        "forecast_accept_length": 1.0 + expected / requests,
    }


def log_fields(summary: dict) -> str:
    """What the "EcoSpec:" line appends for calibrated acceptance (leading ", "; empty when
    the window has no forecast)."""
    if "forecast_accept_length" not in summary:
        return ""
    return (
        f", acceptance length {summary['accept_length']:.3f} "
        f"(forecast {summary['forecast_accept_length']:.3f})"
    )


def draft_step_bytes(*, batch: int, topk: int, num_steps: int, num_draft_tokens: int) -> int:
    """An upper bound of what calibrated acceptance adds to the draft step's temporaries for
    ``batch`` requests: :meth:`AcceptanceTracker.calibrate`'s (about a dozen ``[B, N]``
    int64/float tensors, measured 49 bytes per node) with its result kept through the
    selection, then :meth:`AcceptanceTracker.record`'s forecast (float64 ``[B, N]``)."""
    n = num_candidates(topk, num_steps)
    ratios = 3 * num_steps * AcceptanceTracker.NUM_BINS * _F32
    forecast = batch * n * _F64 + 3 * batch * (num_draft_tokens - 1) * _I64
    return batch * n * 52 + ratios + forecast


def after_verify_bytes(*, batch: int, topk: int, num_steps: int) -> int:
    """An upper bound of :meth:`AcceptanceTracker.after_verify`'s temporaries for ``batch``
    requests (the calibrator's ``observe``: masks, edges and cells of the tree, measured 52
    bytes per node, and the accepted rows)."""
    n = num_candidates(topk, num_steps)
    ratios = 3 * num_steps * AcceptanceTracker.NUM_BINS * _F32
    return batch * n * 56 + 5 * batch * (num_steps + 1) * _I64 + ratios


def step_bytes(*, batch: int, topk: int, num_steps: int, num_draft_tokens: int) -> int:
    """Both parts: what calibrated acceptance adds to the per-step temporaries."""
    tree = {"batch": batch, "topk": topk, "num_steps": num_steps}
    return draft_step_bytes(num_draft_tokens=num_draft_tokens, **tree) + after_verify_bytes(**tree)
