"""``prime_models.tiny``: the offline tokenizer and config builder the examples ship their models with."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from prime_models.tiny import (
    QWEN_VL_CHAT_TEMPLATE,
    QWEN_VL_SPECIAL_TOKENS,
    byte_bpe_tokenizer,
    tiny_qwen3_vl_config,
)

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ["reverse the text: cat dog", "<reversed>god tac</reversed>", "a red circle and a blue square"] * 10


def test_special_tokens_take_the_first_ids_and_any_text_round_trips():
    tok = byte_bpe_tokenizer(CORPUS, QWEN_VL_SPECIAL_TOKENS, chat_template=QWEN_VL_CHAT_TEMPLATE, vocab_size=300)
    assert tok.convert_tokens_to_ids(QWEN_VL_SPECIAL_TOKENS) == list(range(len(QWEN_VL_SPECIAL_TOKENS)))
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    text = "unseen: Zebra ñandú 42 ✓"
    assert tok.decode(tok(text)["input_ids"]) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which shape?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert (
        prompt
        == "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>which shape?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_named_tokens_must_be_special_tokens():
    with pytest.raises(ValueError, match="<s>"):
        byte_bpe_tokenizer(CORPUS, ["<|endoftext|>", "<|im_end|>"], chat_template="", bos_token="<s>")


def test_vl_config_takes_vocabulary_and_ids_from_the_tokenizer():
    tok = byte_bpe_tokenizer(CORPUS, QWEN_VL_SPECIAL_TOKENS, chat_template=QWEN_VL_CHAT_TEMPLATE, vocab_size=300)
    config = tiny_qwen3_vl_config(tokenizer=tok)
    assert config.text_config.vocab_size == len(tok)
    assert config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert (config.eos_token_id, config.text_config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    bare = tiny_qwen3_vl_config(vocab_size=300)
    assert (bare.image_token_id, bare.vision_end_token_id) == (296, 299)


def test_color_shapes_make_model_writes_the_shipped_base(tmp_path):
    shipped = ROOT / "examples" / "color_shapes" / "base"
    script = ROOT / "examples" / "color_shapes" / "make_model.py"
    result = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(p.name for p in shipped.iterdir() if p.name != "STABLE")
    for name in written:
        assert (tmp_path / name).read_bytes() == (shipped / name).read_bytes(), name


def test_extend_base_writes_the_examples_derived_bases(tmp_path):
    from prime_models.tiny import extend_base

    source = ROOT / "examples" / "reverse_text" / "base"
    assert extend_base(source, tmp_path / "gn", ["<guess>", "</guess>"]) == 103
    assert extend_base(source, tmp_path / "code", ["    "], max_positions=1024) == 102
    for name, shipped in (("gn", "guess_number"), ("code", "code")):
        for path in (ROOT / "examples" / shipped / "base").iterdir():
            written = (tmp_path / name / path.name).read_text()
            if path.name == "tokenizer_config.json":
                # The tests run with HF_HUB_OFFLINE=1 (conftest), which the tokenizer records in its config.
                written = written.replace('"local_files_only": true', '"local_files_only": false')
            assert written == path.read_text(), (shipped, path.name)
