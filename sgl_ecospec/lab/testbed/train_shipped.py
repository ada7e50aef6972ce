"""``sgl-ecospec testbed train-draft``: trains the full testbed's shipped EAGLE-3 draft.

The run has two stages, each resumable, in a work directory
(default ``<cache root>/train-draft-full``):

1. data, in a child process with the pinned numerics (:mod:`numerics`): builds the full
   target exactly as ``testbed build`` does (same weights, same hash), then the target
   answers ShareGPT first turns greedily and reads ShareGPT text, saved in parts under
   ``data/`` as they finish;
2. training, in this process, with bf16 matmuls (``SHIPPED_DRAFT.bf16_autocast``: about
   2.7x faster than fp32 on CPUs with AMX), checkpointed after every epoch to
   ``checkpoint.pt``; then the acceptance replay on MT-Bench and the shipped asset
   (:mod:`shipped`) written to ``--out``.

The target weights, and so the data, are bit-identical on any x86-64 CPU with AVX2; the
bf16 training is bit-identical on the same CPU model (the manifest names it).
"""

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from sgl_ecospec.lab import numerics
from sgl_ecospec.lab.testbed import assets, build, data, draft_training, shipped
from sgl_ecospec.lab.testbed.recipe import FULL, SHIPPED_DRAFT, cache_root

GEN_PART = 128  # prompts per saved part of the generated data
COMMAND = "sgl-ecospec testbed train-draft"


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _conversations(spec) -> list:
    return assets.sharegpt_conversations(build.DRAFT_START + spec.conversations)


