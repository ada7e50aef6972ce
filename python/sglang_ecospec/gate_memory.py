"""The utility gate's memory: a restarted server starts from the decisions an earlier one
made for the same model, draft, tree, settings and device (setting ``gate_memory``).

A fresh gate measures every level of each batch-size bucket before it decides (on the CPU
testbed at batch size 16 two tree steps of about twice a plain step's time, in a window of
about 30 decode steps), and a server that restarts (a deploy, an autoscaled replica, the
serving benchmark's server per round) would pay that again each time. So rank 0 writes, at
each decision (:meth:`GatePolicy._changed <sglang_ecospec.gate.GatePolicy>`), the level and
figures of every bucket that has decided on figures of its own, and a starting server whose
key matches seeds its gate with them (:meth:`sgl_ecospec.gate.UtilityGate.seed`): those
buckets start settled, probe ``probe_interval`` steps later as any settled bucket does, and
their figures blend into the new measurements. A file that is missing, unreadable or of
another key is ignored (a warning for the last two): the gate then measures, as without a
memory.

The key is everything the figures depend on: the target and draft checkpoints (paths and
config digests), the tree (``--speculative-num-steps``, ``-eagle-topk``,
``-num-draft-tokens``), the gate's levels, the TP and EP sizes, the dtype, the device's name,
the EcoSpec settings other than logging, and the plugin's version. File:
``<dir>/<model>-<digest>.json``, ``<dir>`` being ``$SGL_ECOSPEC_CACHE/gate`` (default
``~/.cache/sgl-ecospec/gate``) for ``gate_memory="auto"`` or the directory the setting names;
written to a temporary file and renamed, so a reader never sees half of one.
"""

import dataclasses
import json
import logging
import os
import tempfile
from pathlib import Path

from sgl_ecospec.gate import BucketState, LevelFigures, UtilityGate
from sglang_ecospec.cache_files import cache_root, file_digest, key_digest, plugin_version, slug

logger = logging.getLogger(__name__)

AUTO, OFF = "auto", "off"
# Settings that change what the server logs, not what the gate measures.
UNKEYED_SETTINGS = ("log_interval", "gate_memory")


def memory_dir(setting: str) -> Path | None:
    """The directory of ``gate_memory``'s files: None for "off"."""
    if setting == OFF:
        return None
    if setting == AUTO:
        return cache_root() / "gate"
    return Path(setting)


def memory_key(server_args, settings, levels, dtype, device_name: str) -> dict:
    """What a memory's figures depend on (module docstring), JSON-ready.

    Args:
        server_args: SGLang's final ``ServerArgs``.
        settings: the server's ``EcoSpecSettings``.
        levels: the gate's levels (``gate.gate_levels``).
        dtype: the model runner's torch dtype.
        device_name: the device's name (``sgl_ecospec.costmodel.calibration.device_name``).
    """
    fields = {
        f.name: getattr(settings, f.name)
        for f in dataclasses.fields(settings)
        if f.init and f.name not in UNKEYED_SETTINGS
    }
    return {
        "target": _checkpoint(server_args.model_path),
        "draft": _checkpoint(server_args.speculative_draft_model_path),
        "tree": [
            server_args.speculative_num_steps,
            server_args.speculative_eagle_topk,
            server_args.speculative_num_draft_tokens,
        ],
        "levels": list(levels),
        "tp_size": getattr(server_args, "tp_size", 1),
        "ep_size": getattr(server_args, "ep_size", 1),
        "dtype": str(dtype),
        "device": device_name,
        "settings": json.loads(json.dumps(fields, default=str)),
        "version": plugin_version(),
    }


def memory_file(directory: Path, key: dict) -> Path:
    """The memory's file for ``key`` in ``directory``."""
    name = slug(Path(str(key["target"]["path"])).name) or "model"
    return directory / f"{name}-{key_digest(key)}.json"


def save(gate: UtilityGate, path: Path, key: dict) -> None:
    """Writes ``gate``'s buckets that decided on figures of their own (measured, or restored)
    to ``path`` (atomically); a failure is a warning. A bucket that only inherited a
    neighbour's state is left out: restored, it would start settled on a decision nobody
    measured at its batch sizes (a warmup request's batch of 1 saved as speculating, with no
    plain step time, once kept a later server's prefills running the draft model)."""
    buckets = {}
    for bucket in gate.buckets():
        if gate.has_own_figures(bucket):
            state = gate.state(bucket)
            buckets[str(bucket)] = {
                "level": state.level,
                "plain_time": _number(state.plain_time),
                "speculative": [
                    [f.steps, _number(f.time), _number(f.tokens)] for f in state.speculative
                ],
            }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
            json.dump({"key": key, "buckets": buckets}, f, indent=1)
        os.replace(f.name, path)
    except OSError as exc:
        logger.warning("EcoSpec gate: cannot write its memory %s (%s)", path, exc)


def restore(gate: UtilityGate, path: Path, key: dict) -> list[int]:
    """Seeds ``gate`` with the buckets saved in ``path`` under ``key``; returns them
    (ascending; empty when the file is missing, unreadable or of another key)."""
    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
        if data.get("key") != key:
            raise ValueError("it was written for another key")
        states = {int(bucket): _state(entry) for bucket, entry in data["buckets"].items()}
        trial = UtilityGate(gate.options, levels=gate.levels)  # all of it fits, or none
        for target in (trial, gate):
            for bucket, state in sorted(states.items()):
                target.seed(bucket, state)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        logger.warning(
            "EcoSpec gate: memory %s ignored (%s); the gate measures every bucket anew", path, exc
        )
        return []
    return sorted(states)


def _state(entry: dict) -> BucketState:
    speculative = tuple(
        LevelFigures(int(steps), _float(time), _float(tokens), float("nan"))
        for steps, time, tokens in entry["speculative"]
    )
    return BucketState(int(entry["level"]), _float(entry["plain_time"]), speculative)


def _checkpoint(path: str | None) -> dict | None:
    if path is None:
        return None
    return {"path": str(Path(path).resolve()), "config": file_digest(Path(path) / "config.json")}


def _number(value: float) -> float | None:
    return value if value == value else None  # JSON has no NaN


def _float(value) -> float:
    return float("nan") if value is None else float(value)
