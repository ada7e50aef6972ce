"""The bandwidth-bound testbed: the full testbed's target with every routed expert padded.

The full testbed's routed experts have 4 neurons each (docs/testbed.md): loading one costs
almost nothing, so a server's decode step is overhead. In a real MoE the routed experts
dominate the weight bytes a decoded token reads. This variant pads every routed expert to
``width`` neurons, ``width`` chosen so that the routed experts take the share of a layer's
weight bytes that they take in Qwen3-235B-A22B (:func:`padded_width`; the arithmetic is in
docs/testbed.md). The extra neurons' gate and up rows repeat the expert's own rows (finite
activations of the usual size, real work for the kernels) and their down-projection columns
are zero: routing is unchanged, and so is the function up to summation order, so the full
build's draft serves it as it is.

Cache: ``<cache_root>/bandwidth-<hash>/`` with ``target/`` (one safetensors shard per layer),
``draft/`` (the full build's) and ``build.json``; the hash covers the full build's directory
name, the width and this module's source. Pure data movement (no float arithmetic), so the
output is bit-identical wherever it is built.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sgl_ecospec.lab import greedy_check, numerics
from sgl_ecospec.lab.datasets import load_prompts, render_chat
from sgl_ecospec.lab.testbed import build as testbed_build
from sgl_ecospec.lab.testbed.recipe import FULL, cache_root

INFO_FILE = "build.json"
INDEX_FILE = "model.safetensors.index.json"
# Rounding of the padded width: kernels tile the expert dimension in powers of two.
WIDTH_MULTIPLE = 32
# The greedy check's prompts and length: the serving benchmark's defaults.
BENCH_PROMPTS, BENCH_TOKENS = 8, 32
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class MoeLayerShape:
    """What one decoder layer of an MoE model reads per decoded token (weights only)."""

    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_width: int  # neurons per routed expert (moe_intermediate_size)
    shared_width: int  # neurons of the always-on shared expert (0: none)

    def weights_read(self) -> dict[str, int]:
        """Parameters a decoded token reads in this layer, by part: attention's q/k/v/o
        projections, the router, the top-k routed experts (3 x hidden x width each), the
        shared expert and its gate. Norms (a few thousand parameters) are left out."""
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        shared = 3 * self.hidden * self.shared_width + (self.hidden if self.shared_width else 0)
        return {
            "attention": self.hidden * (2 * q + 2 * kv),
            "router": self.hidden * self.experts,
            "routed_experts": self.top_k * 3 * self.hidden * self.expert_width,
            "shared_expert": shared,
        }

    def routed_share(self) -> float:
        """The routed experts' share of :meth:`weights_read` (any one dtype: bytes cancel)."""
        parts = self.weights_read()
        return parts["routed_experts"] / sum(parts.values())


# The per-layer sizes of Qwen3-235B-A22B's config.json (it also has 94 layers and a 151,936
# vocabulary: embeddings and lm_head are not per-layer reads and stay out of the share).
QWEN3_235B_A22B_CONFIG = {
    "hidden_size": 4096,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1536,
}


def moe_layer_shape(config: dict) -> MoeLayerShape:
    """The layer shape of a Qwen2-MoE or Qwen3-MoE ``config.json`` (``head_dim`` defaults to
    hidden / heads, the shared expert to none)."""
    heads = config["num_attention_heads"]
    return MoeLayerShape(
        hidden=config["hidden_size"],
        q_heads=heads,
        kv_heads=config["num_key_value_heads"],
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        experts=config["num_experts"],
        top_k=config["num_experts_per_tok"],
        expert_width=config["moe_intermediate_size"],
        shared_width=config.get("shared_expert_intermediate_size", 0),
    )


QWEN3_235B_A22B = moe_layer_shape(QWEN3_235B_A22B_CONFIG)


