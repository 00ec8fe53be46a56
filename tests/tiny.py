"""Shared test fixtures-in-code: a locally built ChatML tokenizer (``prime_models.tiny``), a tiny Qwen3 config, a
free port."""

from __future__ import annotations

import socket

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_chatml_tokenizer(corpus: list[str], vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on ``corpus`` with ChatML special tokens (no hub access)."""
    from prime_models.tiny import byte_bpe_tokenizer

    return byte_bpe_tokenizer(corpus, SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, vocab_size=vocab_size)


def tiny_decoder_fields(tokenizer, *, max_position_embeddings: int) -> dict:
    """Config fields of a 2-layer decoder sized for CPU tests, with the tokenizer's vocabulary and special ids."""
    from prime_models.tiny import TINY_DECODER_FIELDS

    return dict(
        vocab_size=len(tokenizer),
        **TINY_DECODER_FIELDS,
        num_hidden_layers=2,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def tiny_qwen3_config(tokenizer, *, max_position_embeddings: int):
    """A 2-layer Qwen3 config sized for CPU tests, with the tokenizer's vocabulary and special ids."""
    from transformers import Qwen3Config

    return Qwen3Config(
        **tiny_decoder_fields(tokenizer, max_position_embeddings=max_position_embeddings), bos_token_id=None
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- vision-language (Qwen3-VL)

VL_SPECIAL_TOKENS = [*SPECIAL_TOKENS, "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_vl_chatml_tokenizer(corpus: list[str], vocab_size: int = 400):
    """``build_chatml_tokenizer`` plus Qwen-VL's vision special tokens and a chat template that renders images."""
    from prime_models.tiny import QWEN_VL_CHAT_TEMPLATE, byte_bpe_tokenizer

    return byte_bpe_tokenizer(corpus, VL_SPECIAL_TOKENS, chat_template=QWEN_VL_CHAT_TEMPLATE, vocab_size=vocab_size)


def write_tiny_vl_model_dir(path, corpus: list[str], *, image_size: int = 32):
    """A config-only Qwen3-VL dir (random init by whoever loads it): VL tokenizer trained on ``corpus``, config.json
    and a preprocessor_config.json that keeps ``image_size`` square images at their size (4x4 patches, merge 2)."""
    import json
    from pathlib import Path

    from prime_core.vision import ImageProcessor
    from prime_models.tiny import tiny_qwen3_vl_config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vl_chatml_tokenizer(corpus)
    tokenizer.save_pretrained(path)
    tiny_qwen3_vl_config(tokenizer=tokenizer).save_pretrained(path)
    processor = ImageProcessor(patch_size=4, merge_size=2, min_pixels=image_size**2, max_pixels=image_size**2)
    (path / "preprocessor_config.json").write_text(json.dumps(processor.to_dict(), indent=2))
    return path, tokenizer
