"""Testbed recipes (``full`` and ``small``), their hash, and the cache directory.

A build is a pure function of (recipe, code, packaged assets), so the cache directory is
named ``<variant>-<hash>`` where the hash covers the recipe's fields and the source of
every module that shapes the output (this package but its command line and the bandwidth
variant, which a build never runs, and ``sgl_ecospec/models/eagle3.py``). Editing either
gives a new directory; old ones are left for the user to delete.
"""

import dataclasses
import hashlib
import json
import os
from pathlib import Path

from sgl_ecospec.lab.testbed.moefy import MoeSpec

CACHE_ENV = "SGL_ECOSPEC_CACHE"
_LAB = Path(__file__).parent.parent
# Modules of this package that no build of a recipe runs: editing them must not orphan the
# cached builds (the bandwidth variant hashes its own source on top of the full build's).
_NOT_BUILT = {"command.py", "bandwidth.py"}
_SOURCES = sorted(p for p in Path(__file__).parent.glob("*.py") if p.name not in _NOT_BUILT) + [
    _LAB.parent / "models" / "eagle3.py",
    _LAB / "numerics.py",
]


@dataclasses.dataclass(frozen=True)
class DraftSpec:
    """EAGLE-3 draft size, distillation data and training schedule."""

    aux_layer_ids: tuple[int, ...]  # target layers whose outputs feed the draft's fc
    vocab_size: int  # draft vocabulary: the most frequent target tokens
    prompts: int  # ShareGPT first turns answered by the target (distillation data)
    text_chunks: int  # packed ShareGPT chunks the target reads teacher-forced (more data)
    max_prompt_tokens: int  # longer rendered prompts are skipped
    max_new_tokens: int  # greedy target answer length
    gen_batch: int  # prompts per generate call
    epochs: int
    batch_tokens: int  # tokens per optimisation step (sequences are padded to a row)
    lr: float
    ttt_steps: int  # unrolled draft steps per position (test-time-training style)
    ttt_decay: float  # loss weight of unrolled step k is decay**k
    soft_top_k: int  # target next-token probabilities kept per position (soft labels)
    eval_prompts: int  # MT-Bench first turns for the acceptance measurement
    eval_new_tokens: int
    threads: int  # torch threads for draft data and training (fixed: results do not
    # depend on the machine's core count)
    conversations: int = 1200  # ShareGPT conversations the data draws from (after the
    # calibration and perplexity slices)
    bf16_autocast: bool = False  # bf16 matmuls in training (fast on AMX, machine-specific)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Everything that determines a testbed build.

    ``keep_layers`` picks SmolLM2 decoder layers (all 30 when None); the kept layers are
    renumbered 0..n-1 in the MoE model.
    """

    variant: str
    keep_layers: tuple[int, ...] | None
    moe: MoeSpec
    calib_chunks: int  # packed ShareGPT chunks of chunk_len tokens for calibration
    eval_chunks: int  # held-out chunks for perplexity
    chunk_len: int
    weight_dtype: str  # checkpoint dtype of the target ("bfloat16")
    draft: DraftSpec
    seed: int = 0

    def to_json(self) -> str:
        """Canonical JSON of every field (sorted keys): the hash input."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


FULL = Recipe(
    variant="full",
    keep_layers=None,
    moe=MoeSpec(
        num_experts=64,
        top_k=8,
        shared_neurons=1280,
        cluster_tokens=4096,
        cluster_iters=10,
        router_steps=100,
        router_batch=1024,
        router_lr=3e-3,
        router_spread=1.0,
        refit_ridge=1e-2,
        holdout_fraction=0.125,
    ),
    calib_chunks=48,
    eval_chunks=8,
    chunk_len=512,
    weight_dtype="bfloat16",
    draft=DraftSpec(
        aux_layer_ids=(1, 14, 26),
        vocab_size=8192,
        # Teacher-forced text instead of generated answers: the target reads 3-4x more
        # tokens per second than it generates, and data is what limits the draft.
        prompts=0,
        text_chunks=288,
        max_prompt_tokens=256,
        max_new_tokens=128,
        gen_batch=32,
        epochs=4,
        batch_tokens=1024,
        lr=2e-3,
        ttt_steps=3,
        ttt_decay=0.8,
        soft_top_k=16,
        eval_prompts=24,
        eval_new_tokens=128,
        threads=2,
    ),
)

# The small testbed: FULL with fewer layers, less data and shorter training; every field not
# named here is FULL's.
SMALL = dataclasses.replace(
    FULL,
    variant="small",
    # SmolLM2 does not survive losing 22 of its 30 layers (held-out perplexity > 1e5 for
    # every 8-layer subset tried); the first five plus the last three was the least bad.
    keep_layers=(0, 1, 2, 3, 4, 27, 28, 29),
    moe=dataclasses.replace(FULL.moe, cluster_tokens=2048, router_steps=60),
    calib_chunks=12,
    eval_chunks=4,
    draft=dataclasses.replace(
        FULL.draft,
        aux_layer_ids=(0, 3, 6),
        vocab_size=4096,
        prompts=64,
        text_chunks=0,
        max_prompt_tokens=192,
        max_new_tokens=96,
        epochs=3,
        batch_tokens=512,
        ttt_steps=2,
        eval_prompts=8,
        eval_new_tokens=64,
        threads=1,
    ),
)

RECIPES = {"full": FULL, "small": SMALL}

# SHA-256 of each recipe's target weights (numerics.weights_sha256 of target/) as built with
# the pinned numerics; a build on a machine that gets other bits says so (and then cannot
# use the shipped draft).
TARGET_SHA256 = {
    "full": "75033e5b00eefcc90d96b5e2e72ba56686aefd7496bd957e8b75722be7621b7d",
    "small": "e63d71c3998e1f3faf257dc24eb611dfee67951e526cc88c3733e2758f20fafc",
}

# The full testbed's shipped draft (``sgl-ecospec testbed train-draft``): trained once, far
# beyond a build's budget, mostly on the target's own greedy answers to ShareGPT first
# turns (the distribution it drafts at inference).
SHIPPED_DRAFT = dataclasses.replace(
    FULL.draft,
    prompts=1536,
    conversations=3200,
    text_chunks=96,
    epochs=12,
    bf16_autocast=True,
)


def recipe_hash(recipe: Recipe) -> str:
    """12 hex digits of SHA-256 over the recipe JSON and the build's source files."""
    digest = hashlib.sha256(recipe.to_json().encode())
    for path in _SOURCES:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def cache_root() -> Path:
    """``$SGL_ECOSPEC_CACHE/testbed``, default ``~/.cache/sgl-ecospec/testbed``."""
    base = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "sgl-ecospec"
    return Path(base) / "testbed"


def build_dir(recipe: Recipe) -> Path:
    """The recipe's cache directory: ``<cache_root>/<variant>-<hash>`` (target/, draft/ inside)."""
    return cache_root() / f"{recipe.variant}-{recipe_hash(recipe)}"