def padded_width(shape: MoeLayerShape, share: float, multiple: int = WIDTH_MULTIPLE) -> int:
    """The routed-expert width, a multiple of ``multiple`` (at least the current width),
    whose routed share of ``shape``'s per-layer reads is nearest ``share`` (0 < share < 1)."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"share must be in (0, 1), got {share}")
    other = sum(v for k, v in shape.weights_read().items() if k != "routed_experts")
    exact = share / (1.0 - share) * other / (shape.top_k * 3 * shape.hidden)
    width = max(multiple, round(exact / multiple) * multiple)
    if width < shape.expert_width:
        raise ValueError(f"width {width} < the experts' {shape.expert_width} neurons")
    return width


def pad_expert(name: str, weight: torch.Tensor, width: int) -> torch.Tensor:
    """One routed expert's projection padded to ``width`` neurons.

    Args:
        name: ``gate``, ``up`` or ``down``.
        weight: ``[I, H]`` (gate, up) or ``[H, I]`` (down), any dtype.
        width: the padded neuron count (>= I).

    Returns:
        ``[width, H]`` with rows ``j >= I`` equal to row ``j mod I`` (gate, up), or
        ``[H, width]`` with columns ``j >= I`` zero (down); same dtype.
    """
    neurons = weight.shape[1] if name == "down" else weight.shape[0]
    if width < neurons:
        raise ValueError(f"cannot pad {neurons} neurons to {width}")
    if name == "down":
        return torch.cat([weight, weight.new_zeros(weight.shape[0], width - neurons)], 1)
    return weight[torch.arange(width) % neurons].contiguous()


def pad_checkpoint(source: Path, out: Path, width: int, log: Callable[[str], None] = print) -> None:
    """Writes ``source``'s Qwen2-MoE checkpoint with routed experts padded to ``width`` into
    ``out``: config.json (``moe_intermediate_size``), one safetensors shard per layer plus
    one for the rest, their index, and every other file of ``source`` as it is."""
    out.mkdir(parents=True)
    for path in sorted(source.iterdir()):
        if path.is_file() and path.suffix != ".safetensors" and path.name != INDEX_FILE:
            shutil.copyfile(path, out / path.name)
    config = json.loads((source / "config.json").read_text())
    config["moe_intermediate_size"] = width
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    layers = config["num_hidden_layers"]
    weight_map, total_bytes, start = {}, 0, time.perf_counter()
    with contextlib.ExitStack() as stack:
        handles = [
            stack.enter_context(safe_open(str(path), framework="pt"))
            for path in sorted(source.glob("*.safetensors"))
        ]
        owner = {name: handle for handle in handles for name in handle.keys()}
        shards: dict[int, list[str]] = {}  # layer (-1: embeddings, norm, head) -> names
        for name in sorted(owner):
            layer = _LAYER.match(name)
            shards.setdefault(int(layer[1]) if layer else -1, []).append(name)
        # One shard per layer: memory stays at one padded layer, and progress is per layer.
        order = sorted(shards, key=lambda key: (key < 0, key))
        for number, key in enumerate(order, 1):
            shard = f"model-{number:05d}-of-{len(order):05d}.safetensors"
            tensors = {}
            for name in shards[key]:
                tensor = owner[name].get_tensor(name)
                expert = _EXPERT.match(name)
                tensors[name] = pad_expert(expert[2], tensor, width) if expert else tensor
                weight_map[name] = shard
                total_bytes += tensor.element_size() * tensors[name].numel()
            save_file(tensors, str(out / shard), metadata={"format": "pt"})
            what = f"layer {key:2d} of {layers}" if key >= 0 else "embeddings, norm, lm_head"
            log(f"  {what}: {shard} ({time.perf_counter() - start:.1f}s)")
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def check_greedy(full: Path, padded: Path, log: Callable[[str], None]) -> dict:
    """:func:`greedy_check.compare_greedy` of the padded target against the full one (both
    float32) on the serving benchmark's prompts (its defaults: 8 MT-Bench first turns, seed
    0, 32 new tokens); logs and returns the report."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    log(f"[testbed] greedy check on {BENCH_PROMPTS} MT-Bench prompts x {BENCH_TOKENS} tokens ...")
    tokenizer = AutoTokenizer.from_pretrained(full)
    prompts = load_prompts("mt-bench", num_prompts=BENCH_PROMPTS, seed=0)
    ids = [render_chat(tokenizer, prompt.text) for prompt in prompts]
    models = [
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for path in (full, padded)
    ]
    report = greedy_check.compare_greedy(*models, ids, BENCH_TOKENS, log=log)
    report["seconds"] = round(time.perf_counter() - start, 1)
    log(
        f"[testbed] greedy check: {report['identical']} of {report['prompts']} identical, "
        f"{report['near_ties']} near-ties, {report['divergences']} divergences, largest "
        f"logit difference {report['max_logit_diff']:.2e} ({report['seconds']}s)"
    )
    return report


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def variant_dir(full: Path, width: int) -> Path:
    """``<cache_root>/bandwidth-<hash>``: hash of the full build's name, the width, this
    module's source."""
    digest = hashlib.sha256(f"{full.name}/{width}".encode())
    digest.update(Path(__file__).read_bytes())
    return cache_root() / f"bandwidth-{digest.hexdigest()[:12]}"


def build(*, force: bool = False, log: Callable[[str], None] = _stderr) -> Path:
    """Builds the bandwidth-bound variant from the full testbed (built first if needed, which
    takes long); returns its directory (``target/``, ``draft/``, ``build.json``)."""
    full = testbed_build.build(FULL, log=log)
    config = json.loads((full / "target" / "config.json").read_text())
    shape = moe_layer_shape(config)
    width = padded_width(shape, QWEN3_235B_A22B.routed_share())
    out = variant_dir(full, width)
    if (out / INFO_FILE).is_file() and not force:
        return out
    with _exclusive(out):
        if (out / INFO_FILE).is_file() and not force:
            return out  # built by another process while this one waited
        work = out.with_name(out.name + ".partial")
        shutil.rmtree(work, ignore_errors=True)  # what an interrupted build left
        _build_into(work, full, shape, width, log)
        shutil.rmtree(out, ignore_errors=True)
        work.rename(out)
    return out


@contextlib.contextmanager
def _exclusive(out: Path):
    """Holds ``out``'s build lock: one build of a variant directory at a time."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build_into(
    work: Path, full: Path, shape: MoeLayerShape, width: int, log: Callable[[str], None]
) -> None:
    """Writes the variant of ``full`` (a full testbed build) into ``work``, build.json last."""
    padded = dataclasses.replace(shape, expert_width=width)
    log(
        f"[testbed] bandwidth variant: routed experts {shape.expert_width} -> {width} "
        f"neurons (routed share of a layer's reads {shape.routed_share():.3f} -> "
        f"{padded.routed_share():.3f}; Qwen3-235B-A22B {QWEN3_235B_A22B.routed_share():.3f})"
        f" into {work}"
    )
    start = time.perf_counter()
    pad_checkpoint(full / "target", work / "target", width, log)
    shutil.copytree(full / "draft", work / "draft")
    info = {
        "full_build": full.name,
        "width": width,
        "routed_share": {
            "before": shape.routed_share(),
            "after": padded.routed_share(),
            "qwen3_235b_a22b": QWEN3_235B_A22B.routed_share(),
        },
        "weights_sha256": numerics.weights_sha256(work / "target"),
        "seconds": round(time.perf_counter() - start, 1),
    }
    log(f"[testbed] target weights sha256 {info['weights_sha256']} ({info['seconds']}s)")
    info["greedy_check"] = check_greedy(full / "target", work / "target", log)
    (work / INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
