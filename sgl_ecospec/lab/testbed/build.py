"""Builds the testbed (MoE target + EAGLE-3 draft) and registers ``sgl-ecospec testbed``.

``build(recipe)`` runs the phases below into ``<build_dir>.partial`` and renames it to the
recipe's cache directory when everything succeeded, so a directory with ``build.json`` in it
is always complete. A file lock next to it serialises concurrent builds of one recipe.

1. assets: SmolLM2 (dequantized GGUF, rounded to the checkpoint dtype), its tokenizer,
   ShareGPT conversations;
2. dense perplexity on held-out ShareGPT chunks, greedy answers to a few chat prompts;
3. MoEfication (``moefy.py``), layer by layer on calibration chunks; the calibration pass
   also yields teacher-forced draft data;
4. MoE perplexity and greedy answers;
5. export of the target (Qwen2-MoE, ``export.py``) and of probe logits for the tests;
6. draft data: the target reads ShareGPT text teacher-forced (full variant) or answers
   ShareGPT first turns greedily (small variant), recording its states;
7. draft training (``draft_training.py``);
8. acceptance length on MT-Bench first turns (``acceptance.py``).

Output layout: ``target/`` (transformers / SGLang checkpoint), ``draft/`` (EAGLE-3, SGLang
format), ``probe.safetensors`` (token ids and the in-memory model's logits on them) and
``build.json`` (recipe, hash, timings, measured quality).
"""

import contextlib
import dataclasses
import fcntl
import json
import platform
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from sgl_ecospec.lab import datasets, numerics
from sgl_ecospec.lab.testbed import (
    acceptance,
    assets,
    data,
    draft_training,
    export,
    moefy,
    shipped,
)
from sgl_ecospec.lab.testbed.recipe import (
    RECIPES,
    TARGET_SHA256,
    Recipe,
    build_dir,
    recipe_hash,
)

INFO_FILE = "build.json"
PROBE_FILE = "probe.safetensors"
# Disjoint slices of the usable ShareGPT conversations (file order) for each purpose.
CALIB_CONVS = slice(0, 800)
EVAL_CONVS = slice(800, 1200)
DRAFT_START = 1200  # the draft's data: the recipe's ``conversations`` from here on
CHAT_PROBES = (
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Write a Python function that returns the square of a number.",
)
# Draft data and training time on an idle 2-core machine, said before it starts (full: the
# 35 minutes measured before the kernels were pinned to AVX2, which are about 1.4x slower).
_DRAFT_TIME = {"full": "roughly 40-50 minutes", "small": "about 3 minutes"}
PROBE_TEXT = "The capital of France is Paris. Mixture-of-experts models route every token."


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Phases:
    """Logs one line per phase with its wall time and keeps the timings."""

    def __init__(self, log: Callable[[str], None]):
        self.log, self.seconds = log, {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        self.log(f"[testbed] {name} ...")
        start = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - start, 1)
        self.log(f"[testbed] {name}: {self.seconds[name]:.1f}s")


