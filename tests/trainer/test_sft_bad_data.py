"""Hostile SFT data: every bad file, row or template is one ConfigError naming the file, the row and the field; huge
rows cost what seq_len keeps; rows that would train on nothing are named, never silently trained on."""

import json
import logging
import subprocess
import sys

import numpy as np
import pytest
from prime_core.config import ConfigError
from prime_core.config.trainer import LossMaskConfig
from prime_trainer.sft.data import PackedData, Sample, build_samples, load_rows, load_tokenizer, pack

from tests.trainer.trainer_utils import TINY_QWEN3, write_char_tokenizer

GOOD = json.dumps({"prompt": "ab", "completion": "ba"})


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_char_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    return load_tokenizer(str(tok_dir), None)


def msgs(*pairs, **extra):
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in pairs], **extra})


def tool_row(calls):
    return json.dumps(
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": calls}]}
    )


BAD_JSONL = {
    "truncated": (GOOD + "\n" + GOOD[:-4], r"line 2: invalid JSON .*cut short"),
    "invalid_utf8": (GOOD.encode() + b'\n{"prompt": "\xff", "completion": "b"}\n', r"line 2: not UTF-8"),
    "empty": ("", r"no rows"),
    "blank_lines": ("\n  \n\n", r"no rows"),
    "list_row": (GOOD + "\n[1, 2]\n", r"line 2: a row must be a JSON object, got a list"),
    "missing_role": (json.dumps({"messages": [{"content": "a"}]}), r"line 1: messages\[0\]\.role is missing"),
    "missing_content": (
        json.dumps({"messages": [{"role": "user"}, {"role": "assistant", "content": "b"}]}),
        r"line 1: messages\[0\]\.content is missing",
    ),
    "null_content": (msgs(("user", None), ("assistant", "b")), r"messages\[0\]\.content is missing"),
    "number_content": (msgs(("user", "a"), ("assistant", 7)), r"messages\[1\]\.content is a number"),
    "bad_part": (msgs(("user", [{"text": "a"}]), ("assistant", "b")), r"messages\[0\]\.content\[0\] is not a part"),
    "messages_string": (json.dumps({"messages": "hi"}), r"line 1: messages is a string"),
    "message_string": (json.dumps({"messages": ["hi"]}), r"messages\[0\] is a string"),
    "prompt_number": (json.dumps({"prompt": 5, "completion": "b"}), r"prompt is a number"),
    "completion_message_string": (
        json.dumps({"prompt": "a", "completion": ["b"]}),
        r"completion\[0\] is a string",
    ),
    "malformed_arguments": (
        tool_row([{"function": {"name": "f", "arguments": "{bad"}}]),
        r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not JSON",
    ),
    "arguments_not_object": (
        tool_row([{"function": {"name": "f", "arguments": "[1]"}}]),
        r"tool_calls\[0\]\.function\.arguments is a list",
    ),
    "tool_calls_string": (tool_row("call f"), r"messages\[1\]\.tool_calls is a string"),
    "tool_call_no_function": (tool_row([{"name": "f"}]), r"tool_calls\[0\] needs a `function` object"),
    "completion_null": (
        json.dumps({"prompt": "a", "completion": None}),
        r"line 1: needs `messages`, or `prompt` and `completion` \(has non-null \['prompt'\]\)",
    ),
    "lone_surrogate": (
        '{"prompt": "a\\ud800b", "completion": "c"}',
        r"line 1: messages\[0\] renders '\\ud800', a lone surrogate",
    ),
    "weight_not_0_or_1": (
        json.dumps(
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 2}]}
        ),
        r"messages\[1\]\.weight is 2 \(expected 0 or 1\)",
    ),
    "tools_bad_json": (json.dumps({"prompt": "a", "completion": "b", "tools": "{bad"}), r"tools is a string but not"),
}