def _save_samples(samples: list, path: Path) -> None:
    fields = [(s.tokens, s.aux, s.top_ids, s.top_probs) for s in samples]
    torch.save(fields, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def _load_samples(path: Path) -> list:
    return [draft_training.Sample(*fields) for fields in torch.load(path, weights_only=True)]


def make_data(work: Path, spec=SHIPPED_DRAFT) -> dict:
    """Stage 1 (needs the pinned numerics): target build and draft data into ``work``;
    returns ``data/meta.json``'s content. Parts already saved are kept."""
    meta_path = work / "data" / "meta.json"
    if meta_path.is_file():
        return json.loads(meta_path.read_text())
    if not numerics.pinned():
        raise RuntimeError("the data stage needs the pinned numerics (run it through train-draft)")
    (work / "data").mkdir(parents=True, exist_ok=True)
    phases, info = build.Phases(_log), {}
    with build.threads(1):
        target = build.build_target(work / "build", FULL, phases, info, _log)
    _save_samples(target.calib_samples, work / "data" / "calib.pt")
    convs = _conversations(spec)
    prompts = build.draft_prompts(target.tokenizer, convs, spec)
    start = time.perf_counter()
    with build.threads(spec.threads):
        for part, first in enumerate(range(0, len(prompts), GEN_PART)):
            path = work / "data" / f"gen-{part:03d}.pt"
            if path.is_file():
                continue
            part_prompts = prompts[first : first + GEN_PART]
            samples = draft_training.training_samples(target.model, part_prompts, spec)
            _save_samples(samples, path)
            done = min(first + GEN_PART, len(prompts))
            _log(f"  answered {done}/{len(prompts)} prompts ({time.perf_counter() - start:.0f}s)")
        if spec.text_chunks and not (work / "data" / "text.pt").is_file():
            chunks = build.draft_text(target.tokenizer, convs, spec, FULL.chunk_len)
            text = draft_training.read_text(
                target.model,
                chunks,
                aux_layer_ids=spec.aux_layer_ids,
                soft_top_k=spec.soft_top_k,
                log=_log,
            )
            _save_samples(text, work / "data" / "text.pt")
    meta = {"target_sha256": target.sha256, "prompts": len(prompts), "build": info}
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _samples(work: Path) -> tuple[list, dict]:
    generated = [s for p in sorted((work / "data").glob("gen-*.pt")) for s in _load_samples(p)]
    forced = _load_samples(work / "data" / "calib.pt")
    if (work / "data" / "text.pt").is_file():
        forced += _load_samples(work / "data" / "text.pt")
    counts = {
        "generated": sum(len(s.tokens) for s in generated),
        "teacher_forced": sum(len(s.tokens) for s in forced),
    }
    return generated + forced, counts


def _embedding(target_dir: Path) -> nn.Embedding:
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        weight = f.get_tensor("model.embed_tokens.weight").float()
    return nn.Embedding.from_pretrained(weight, freeze=True)


def train(work: Path, out: Path, until_epoch: int | None, spec=SHIPPED_DRAFT) -> Path:
    """Stage 2: trains (resuming from ``work/checkpoint.pt``), measures acceptance and
    writes the shipped draft to ``out``."""
    from transformers import AutoModelForCausalLM

    meta = json.loads((work / "data" / "meta.json").read_text())
    target_dir = work / "build" / "target"
    tokenizer = assets.load_tokenizer()
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    samples, counts = _samples(work)
    _log(f"[train-draft] {counts} tokens of data, {len(samples)} sequences")
    start = time.perf_counter()
    with build.threads(spec.threads):
        text_counts = data.token_counts(tokenizer, _conversations(spec))
        draft = draft_training.init_draft(target, samples, text_counts, spec, FULL.seed)
        generator = torch.Generator().manual_seed(FULL.seed)
        history = draft_training.train_draft(
            draft,
            _embedding(target_dir),
            samples,
            spec,
            generator,
            _log,
            checkpoint=work / "checkpoint.pt",
            until_epoch=until_epoch,
        )
    seconds = round(time.perf_counter() - start, 1)
    with build.threads(1):
        accepted = build.measure_acceptance(target, tokenizer, draft, spec)
    _log(f"[train-draft] acceptance {accepted}")
    command = COMMAND + (f" --until-epoch {until_epoch}" if until_epoch is not None else "")
    manifest = {
        "target_sha256": meta["target_sha256"],
        "command": command,
        "spec": dataclasses.asdict(spec),
        "data_tokens": counts,
        "history": history,
        "acceptance": accepted,
        "trained": {
            "date": datetime.date.today().isoformat(),
            "cpu": _cpu_model(),
            "threads": spec.threads,
            "training_seconds_this_run": seconds,
            "numerics": "target and data: pinned AVX2 (any x86-64 CPU); training: bf16 "
            "autocast on the CPU named here",
        },
    }
    written = shipped.write(draft, out, manifest)
    _log(f"[train-draft] wrote {written.path} (target sha256 {written.target_sha256[:12]})")
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``testbed train-draft`` flags."""
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="work directory with the data parts and checkpoint (default: "
        "<cache root>/train-draft-full); rerunning resumes from it",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=shipped.SHIPPED_ROOT / "full-v1",
        help="where the shipped draft goes (default: the package's drafts/full-v1)",
    )
    parser.add_argument(
        "--until-epoch",
        type=int,
        default=None,
        help=f"stop after this many of the {SHIPPED_DRAFT.epochs} epochs and export",
    )


def run(args: argparse.Namespace) -> int:
    """Runs both stages; the data stage in a pinned child process."""
    work = args.work or cache_root() / "train-draft-full"
    if args.until_epoch is not None and not 1 <= args.until_epoch <= SHIPPED_DRAFT.epochs:
        raise ValueError(f"--until-epoch must be 1..{SHIPPED_DRAFT.epochs}")
    if not (work / "data" / "meta.json").is_file():
        _log(
            f"[train-draft] data stage into {work}: the target build (about 5 min), "
            f"{SHIPPED_DRAFT.prompts} answers and {SHIPPED_DRAFT.text_chunks} text chunks"
        )
        argv = [sys.executable, "-m", "sgl_ecospec.lab.testbed.train_shipped", str(work)]
        numerics.run_pinned(argv)
    train(work, args.out, args.until_epoch)
    return 0


if __name__ == "__main__":
    make_data(Path(sys.argv[1]))