@contextlib.contextmanager
def threads(count: int):
    """Runs the block with ``count`` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def select_layers(model: nn.Module, keep: tuple[int, ...] | None) -> None:
    """Keeps only decoder layers ``keep`` (renumbered 0..n-1) of a ``LlamaForCausalLM``."""
    if keep is None:
        return
    layers = model.model.layers
    model.model.layers = nn.ModuleList(layers[i] for i in keep)
    for new_idx, layer in enumerate(model.model.layers):
        layer.self_attn.layer_idx = new_idx  # the KV cache is indexed by it
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]


def build(recipe: Recipe, *, force: bool = False, log: Callable[[str], None] = _stderr) -> Path:
    """Builds ``recipe`` into its cache directory unless already built; returns the directory.

    A build in a process without the pinned numerics (:mod:`numerics`) runs in a child
    process that has them, so the weights do not depend on the machine.

    Args:
        force: rebuild even when a complete build exists.
        log: receives one progress line per phase (default: stderr).
    """
    out = build_dir(recipe)
    if (out / INFO_FILE).is_file() and not force:
        return out
    if not numerics.pinned():
        if RECIPES.get(recipe.variant) is not recipe:
            raise ValueError(f"only the named recipes {sorted(RECIPES)} can be built")
        argv = [sys.executable, "-m", "sgl_ecospec.lab.cli", "testbed", "build"]
        argv += ["--small"] if recipe.variant == "small" else []
        argv += ["--force"] if force else []
        numerics.run_pinned(argv)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / INFO_FILE).is_file() and not force:
            return out
        work = out.with_name(out.name + ".partial")
        shutil.rmtree(work, ignore_errors=True)
        # A fixed thread count (one, and the recipe's for the draft's data and training):
        # the build's float results then do not depend on the machine's core count. One
        # thread for the rest: on a busy 2-core machine a second thread makes small
        # matmuls (decode steps) 10-50x slower, while the draft's large matmuls gain ~1.75x
        # from two on an idle one.
        with threads(1):
            _build_into(work, recipe, log)
        shutil.rmtree(out, ignore_errors=True)
        work.rename(out)
    return out


def read_info(out: Path) -> dict:
    """The ``build.json`` of a finished build directory."""
    return json.loads((out / INFO_FILE).read_text())


@dataclasses.dataclass
class Target:
    """The in-memory MoE target of a build and what its draft phases reuse."""

    model: nn.Module  # LlamaForCausalLM with MoeMLP blocks (weights rounded to the dtype)
    tokenizer: object
    conversations: list  # ShareGPT conversations, file order
    calib_samples: list  # teacher-forced draft samples from the calibration pass
    sha256: str  # weights_sha256 of the exported target/


def build_target(
    work: Path, recipe: Recipe, phases: Phases, info: dict, log: Callable[[str], None]
) -> Target:
    """Phases 1-5: the target, exported to ``work/target`` (and the probe), into ``info``.

    Needs the pinned numerics and one thread for machine-independent weights.
    """
    torch.manual_seed(recipe.seed)
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator().manual_seed(recipe.seed)
    dtype = getattr(torch, recipe.weight_dtype)
    with phases("assets"):
        tokenizer = assets.load_tokenizer()
        model = assets.load_dense_model()
        select_layers(model, recipe.keep_layers)
        # Rounded to the checkpoint dtype up front: every state computed from here on is
        # the exported model's.
        moefy.round_weights(model, dtype)
        convs = assets.sharegpt_conversations(DRAFT_START + recipe.draft.conversations)
        calib = data.packed_chunks(
            tokenizer, convs[CALIB_CONVS], recipe.calib_chunks, recipe.chunk_len
        )
        held_out = data.packed_chunks(
            tokenizer, convs[EVAL_CONVS], recipe.eval_chunks, recipe.chunk_len
        )
    with phases("dense perplexity"):
        info["dense_perplexity"] = data.perplexity(model, held_out)
        info["dense_answers"] = _answers(model, tokenizer)
    with phases("moefy"):
        result = moefy.moefy(
            model, calib, recipe.moe, gen, dtype=dtype, capture=recipe.draft.aux_layer_ids, log=log
        )
        info["layers"] = [dataclasses.asdict(s) for s in result.stats]
        # The calibration pass doubles as teacher-forced draft data (ShareGPT text, the
        # target's greedy labels) at no extra forward cost.
        calib_samples = draft_training.samples_from_states(
            model, calib, result.aux, result.final, recipe.draft.soft_top_k
        )
        del result
    with phases("moe perplexity"):
        info["moe_perplexity"] = data.perplexity(model, held_out)
        info["moe_answers"] = _answers(model, tokenizer)
    log(f"[testbed] perplexity: dense {info['dense_perplexity']:.2f}")
    log(f"[testbed] perplexity: MoE {info['moe_perplexity']:.2f}")
    with phases("export target"):
        export.save_target(model, tokenizer, work / "target", dtype)
        probe = torch.tensor([datasets.render_chat(tokenizer, PROBE_TEXT)])
        with torch.no_grad():
            logits = model(input_ids=probe).logits
        save_file({"input_ids": probe, "logits": logits.contiguous()}, str(work / PROBE_FILE))
        sha = numerics.weights_sha256(work / "target")
    info["weights_sha256"] = {"target": sha}
    log(f"[testbed] target weights sha256 {sha}")
    return Target(model, tokenizer, convs, calib_samples, sha)


def draft_prompts(tokenizer, conversations: list, spec) -> list[list[int]]:
    """The chat-rendered first turns the target answers for the draft's data."""
    convs = conversations[DRAFT_START : DRAFT_START + spec.conversations]
    prompts = [datasets.render_chat(tokenizer, conv[0]["content"]) for conv in convs]
    return [p for p in prompts if len(p) <= spec.max_prompt_tokens][: spec.prompts]


def draft_text(tokenizer, conversations: list, spec, chunk_len: int) -> torch.Tensor:
    """int64 ``[spec.text_chunks, chunk_len]``: packed text the target reads for the draft."""
    convs = conversations[DRAFT_START : DRAFT_START + spec.conversations]
    return data.packed_chunks(tokenizer, convs, spec.text_chunks, chunk_len)


