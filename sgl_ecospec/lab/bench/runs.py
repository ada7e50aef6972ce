"""What ``bench`` and ``sweep`` share when they run: the engine, the predictor each run
starts with, the greedy reference, the check of speculative outputs against it, the
progress bar and the cost model."""

import functools
import os
import sys
import time

from sgl_ecospec.lab.bench import metrics

# Mismatches kept per run in the JSON.
MAX_MISMATCHES = 5
# Logit difference below which a divergence counts as a near tie (OutputCheck).
TIE_TOLERANCE = 0.1


class LosslessError(RuntimeError):
    """A speculative output differs from the target's greedy output."""


@functools.lru_cache(maxsize=8)
def performance_model(profile: str, hardware: str):
    """MoESD model of ``profile`` on ``hardware`` with the analytic (roofline) parameters."""
    from sgl_ecospec.costmodel import PerformanceModel, analytic_params, get_hardware, get_model

    model, hw = get_model(profile), get_hardware(hardware)
    return PerformanceModel(model, hw, analytic_params(model, hw).params)


def batches(items: list, size: int) -> list[list]:
    """``items`` in consecutive batches of ``size`` (the last one may be shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def open_engine(cfg, command: str):
    """The ``OfflineEngine`` of ``cfg``'s target and draft (``config.with_models`` names
    them), checked for what the benchmark commands need: a chat template and routing that
    leaves a choice. ``command`` names the caller in error messages."""
    for flag in ("target", "draft"):
        path = getattr(cfg, flag)
        if path is None or not os.path.isdir(path):
            raise FileNotFoundError(f"--{flag} {path!r} is not a directory")

    import torch

    from sgl_ecospec.lab.engine import OfflineEngine

    engine = OfflineEngine(
        cfg.target, cfg.draft, device=cfg.device, dtype=getattr(torch, cfg.dtype)
    )
    if engine.tokenizer is None:
        raise ValueError(
            f"{cfg.target} has no tokenizer: the {command} renders prompts with its chat template"
        )
    if engine.top_k >= engine.num_experts:
        raise ValueError(
            f"the target routes every token to all {engine.num_experts} experts: nothing to "
            "select or scale"
        )
    return engine


def run_predictor(cfg, engine):
    """The predictor a run starts with: a fresh one per run, learning over all of its
    batches, so every policy starts from the same state and sees the same prompts
    (``--predictor-file`` loaded anew, an empty online table, or the oracle, whose live
    recall, the recall-weighted cost's trust and measured cost, also learns over the whole
    run: built per batch, it started cold on every prompt at batch 1)."""
    from sgl_ecospec.lab.engine import OracleExpertPredictor
    from sgl_ecospec.predictors import ONLINE_PREDICTORS, make_predictor

    if cfg.predictor_file:
        return load_run_predictor(cfg, engine)
    shape = (engine.num_layers, engine.num_experts, engine.top_k)
    if cfg.predictor in ONLINE_PREDICTORS:
        # The hashed online table needs no vocabulary size; the others give each token a row.
        vocab = None if cfg.predictor == "online" else engine.target.config.vocab_size
        return make_predictor(cfg.predictor, *shape, vocab_size=vocab, device=cfg.device)
    return OracleExpertPredictor(*shape)  # the config allows "head" only with a file


def load_run_predictor(cfg, engine):
    """``--predictor-file`` loaded for ``engine``'s target and draft, and of the kind
    ``--predictor`` names (a head, or an online table to start from)."""
    from sgl_ecospec.predictors import (
        AdjacentExpertPredictor,
        ContextExpertPredictor,
        LowRankExpertHead,
        load_predictor,
    )

    predictor = load_predictor(
        cfg.predictor_file,
        device=cfg.device,
        num_layers=engine.num_layers,
        num_experts=engine.num_experts,
        top_k=engine.top_k,
        hidden_size=engine.draft.config.hidden_size,
    )
    if isinstance(predictor, LowRankExpertHead):
        kind, names = "a LowRankExpertHead", ("head",)
    elif isinstance(predictor, AdjacentExpertPredictor):
        kind, names = "an adjacent predictor table", ("adjacent",)
    elif isinstance(predictor, ContextExpertPredictor):
        kind, names = "a context predictor table", ("vocab", "context")
    else:
        kind, names = "an online predictor table", ("online",)
    if cfg.predictor not in names:
        raise ValueError(
            f"--predictor-file {cfg.predictor_file!r} holds {kind}; pass --predictor "
            f"{' or '.join(names)}"
        )
    return predictor


class Progress:
    """Progress on stderr, counting batches; the current run's verify steps beside them.

    On a terminal a tqdm bar. Elsewhere (a log file, a CI job) the bar is off, so a line
    goes out at most every ``interval`` seconds, on a finished batch or a verify step, and
    one when the last batch ends: a run of one large batch otherwise says nothing for many
    minutes.
    """

    def __init__(self, total: int, *, interval: float = 60.0):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="batch", file=sys.stderr, disable=None)
        self.verify_steps = 0
        self.total, self.done, self.label = total, 0, ""
        self.interval = interval
        self.started = self.logged = time.perf_counter()

    def describe(self, label: str) -> None:
        """Names the run now decoding."""
        self.label = label
        self.bar.set_description(label)

    def advance(self, batches: int = 1) -> None:
        """Counts ``batches`` more finished batches."""
        self.done += batches
        self.bar.update(batches)
        self._log(final=self.done >= self.total)

    def on_step(self, step) -> None:
        self.verify_steps += 1
        self.bar.set_postfix(verify_steps=self.verify_steps, refresh=False)
        self._log()

    def write(self, text: str, file) -> None:
        self.bar.write(text, file=file)

    def close(self) -> None:
        self.bar.close()

    def _log(self, final: bool = False) -> None:
        if not self.bar.disable:
            return  # the bar shows it; no clock read per verify step
        now = time.perf_counter()
        if not (final or now - self.logged >= self.interval):
            return
        self.logged = now
        print(
            f"progress: {self.done}/{self.total} batches, {self.label}: "
            f"{self.verify_steps} verify steps, {now - self.started:.0f} s",
            file=sys.stderr,
            flush=True,
        )


def run_greedy(engine, groups_by_name: dict, limit: int, progress: Progress):
    """Greedy outputs per name (cut at ``limit``), all greedy steps, wall seconds."""
    outputs, steps, started = {}, [], time.perf_counter()
    for name, groups in groups_by_name.items():
        progress.describe(f"greedy {name}")
        outputs[name] = []
        for group in groups:
            result = engine.generate_greedy(group, limit)
            outputs[name] += [o[:limit] for o in result.outputs]
            steps += result.steps
            progress.advance()
    return outputs, steps, time.perf_counter() - started


def _describe_mismatch(engine, prompt, position: int, expected: list, got: list) -> str:
    def text(ids):
        try:
            return repr(engine.tokenizer.decode(ids))
        except Exception:  # decoding is only a courtesy in an error message
            return "?"

    window = slice(max(0, position - 8), position + 1)
    return (
        f"{prompt.source}: first difference at generated token {position}: greedy "
        f"{expected[window]} {text(expected[window])}, speculative {got[window]} "
        f"{text(got[window])}"
    )


def _logit_gap(engine, ids: list[int], a: int, b: int) -> float:
    """|logit(a) - logit(b)| of the target after ``ids``, one sequence alone."""
    import torch

    with torch.no_grad():
        logits = engine.target.model(torch.tensor([ids], device=engine.device)).logits[0, -1]
    return abs(float(logits[a].float() - logits[b].float()))


class OutputCheck:
    """Compares one run's speculative outputs with the greedy ones (bench and sweep).

    A divergence is a *near tie* when, at the first differing token, the target's own logits
    for the two tokens (computed for the greedy prefix, one sequence alone) differ by at most
    ``TIE_TOLERANCE``: in float32 a batched forward's result depends on the batch around it,
    and with MoE routing a router near-tie can flip an expert and move the logits by a few
    hundredths, so both tokens are greedy choices within arithmetic error. Any other
    divergence is a mismatch: with ``check_lossless`` it raises :class:`LosslessError`.
    """

    def __init__(self, engine, check_lossless: bool, label: str):
        self.engine, self.check_lossless, self.label = engine, check_lossless, label
        self.mismatches: list[str] = []
        self.near_ties: list[str] = []

    def compare(self, prompt, prompt_ids: list[int], expected: list[int], got: list[int]):
        position = metrics.first_mismatch(expected, got)
        if position is None:
            return
        message = _describe_mismatch(self.engine, prompt, position, expected, got)
        if position < len(expected) and position < len(got):
            prefix = prompt_ids + expected[:position]
            gap = _logit_gap(self.engine, prefix, expected[position], got[position])
            message += f"; the target's logits of the two tokens differ by {gap:.4f}"
            if gap <= TIE_TOLERANCE:
                self.near_ties.append(message + " (near tie)")
                return
        if self.check_lossless:
            raise LosslessError(f"{self.label}: {message}")
        self.mismatches.append(message)

    def fields(self) -> dict:
        """``lossless`` (every output equal), ``near_ties`` (outputs that diverged only at
        a near tie), ``mismatch_count`` (the other diverged outputs) and ``mismatches``
        (the first messages, mismatches first)."""
        return {
            "lossless": not (self.mismatches or self.near_ties),
            "near_ties": len(self.near_ties),
            "mismatch_count": len(self.mismatches),
            "mismatches": (self.mismatches + self.near_ties)[:MAX_MISMATCHES],
        }


def speculative_batches(engine, groups, limit, spec, progress, check, prompts, greedy, **run):
    """Decodes each batch of ``groups`` (lists of prompt token ids) speculatively with
    ``spec``, compares every output with the greedy one (``check``: an :class:`OutputCheck`;
    ``prompts`` and ``greedy`` line up with the groups' prompts) and yields each batch's
    result, advancing ``progress`` after the caller has read it. ``run``: the further
    keywords of ``OfflineEngine.generate_speculative`` (predictor, calibrator, ...)."""
    index = 0
    for group in groups:
        result = engine.generate_speculative(group, limit, spec, progress=progress.on_step, **run)
        for ids, got in zip(group, result.outputs, strict=True):
            check.compare(prompts[index], ids, greedy[index], list(got[:limit]))
            index += 1
        yield result
        progress.advance()
