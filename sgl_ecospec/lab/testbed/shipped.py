"""EAGLE-3 drafts shipped with the project, each trained once against one exact target.

A testbed build spends about 20 minutes of its time on the draft, which is too little for a
good one. ``sgl-ecospec testbed train-draft`` (:mod:`train_shipped`) trains one far longer
and writes it here, under ``drafts/<name>/``: ``config.json`` and ``model.safetensors``
(bf16, SGLang's EAGLE-3 layout) and ``manifest.json``, which holds the SHA-256 of the
target weights it was trained against (:func:`numerics.weights_sha256`), the command that
reproduces it, its data, training history and measured acceptance. A build whose target
has that hash uses the shipped draft instead of training one.
"""

import dataclasses
import json
import os
from pathlib import Path

import torch

from sgl_ecospec.lab import numerics
from sgl_ecospec.models import eagle3

SHIPPED_ROOT = Path(__file__).parent / "drafts"
MANIFEST_FILE = "manifest.json"
# Manifest keys every shipped draft has (the tests check them).
MANIFEST_KEYS = (
    "name",
    "target_sha256",
    "draft_sha256",
    "dtype",
    "command",
    "spec",
    "data_tokens",
    "history",
    "acceptance",
    "trained",
)


@dataclasses.dataclass(frozen=True)
class ShippedDraft:
    """One directory under :data:`SHIPPED_ROOT`."""

    path: Path
    manifest: dict

    @property
    def name(self) -> str:
        return self.manifest["name"]

    @property
    def target_sha256(self) -> str:
        return self.manifest["target_sha256"]

    def load(self) -> eagle3.Eagle3Draft:
        """The draft in float32, after checking its weights against the manifest's hash."""
        sha = numerics.weights_sha256(self.path)
        if sha != self.manifest["draft_sha256"]:
            raise ValueError(
                f"shipped draft {self.path} is damaged: weights sha256 {sha}, manifest says "
                f"{self.manifest['draft_sha256']}; restore it from the repository (git checkout)"
            )
        return eagle3.Eagle3Draft.from_pretrained(self.path, dtype=torch.float32)


def shipped_drafts(root: str | os.PathLike = SHIPPED_ROOT) -> list[ShippedDraft]:
    """Every shipped draft under ``root``, by name."""
    found = []
    for manifest in sorted(Path(root).glob(f"*/{MANIFEST_FILE}")):
        data = json.loads(manifest.read_text())
        missing = [key for key in MANIFEST_KEYS if key not in data]
        if missing:
            raise ValueError(f"{manifest} lacks {missing}")
        found.append(ShippedDraft(manifest.parent, data))
    return found


def find(target_sha256: str, root: str | os.PathLike = SHIPPED_ROOT) -> ShippedDraft | None:
    """The shipped draft trained against the target with these weights, if any."""
    matches = [d for d in shipped_drafts(root) if d.target_sha256 == target_sha256]
    return matches[-1] if matches else None


def write(draft: eagle3.Eagle3Draft, out: Path, manifest: dict) -> ShippedDraft:
    """Saves ``draft`` in bf16 into ``out`` with ``manifest`` plus its ``draft_sha256``,
    ``dtype`` and ``name`` (the directory's name)."""
    draft.save_pretrained(out, dtype=torch.bfloat16)
    full = {
        **manifest,
        "name": out.name,
        "dtype": "bfloat16",
        "draft_sha256": numerics.weights_sha256(out),
    }
    missing = [key for key in MANIFEST_KEYS if key not in full]
    if missing:
        raise ValueError(f"manifest lacks {missing}")
    (out / MANIFEST_FILE).write_text(json.dumps(full, indent=2) + "\n")
    return ShippedDraft(out, full)