def draft_samples(
    target: Target, spec, chunk_len: int, log: Callable[[str], None]
) -> tuple[list, dict]:
    """Phase 6: the draft's training samples and their token counts by kind."""
    model, tokenizer, convs = target.model, target.tokenizer, target.conversations
    samples, text_samples = [], []
    if spec.prompts:
        prompts = draft_prompts(tokenizer, convs, spec)
        samples = draft_training.training_samples(model, prompts, spec)
    if spec.text_chunks:
        chunks = draft_text(tokenizer, convs, spec, chunk_len)
        text_samples = draft_training.read_text(
            model, chunks, aux_layer_ids=spec.aux_layer_ids, soft_top_k=spec.soft_top_k, log=log
        )
    counts = {
        "generated": sum(len(s.tokens) for s in samples),
        "teacher_forced": sum(len(s.tokens) for s in text_samples + target.calib_samples),
    }
    return samples + text_samples + target.calib_samples, counts


def _build_into(work: Path, recipe: Recipe, log: Callable[[str], None]) -> None:
    phases = Phases(log)
    info = {"recipe": json.loads(recipe.to_json()), "hash": recipe_hash(recipe)}
    log(f"[testbed] building {recipe.variant} into {work}")
    target = build_target(work, recipe, phases, info, log)
    reference = TARGET_SHA256.get(recipe.variant)
    info["target_matches_reference"] = target.sha256 == reference
    if target.sha256 != reference:
        log(
            f"[testbed] note: the target's weights differ from the reference build's "
            f"(sha256 {reference}): this machine's float results differ from the pinned "
            f"AVX2 numerics (CPU {numerics.cpu_vendor()}, {platform.machine()}: they need "
            "x86-64 with AVX2)"
        )
    spec = recipe.draft
    dtype = getattr(torch, recipe.weight_dtype)
    found = shipped.find(target.sha256)
    if found is not None:
        log(f"[testbed] the shipped draft {found.name} was trained against this target: using it")
        draft = found.load()
        info["draft_source"] = {"shipped": found.name, "manifest": found.manifest}
    else:
        log(
            "[testbed] no shipped draft matches this target's weights: training one "
            f"({_DRAFT_TIME[recipe.variant]})"
        )
        gen = torch.Generator().manual_seed(recipe.seed)
        with phases("draft data"), threads(spec.threads):
            samples, info["draft_data_tokens"] = draft_samples(target, spec, recipe.chunk_len, log)
        with phases("draft training"), threads(spec.threads):
            text_counts = data.token_counts(target.tokenizer, target.conversations)
            draft = draft_training.init_draft(target.model, samples, text_counts, spec, recipe.seed)
            info["draft_history"] = draft_training.train_draft(
                draft, target.model.model.embed_tokens, samples, spec, gen, log
            )
        info["draft_source"] = {"trained": "recipe"}
    with phases("acceptance"):
        info["acceptance"] = measure_acceptance(target.model, target.tokenizer, draft, spec)
    log(f"[testbed] acceptance {info['acceptance']}")

    draft.save_pretrained(work / "draft", dtype=dtype)
    info["weights_sha256"]["draft"] = numerics.weights_sha256(work / "draft")
    info["seconds"] = phases.seconds
    (work / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


def _answers(model: nn.Module, tokenizer) -> dict[str, str]:
    prompts = [datasets.render_chat(tokenizer, q) for q in CHAT_PROBES]
    samples = draft_training.generate(
        model, prompts, max_new_tokens=32, batch=len(prompts), aux_layer_ids=(0,)
    )
    return {
        q: tokenizer.decode(s.tokens[len(p) :], skip_special_tokens=True)
        for q, p, s in zip(CHAT_PROBES, prompts, samples, strict=True)
    }


def measure_acceptance(model: nn.Module, tokenizer, draft, spec) -> dict[str, float]:
    """Mean acceptance length on MT-Bench first turns, tree (topk 4, 3 steps, budget 4) and
    chain (topk 1, 3 steps)."""
    questions = datasets.load_prompts("mt-bench", num_prompts=spec.eval_prompts, seed=0)
    prompts = [datasets.render_chat(tokenizer, q.text) for q in questions]
    samples = draft_training.generate(
        model,
        prompts,
        max_new_tokens=spec.eval_new_tokens,
        batch=spec.gen_batch,
        aux_layer_ids=spec.aux_layer_ids,
    )
    embed = model.model.embed_tokens
    shapes = {
        "tree_topk4_steps3_budget4": acceptance.TreeShape(4, 3, 4),
        "chain_steps3": acceptance.TreeShape(1, 3, 3),
    }
    return {
        name: acceptance.mean_acceptance(
            [
                acceptance.replay(draft, embed, s, len(p), shape)
                for s, p in zip(samples, prompts, strict=True)
            ]
        )
        for name, shape in shapes.items()
    }
