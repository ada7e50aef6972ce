"""The serving benchmark's phases priced by a calibrated cost model: predicted TPOT next to
the measured one (``bench_serving --profile FILE``, docs/costmodel.md, "Checked against
the server").

A phase at concurrency c keeps ``B = min(c, prompts)`` requests in flight. Its decode step:

- none: one target forward of B tokens, ``ar_time(B, U)``;
- speculative (eagle3, ecospec-confidence, ecospec): ``num_steps`` draft forwards (SGLang's
  EAGLE worker runs ``num_steps - 1`` in the draft loop and one draft extend after the
  verify), the verify of ``B x num_draft_tokens`` tokens and the accept step, divided by
  the measured acceptance length (tokens per request per step).
- ECOSPEC with its utility gate mixes levels: plain steps of one token, steps of the
  configured tree and, with ``gate_narrow``, narrow steps (one draft forward, a verify of two
  tokens per request). Where the phase has the gate's step counters (``gate_steps``: plain,
  narrow and tree steps), a step costs the counts' mix of the three and the phase's measured
  acceptance length a (over all its steps) divides it. Without them, a share f of the steps
  is priced as tree steps, the rest as plain ones: a = f x a_s + (1 - f), where a_s is the
  tree steps' own (EcoSpec logs it with each line of statistics), so f = (a - 1) / (a_s - 1).
  Without a_s either: a phase whose acceptance length is below ``PLAIN_BELOW`` decoded
  plainly but for the gate's few probe steps, priced as none, and any other as speculative
  throughout.

U, the distinct experts per MoE layer of a tree step, is the phase's logged
``experts_per_layer_step`` where the server logged it (ECOSPEC logs its tree steps), else
the model's uniform-routing expectation N(tokens), as for every plain and narrow step.

TPOT (``sglang.bench_serving``'s mean time per output token after the first) also holds the
prefills of requests that start while a request decodes: the server runs them between its
decode steps. Each of the ``prompts - c`` requests that start after the first wave stalls
the ``c - 1`` others for one prefill of the mean prompt length, spread over the ``prompts``
requests' ``output_len - 1`` decode intervals. The prefill is priced by the profile's
measured prefill line where it has one (:mod:`sgl_ecospec.costmodel.prefill`), else by the
model as a target forward of that many tokens on every expert (an extrapolation far past the
calibration grid's tokens).

With a plain server's measured run (``--server-step``), every step also costs what SGLang adds
to the forward at its batch size (:mod:`sgl_ecospec.lab.serving.server_step`).
"""

import sys
from typing import NamedTuple

from sgl_ecospec.costmodel.performance import PerformanceModel
from sgl_ecospec.costmodel.prefill import PrefillLine
from sgl_ecospec.lab.serving.report import format_table, read_run
from sgl_ecospec.lab.serving.server_step import ServerStep

SPECULATIVE = ("eagle3", "ecospec-confidence", "ecospec")
# Speculation on this draft accepts 1.7-1.9 tokens per step; a phase under 1.05 ran plainly
# in all but its gate's probes.
PLAIN_BELOW = 1.05


class Pricing(NamedTuple):
    """A calibration profile's fitted model, its prefill line (None: none was timed) and what
    the server adds to each step (None: not measured, the forward alone)."""

    perf: PerformanceModel
    prefill: PrefillLine | None = None
    server_step: ServerStep | None = None

    def prefill_seconds(self, prompt_tokens: float) -> float:
        """One request's prefill of ``prompt_tokens`` (module docstring)."""
        if self.prefill is not None:
            return self.prefill.predict(max(1.0, prompt_tokens))
        tokens = max(1, round(prompt_tokens))
        return float(self.perf.verify_time(1, tokens, self.perf.model.num_experts))


def speculative_share(record: dict) -> float:
    """The share of the phase's decode steps that speculated (module docstring)."""
    accept = record.get("accept_length")
    if record["algorithm"] not in SPECULATIVE or accept is None:
        return 0.0
    counts = record.get("gate_steps")
    if counts:
        return 1.0 - counts["plain"] / sum(counts.values())
    spec_accept = record.get("spec_accept_length")
    if record["algorithm"] == "ecospec" and spec_accept is not None and spec_accept > 1.0:
        return min(max((accept - 1.0) / (spec_accept - 1.0), 0.0), 1.0)
    return 1.0 if accept >= PLAIN_BELOW else 0.0


