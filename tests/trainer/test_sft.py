"""SFT data pipeline (formats, role masks, prefix property, packing) and an end-to-end run that lowers val loss."""

import json

import numpy as np
import pytest
from prime_core.config import ConfigError
from prime_core.config.trainer import LossMaskConfig
from prime_core.run_dir import RunDir
from prime_trainer.sft.data import (
    PackedData,
    PrefixPropertyError,
    Sample,
    load_rows,
    load_tokenizer,
    pack,
    to_messages,
    tokenize_conversation,
)

from tests.trainer.trainer_utils import (
    STRIPPING_TEMPLATE,
    TINY_QWEN3,
    read_trainer_metrics,
    run_cli,
    write_char_tokenizer,
    write_reverse_dataset,
)

CHAT = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "abc"},
    {"role": "assistant", "content": "cba"},
    {"role": "user", "content": "de"},
    {"role": "assistant", "content": "ed"},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(str(write_char_tokenizer(tmp_path_factory.mktemp("tok"))), None)


def trained_text(tokenizer, ids, mask):
    return "".join(tokenizer.convert_ids_to_tokens(i) for i, m in zip(ids, mask, strict=True) if m)


def test_assistant_only_mask_excludes_role_headers(tokenizer):
    ids, mask = tokenize_conversation(tokenizer, CHAT, None, LossMaskConfig())
    assert trained_text(tokenizer, ids, mask) == "cba<|im_end|>\ned<|im_end|>\n"
    ids, mask = tokenize_conversation(tokenizer, CHAT, None, LossMaskConfig(user=True))
    assert trained_text(tokenizer, ids, mask).startswith("<|im_start|>user\nabc<|im_end|>\ncba")


def test_messages_wins_and_equals_prompt_completion(tokenizer):
    pc = {"prompt": "abc", "completion": "cba"}
    both = {**pc, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    assert to_messages(both, 0)[0][0]["content"] == "x"
    msgs = {"messages": [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "cba"}]}
    a = tokenize_conversation(tokenizer, *to_messages(pc, 0), LossMaskConfig())
    b = tokenize_conversation(tokenizer, *to_messages(msgs, 0), LossMaskConfig())
    assert a == b


def test_prefix_property_violation_names_the_message(tokenizer):
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = STRIPPING_TEMPLATE
    with pytest.raises(PrefixPropertyError, match=r"adding message 3 \(role 'user'\)"):
        tokenize_conversation(tokenizer, CHAT, None, LossMaskConfig())


def test_load_rows_formats(tmp_path):
    rows = [{"prompt": "ab", "completion": "ba"}, {"prompt": "cd", "completion": "dc"}]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_rows(str(tmp_path / "d.jsonl")) == rows == load_rows(str(tmp_path / "d.parquet"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "dataset_dict.json").write_text("{}")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="needs the `datasets` package"):
            load_rows(str(tmp_path / "hf"))


def test_packing_keeps_samples_whole():
    rng = np.random.default_rng(0)
    samples = [Sample(np.arange(n), np.r_[False, np.ones(n - 1, bool)]) for n in rng.integers(2, 9, 40)]
    rows = pack(samples, np.arange(40), seq_len=16)
    seen = 0
    for row in rows:
        ids = row.sample_ids[0]
        for sid in np.unique(ids[ids >= 0]):
            span = np.flatnonzero(ids == sid)
            assert len(span) == len(samples[sid].input_ids) and np.all(np.diff(span) == 1)
            assert row.position_ids[0, span].tolist() == list(range(len(span)))
            seen += 1
    assert seen == 40
    # Resuming the data position reproduces the following batches.
    a = PackedData(samples, 16, 4, 1, True, 0)
    for _ in range(3):
        a.next_batch(0, 1)
    b = PackedData(samples, 16, 4, 1, True, 0)
    b.load_state(a.state())
    for _ in range(4):
        assert all(
            np.array_equal(x.input_ids, y.input_ids)
            for x, y in zip(a.next_batch(0, 1), b.next_batch(0, 1), strict=True)
        )


@pytest.mark.integration
def test_sft_lowers_validation_loss(tmp_path):
    model_dir = write_char_tokenizer(tmp_path / "model")
    (model_dir / "config.json").write_text(json.dumps({**TINY_QWEN3, "vocab_size": 100}))
    data = write_reverse_dataset(tmp_path / "reverse.jsonl", 300)
    out = tmp_path / "out"
    run_cli(
        [
            "--model.name",
            str(model_dir),
            "--init.random",
            "--data.path",
            str(data),
            "--output-dir",
            str(out),
            "--seq-len",
            "64",
            "--max-steps",
            "40",
            "--data.batch-size",
            "4",
            "--optim.lr",
            "3e-3",
            "--val.fraction",
            "0.1",
            "--val.interval",
            "40",
            "--log.level",
            "warning",
        ],
        module="prime_trainer.entrypoints.sft",
    )
    records = [r.values for r in __import__("prime_core.monitor", fromlist=["x"]).read_metrics(out / "metrics.jsonl")]
    val = [r["val/loss"] for r in records if r.get("val/loss") is not None]
    assert len(val) == 2 and val[-1] < val[0] - 1.0, val
    assert read_trainer_metrics(out, "sft")[39]["loss/mean"] < 3.0
    final = RunDir(out).weight_step(40)
    assert (final / "tokenizer.json").is_file() and (final / "model.safetensors").is_file()
