"""What SGLang's server adds to each decode step over the calibrated forward, measured.

``sgl-ecospec calibrate`` times the lab's transformers forward of the target
(:mod:`sgl_ecospec.costmodel.calibration`); the server runs SGLang's own: its scheduler, the
batch's preparation, its attention kernels and sampling. On the bandwidth testbed the
forward's fit priced the plain server's steps 5-21% short (docs/costmodel.md, "Checked
against the server"). This is the missing term, measured on the server itself: a plain
server's run (``bench_serving --algorithms none --json RUN.json``, on prompts the checked run
does not use, on the same machine) gives, per batch size B, its measured TPOT minus the
forward's prediction of it (:func:`sgl_ecospec.lab.serving.predicted.predicted_tpot_ms`, the
prefills between its steps included): seconds per scheduler step, since a plain step makes
one token per request. The serving benchmark adds it to every step it prices, plain or
speculative (``bench_serving --profile FILE --server-step RUN.json``).

A speculative step runs more SGLang forwards than a plain one (the draft's, the verify's
extend), so the plain step's figure added to it leaves out what SGLang adds around those.
"""

import dataclasses
import statistics
from collections.abc import Callable

import numpy as np

from sgl_ecospec.lab.serving.report import read_run


@dataclasses.dataclass(frozen=True)
class ServerStep:
    """Seconds the plain server's decode step took over the forward's prediction, per batch.

    Attributes:
        batch_sizes: the measured batch sizes, ascending, distinct.
        seconds: per batch size, measured step minus predicted step (negative where the
            forward's fit overprices the server).
        source: the run file the figures come from.
    """

    batch_sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    source: str

    def __post_init__(self):
        if not self.batch_sizes or len(self.batch_sizes) != len(self.seconds):
            raise ValueError(
                f"need one figure per batch size, got {self.batch_sizes} and {self.seconds}"
            )
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
            raise ValueError(f"batch sizes must be >= 1, ascending, distinct: {self.batch_sizes}")

    def at(self, batch: float) -> float:
        """Seconds added to a step of ``batch`` requests: linear between the measured batch
        sizes, the nearest one's figure outside them."""
        return float(np.interp(batch, self.batch_sizes, self.seconds))

    @classmethod
    def from_run(
        cls, path: str, forward_tpot_ms: Callable[[dict, dict], float | None]
    ) -> "ServerStep":
        """The figures of the plain server's phases in the ``bench_serving --json`` file
        ``path``; ``forward_tpot_ms(record, config)`` is the forward's predicted TPOT of a
        phase (ms). Phases of one batch size (concurrencies at or above the prompts) are
        combined by their median.

        Raises:
            ValueError: the file is unreadable or not a bench_serving run, or has no plain
                server's phase with a measured TPOT and a prompt length (a message for the
                operator, naming the file and how to write one).
        """
        how = (
            "write one with: bash scripts/bench_serving.sh --algorithms none "
            "--concurrency 1,2,4,8 --json RUN.json (other prompts, e.g. --seed 1, this machine)"
        )
        per_batch: dict[int, list[float]] = {}
        try:
            cfg, runs = read_run(path)
            for record in runs:
                if record.get("algorithm") != "none" or not record.get("mean_tpot_ms"):
                    continue
                predicted = forward_tpot_ms(record, cfg)
                if predicted is None:
                    continue
                batch = min(record["concurrency"], cfg["num_prompts"])
                extra = (record["mean_tpot_ms"] - predicted) / 1000.0
                per_batch.setdefault(batch, []).append(extra)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(
                f"--server-step {path}: not a bench_serving run ({exc!r}); {how}"
            ) from None
        if not per_batch:
            raise ValueError(
                f"--server-step {path}: no phase of the plain server (algorithm none) with a "
                f"measured TPOT and prompt length; {how}"
            )
        batches = sorted(per_batch)
        return cls(
            tuple(batches), tuple(statistics.median(per_batch[b]) for b in batches), str(path)
        )
