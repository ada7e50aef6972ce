"""The serving benchmark's prompts: a packaged dataset as the file ``sglang.bench_serving``
reads, and the warmup request that precedes every measured phase."""

import json
from pathlib import Path

# The warmup's user message, chat-rendered like every measured prompt: the template's head is
# in each server's prefix cache before the measured window, whatever the scheduler (overlap or
# synchronous) plans before the first prompt's prefix is cached.
WARMUP_MESSAGE = "Hello"


def write_sharegpt_file(dataset: str, num_prompts: int, seed: int, path: Path, tokenizer) -> None:
    """``num_prompts`` prompts of a packaged dataset as a ShareGPT-format JSON file (what
    ``sglang.bench_serving --dataset-name sharegpt --dataset-path`` reads), each already
    rendered with ``tokenizer``'s chat template (``render_chat_text``), so the server
    tokenizes it into the very ids the offline engine decodes (``render_chat``)."""
    from sgl_ecospec.lab.datasets import load_prompts, render_chat_text

    prompts = load_prompts(dataset, num_prompts=num_prompts, seed=seed)
    records = [
        {
            "id": p.source,
            "conversations": [
                {"from": "human", "value": render_chat_text(tokenizer, p.text)},
                {"from": "gpt", "value": ""},
            ],
        }
        for p in prompts
    ]
    path.write_text(json.dumps(records))


def warmup_prompt(tokenizer) -> str:
    """The warmup request's text: :data:`WARMUP_MESSAGE` chat-rendered as the dataset's
    prompts are (:func:`write_sharegpt_file`), so it shares their template head."""
    from sgl_ecospec.lab.datasets import render_chat_text

    return render_chat_text(tokenizer, WARMUP_MESSAGE)