def predicted_step_seconds(record: dict, cfg: dict, perf: PerformanceModel) -> float:
    """Seconds of one decode step of the phase ``record``, its speculative and plain steps
    mixed by :func:`speculative_share` (module docstring)."""
    batch = min(record["concurrency"], cfg["num_prompts"])
    plain = float(perf.ar_time(batch))
    share = speculative_share(record)
    if share == 0.0:
        return plain

    def speculative(steps: int, tokens: int, experts: float | None) -> float:
        return float(
            steps * perf.draft_time(batch)
            + perf.verify_time(batch, tokens, experts)
            + perf.reject_time(batch)
        )

    tree = speculative(
        cfg["num_steps"], cfg["num_draft_tokens"], record.get("experts_per_layer_step")
    )
    counts = record.get("gate_steps")
    if not counts:
        return share * tree + (1.0 - share) * plain
    narrow = speculative(1, 2, None) if counts["narrow"] else 0.0
    mixed = counts["plain"] * plain + counts["narrow"] * narrow + counts["tree"] * tree
    return mixed / sum(counts.values())


def predicted_tpot_ms(record: dict, cfg: dict, pricing: Pricing) -> float | None:
    """The phase's predicted mean TPOT in ms (module docstring); None without an acceptance
    length for a speculative phase or a prompt length."""
    if record["algorithm"] in SPECULATIVE and record.get("accept_length") is None:
        return None
    prompt_len = record.get("mean_input_len")
    if prompt_len is None:
        return None
    # Plain steps make one token each (a phase priced as plain: its probes' extra tokens too).
    accept = record["accept_length"] if speculative_share(record) > 0 else 1.0
    prompts, concurrency = cfg["num_prompts"], min(record["concurrency"], cfg["num_prompts"])
    step = predicted_step_seconds(record, cfg, pricing.perf)
    if pricing.server_step is not None:
        step += pricing.server_step.at(concurrency)
    decode = step / max(accept, 1.0)
    stalls_per_request = (prompts - concurrency) * (concurrency - 1) / prompts
    prefill = pricing.prefill_seconds(prompt_len)
    tpot = decode + stalls_per_request * prefill / max(1, cfg["output_len"] - 1)
    return 1000.0 * tpot


def add_predictions(runs: list[dict], cfg: dict, pricing: Pricing) -> None:
    """Sets each record's ``predicted_tpot_ms`` and ``tpot_error`` ((predicted - measured)
    / measured; None where either is missing)."""
    for record in runs:
        predicted = predicted_tpot_ms(record, cfg, pricing)
        measured = record.get("mean_tpot_ms")
        record["predicted_tpot_ms"] = predicted
        record["tpot_error"] = (
            (predicted - measured) / measured if predicted is not None and measured else None
        )


def load_profile(path: str, server_step_run: str | None = None) -> Pricing:
    """The calibration profile's :class:`Pricing`, with what the server adds to each step
    measured from the plain server's run ``server_step_run`` (a ``bench_serving --json``
    file) where given; ValueError (a message for the operator) on a bad file."""
    from sgl_ecospec.costmodel.calibration import CalibrationFileError, CalibrationProfile

    try:
        profile = CalibrationProfile.load(path)
    except CalibrationFileError as exc:
        raise ValueError(f"--profile: {exc}") from None
    pricing = Pricing(profile.performance_model(), profile.prefill)
    if server_step_run is None:
        return pricing
    step = ServerStep.from_run(
        server_step_run, lambda record, cfg: predicted_tpot_ms(record, cfg, pricing)
    )
    return pricing._replace(server_step=step)


def predict_from(json_path: str, profile: str, server_step_run: str | None = None) -> int:
    """``bench_serving --predict-from``: an earlier run's phases priced by ``profile`` (and
    the plain server's run ``server_step_run``), the table printed; the exit status."""
    try:
        pricing = load_profile(profile, server_step_run)
        cfg, runs = read_run(json_path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"bench_serving: error: {exc}", file=sys.stderr)
        return 2
    add_predictions(runs, cfg, pricing)
    print(describe(pricing))
    print(format_table(runs))
    return 0


def describe(pricing: Pricing) -> str:
    """One line saying what the predicted column prices: the forward alone, or with what the
    server adds per step (its figures per batch size)."""
    if pricing.server_step is None:
        return "[bench_serving] pred ms: the calibrated forward (no --server-step)"
    figures = ", ".join(
        f"B={b} {1000 * s:+.1f} ms"
        for b, s in zip(pricing.server_step.batch_sizes, pricing.server_step.seconds, strict=True)
    )
    return (
        f"[bench_serving] pred ms: the calibrated forward plus the server's step measured in "
        f"{pricing.server_step.source}: {figures}"
    )