@pytest.mark.parametrize("case", sorted(BAD_JSONL))
def test_bad_jsonl_names_file_line_and_field(tmp_path, tokenizer, case):
    content, pattern = BAD_JSONL[case]
    path = tmp_path / "data.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ConfigError, match=pattern) as e:
        build_samples(load_rows(str(path)), tokenizer, LossMaskConfig(), 64)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_bad_json_and_parquet_files_name_the_file(tmp_path):
    (tmp_path / "a.json").write_text('[{"prompt": "a"')
    with pytest.raises(ConfigError, match=r"a\.json: invalid JSON at line 1"):
        load_rows(str(tmp_path / "a.json"))
    (tmp_path / "b.json").write_text("[5]")
    with pytest.raises(ConfigError, match=r"b\.json row 0: a row must be a JSON object, got a number"):
        load_rows(str(tmp_path / "b.json"))
    (tmp_path / "c.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(ConfigError, match=r"c\.parquet: not a readable parquet file"):
        load_rows(str(tmp_path / "c.parquet"))


def test_parquet_wrong_column_types_name_the_row(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [1, 2], "completion": ["a", "b"]}), tmp_path / "d.parquet")
    with pytest.raises(ConfigError, match=r"d\.parquet row 0: prompt is a number"):
        build_samples(load_rows(str(tmp_path / "d.parquet")), tokenizer, LossMaskConfig(), 64)
    # Messages stored as a JSON string column.
    pq.write_table(pa.table({"messages": [msgs(("user", "a"), ("assistant", "b"))]}), tmp_path / "e.parquet")
    with pytest.raises(ConfigError, match=r"e\.parquet row 0: messages is a string"):
        build_samples(load_rows(str(tmp_path / "e.parquet")), tokenizer, LossMaskConfig(), 64)


def test_directory_names_the_file_of_a_bad_row(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([json.loads(GOOD)] * 2), tmp_path / "a.parquet")
    (tmp_path / "b.jsonl").write_text(GOOD + "\n" + GOOD + "\n" + msgs(("user", "a"), ("assistant", 3)) + "\n")
    (tmp_path / "notes.txt").write_text("not data")
    rows = load_rows(str(tmp_path))
    assert len(rows) == 5
    with pytest.raises(ConfigError, match=r"b\.jsonl line 3: messages\[1\]\.content is a number"):
        build_samples(rows, tokenizer, LossMaskConfig(), 64)


def test_unicode_line_separator_inside_a_string_is_not_a_line_break(tmp_path):
    """JSON Lines break at \\n only: str.splitlines (old code) also split at U+2028/U+0085 inside a string value."""
    rows = [{"prompt": "a\u2028b\x85c", "completion": "d"}, json.loads(GOOD)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    assert load_rows(str(tmp_path / "d.jsonl")) == rows


def test_byte_order_mark_is_read(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_text("\ufeff" + GOOD + "\n")
    (tmp_path / "d.json").write_text("\ufeff[" + GOOD + "]")
    assert load_rows(str(tmp_path / "d.jsonl")) == load_rows(str(tmp_path / "d.json")) == [json.loads(GOOD)]


class CountingTokenizer:
    """Records the longest text tokenized and the number of template renders."""

    def __init__(self, inner):
        self.inner, self.longest, self.renders = inner, 0, 0
        self.is_fast = inner.is_fast

    def __call__(self, text, **kwargs):
        self.longest = max(self.longest, len(text))
        return self.inner(text, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.renders += 1
        return self.inner.apply_chat_template(*args, **kwargs)


def test_huge_row_costs_what_seq_len_keeps(tmp_path, tokenizer):
    """A 2 MB completion (old code: tokenized whole, ~1 GB and seconds per MB) is tokenized only as far as seq_len
    needs, and gives the same first seq_len tokens."""
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "ab", "completion": "xy" * 1_000_000}) + "\n")
    counting = CountingTokenizer(tokenizer)
    (sample,) = build_samples(load_rows(str(tmp_path / "d.jsonl")), counting, LossMaskConfig(), 64)
    assert counting.longest < 10_000
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "xy" * 100}], tokenize=False
    )
    assert sample.input_ids.tolist() == tokenizer(full, add_special_tokens=False)["input_ids"][:64]
    assert sample.loss_mask.sum() > 40


def test_many_messages_stop_rendering_past_seq_len(tmp_path, tokenizer):
    turns = [("user", "ab"), ("assistant", "ba")] * 2500
    (tmp_path / "d.jsonl").write_text(msgs(*turns) + "\n")
    counting = CountingTokenizer(tokenizer)
    (sample,) = build_samples(load_rows(str(tmp_path / "d.jsonl")), counting, LossMaskConfig(), 64)
    assert counting.renders < 100, counting.renders  # old code: two renders per message, each of the whole prefix
    assert len(sample.input_ids) == 64


def test_prompt_longer_than_seq_len_is_skipped_and_named(tmp_path, tokenizer, caplog):
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": "a" * 100, "completion": "b"}) + "\n" + GOOD + "\n")
    with caplog.at_level(logging.WARNING, logger="prime.sft"):
        samples = build_samples(load_rows(str(tmp_path / "d.jsonl")), tokenizer, LossMaskConfig(), 64)
    assert len(samples) == 1 and all(s.loss_mask.any() for s in samples)
    assert "skipped 1 of 2 rows: 1 because their first trained token is past seq_len=64" in caplog.text
    assert "d.jsonl line 1" in caplog.text and "1 of 2 rows were cut to seq_len=64" in caplog.text
    # Every row too long: a named error, never a run looking for data forever.
    (tmp_path / "long.jsonl").write_text(json.dumps({"prompt": "a" * 100, "completion": "b"}) + "\n")
    with pytest.raises(ConfigError, match=r"none of its 1 rows has a trained token: .*past seq_len=64.*long\.jsonl"):
        build_samples(load_rows(str(tmp_path / "long.jsonl")), tokenizer, LossMaskConfig(), 64)


RAISING = "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}" + (
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
# Renders assistant turns as nothing: every row would train on zero tokens.
DROPS_ASSISTANT = (
    "{% for m in messages %}{% if m['role'] != 'assistant' %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_template(tok_dir, template):
    return load_tokenizer(str(tok_dir), template)


def test_template_that_raises_names_the_row(tmp_path, tok_dir):
    tokenizer = with_template(tok_dir, RAISING)
    (tmp_path / "d.jsonl").write_text(GOOD + "\n" + msgs(("user", "a"), ("tool", "r"), ("assistant", "b")) + "\n")
    with pytest.raises(ConfigError, match=r"d\.jsonl line 2: the chat template failed on messages\[:2\] .*no tools"):
        build_samples(load_rows(str(tmp_path / "d.jsonl")), tokenizer, LossMaskConfig(), 64)


def test_template_that_trains_nothing_is_named(tmp_path, tok_dir):
    tokenizer = with_template(tok_dir, DROPS_ASSISTANT)
    (tmp_path / "d.jsonl").write_text(GOOD + "\n" + GOOD + "\n")
    with pytest.raises(ConfigError, match=r"none of its 2 rows .*renders no text for their trained messages"):
        build_samples(load_rows(str(tmp_path / "d.jsonl")), tokenizer, LossMaskConfig(), 64)


def test_template_that_prints_parts_as_a_repr_is_refused(tmp_path, tokenizer):
    (tmp_path / "d.jsonl").write_text(msgs(("user", [{"type": "text", "text": "ab"}]), ("assistant", "ba")) + "\n")
    with pytest.raises(ConfigError, match=r"line 1: the chat template rendered messages\[0\]\.content.*Python repr"):
        build_samples(load_rows(str(tmp_path / "d.jsonl")), tokenizer, LossMaskConfig(), 64)


def test_packed_loss_never_crosses_a_sample_boundary():
    """Samples of length 1 and samples that would cross a row's end: no trained token is predicted from another
    sample or from padding."""
    rng = np.random.default_rng(1)
    samples = [Sample(np.arange(n) + 1, np.r_[False, np.ones(n - 1, bool)]) for n in rng.integers(1, 17, 60)]
    rows = pack(samples, np.arange(60), seq_len=16)
    total = 0
    for row in rows:
        sid, mask, pos = row.sample_ids[0], row.loss_mask[0], row.position_ids[0]
        assert not mask[0]
        trained = np.flatnonzero(mask)
        assert np.all(sid[trained] == sid[trained - 1]) and np.all(pos[trained] > 0) and np.all(sid[trained] >= 0)
        total += len(trained)
    assert total == sum(int(s.loss_mask.sum()) for s in samples)


@pytest.mark.integration
def test_sft_cli_reports_a_bad_row_in_one_line(tmp_path, tok_dir):
    (tok_dir / "config.json").write_text(json.dumps({**TINY_QWEN3, "vocab_size": 100}))
    data = tmp_path / "data.jsonl"
    data.write_text(GOOD + "\n" + json.dumps({"messages": [{"role": "user", "content": "a"}, "b"]}) + "\n")
    args = ["--model.name", str(tok_dir), "--init.random", "--data.path", str(data), "--output-dir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "prime_trainer.entrypoints.sft", *args, "--seq-len", "64", "--max-steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {data} line 2: messages[1] is a string (expected an object with role and content)"]
    assert "Traceback" not in proc.stderr


def test_directory_of_split_files_reads_only_data_split(tmp_path, caplog):
    """train.jsonl beside test.jsonl: reading both (old code) trains on the test set."""
    (tmp_path / "train.jsonl").write_text(GOOD + "\n")
    (tmp_path / "test-00000.jsonl").write_text(json.dumps({"prompt": "held", "completion": "out"}) + "\n")
    with caplog.at_level(logging.WARNING, logger="prime.sft"):
        assert load_rows(str(tmp_path)) == [json.loads(GOOD)]
    assert "skipping test-00000.jsonl" in caplog.text
    assert load_rows(str(tmp_path), split="test")[0]["prompt"] == "held"
    with pytest.raises(ConfigError, match=r"no files of split 'validation' .*splits: test, train"):
        load_rows(str(tmp_path), split="validation")


def test_deeply_nested_json_is_named(tmp_path):
    (tmp_path / "d.jsonl").write_text(GOOD + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=r"d\.jsonl line 2: JSON nested too deep"):
        load_rows(str(tmp_path / "d.jsonl"))


def test_validation_fraction_that_leaves_no_training_rows(tmp_path, tok_dir):
    from types import SimpleNamespace

    from prime_core.config.trainer import SFTConfig
    from prime_trainer.sft.train import build_data

    (tmp_path / "d.jsonl").write_text(GOOD + "\n")
    config = SFTConfig.model_validate({"data": {"path": str(tmp_path / "d.jsonl")}, "val": {"fraction": 0.1}})
    with pytest.raises(ConfigError, match=r"data.path has 1 rows: val.fraction=0.1 leaves none to train on"):
        build_data(config, str(tok_dir), SimpleNamespace(rank=0, world_size=1))


def test_token_past_the_models_vocab_is_named(tmp_path, tokenizer):
    """A tokenizer with more tokens than the model's embedding (old code: an IndexError traceback on CPU, a device-side
    assert on GPU, at the first step that meets the row)."""
    (tmp_path / "d.jsonl").write_text(GOOD + "\n" + json.dumps({"prompt": "ab", "completion": "~"}) + "\n")
    rows = load_rows(str(tmp_path / "d.jsonl"))
    assert len(build_samples(rows[:1], tokenizer, LossMaskConfig(), 64, vocab_size=96)) == 1
    with pytest.raises(ConfigError, match=r"d\.jsonl line 2: token id 99 \('~'\) is past the model's vocab_size=96"):
        build_samples(rows, tokenizer, LossMaskConfig(), 64, vocab_size=96)


def test_chat_template_path_that_is_missing_or_does_not_parse(tmp_path, tok_dir):
    """A mistyped template path was taken as the template's text (every row rendered as the path itself)."""
    with pytest.raises(ConfigError, match=r"data.chat_template: no such file .*templates/chat\.jinja"):
        load_tokenizer(str(tok_dir), str(tmp_path / "templates/chat.jinja"))
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}{{ m['content'] }}")
    with pytest.raises(ConfigError, match=r"data.chat_template: the chat template does not parse \(line 1: "):
        load_tokenizer(str(tok_dir), str(tmp_path / "bad.jinja"))
    (tmp_path / "ok.jinja").write_text(DROPS_ASSISTANT)
    assert load_tokenizer(str(tok_dir), str(tmp_path / "ok.jinja")).chat_template == DROPS_ASSISTANT


def test_dataset_smaller_than_a_batch_warns_that_steps_repeat_rows(tmp_path, tok_dir, caplog):
    from types import SimpleNamespace

    from prime_core.config.trainer import SFTConfig
    from prime_trainer.sft.train import build_data

    (tmp_path / "d.jsonl").write_text(GOOD + "\n" + GOOD + "\n")
    config = SFTConfig.model_validate({"data": {"path": str(tmp_path / "d.jsonl"), "batch_size": 4}, "seq_len": 64})
    with caplog.at_level(logging.WARNING, logger="prime.sft"):
        data, _ = build_data(config, str(tok_dir), SimpleNamespace(rank=0, world_size=1))
    assert len(data.rows(0)) == 1
    assert "packs into 1 rows of seq_len=64, fewer than data.batch_size=4: every step repeats rows" in caplog.text


def test_save_to_disk_directory_without_the_split(tmp_path, tokenizer):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": "a", "completion": "b"}]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"dd: no split 'train' \(data.split; splits: test\)"):
        load_rows(str(tmp_path / "dd"))
    assert load_rows(str(tmp_path / "dd"), "test") == rows
    # One split saved alone (old code: read as whatever split was asked, training on the test set).
    datasets.Dataset.from_list(rows, split="test").save_to_disk(str(tmp_path / "one"))
    with pytest.raises(ConfigError, match=r"one: holds only split 'test', not data.split='train'"):
        load_rows(str(tmp_path / "one"))
    datasets.Dataset.from_list([{"prompt": "a", "completion": 5}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ConfigError, match=r"bad row 0: completion is a number"):
        build_samples(load_rows(str(tmp_path / "bad")), tokenizer, LossMaskConfig(), 64)


def test_batch_that_does_not_split_over_the_ranks_is_a_config_error():
    """Raised on every rank at the first step: a ConfigError is one line (exit 2), a ValueError was a traceback."""
    samples = [Sample(np.arange(4), np.array([False, True, True, True]))] * 8
    data = PackedData(samples, 16, 4, 1, False, 0)
    with pytest.raises(ConfigError, match=r"data.batch_size=4 must split into 3 ranks x micro_batch_size=1"):
        data.next_batch(0, 3)


# The generation prompt opens a think block that rendered assistant turns do not have.
THINK_PROMPT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>{% endif %}"
)


def test_generation_prompt_that_does_not_start_the_turn_is_named(tmp_path, tok_dir, caplog, monkeypatch):
    import prime_trainer.sft.data as data

    monkeypatch.setattr(data, "_warned_header", False)
    tokenizer = with_template(tok_dir, THINK_PROMPT)
    (tmp_path / "d.jsonl").write_text(GOOD + "\n")
    with caplog.at_level(logging.WARNING, logger="prime.sft"):
        (sample,) = build_samples(load_rows(str(tmp_path / "d.jsonl")), tokenizer, LossMaskConfig(), 64)
    trained = "".join(tokenizer.convert_ids_to_tokens(sample.input_ids[sample.loss_mask].tolist()))
    assert trained == "<|im_start|>assistant\nba<|im_end|>\n"
    assert "d.jsonl line 1: the chat template's generation prompt '<|im_start|>assistant\\n<think>'" in caplog.text


def test_bad_rows_fail_before_the_model_is_built(tmp_path, monkeypatch):
    """A bad row fails before ``common.setup`` (old code: after the model had loaded, minutes for a large one)."""
    import prime_trainer.sft.train as sft_train
    from prime_core.config.trainer import SFTConfig

    def setup(*_args, **_kwargs):
        raise AssertionError("the model was built before the data was read")

    monkeypatch.setattr(sft_train.common, "setup", setup)
    (tmp_path / "d.jsonl").write_text(GOOD + "\n" + msgs(("user", "a"), ("assistant", None)) + "\n")
    config = SFTConfig.model_validate({"data": {"path": str(tmp_path / "d.jsonl")}})
    with pytest.raises(ConfigError, match=r"d\.jsonl line 2: messages\[1\]\.content is missing"):
        sft_train.train(config)


def test_openai_weight_zero_keeps_a_turn_out_of_the_loss(tmp_path, tokenizer):
    """OpenAI's fine-tuning format marks assistant turns not to learn with ``weight: 0`` (old code trained them)."""
    chat = [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "xx", "weight": 0},
        {"role": "user", "content": "cd"},
        {"role": "assistant", "content": "dc", "weight": 1},
    ]
    (tmp_path / "d.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    (sample,) = build_samples(load_rows(str(tmp_path / "d.jsonl")), tokenizer, LossMaskConfig(), 64)
    trained = "".join(tokenizer.convert_ids_to_tokens(sample.input_ids[sample.loss_mask].tolist()))
    assert trained == "dc<|im_end|>\n"
