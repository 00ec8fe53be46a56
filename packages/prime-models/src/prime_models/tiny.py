"""Tiny models built offline, for examples that ship their own model and for CPU tests (nothing downloaded).

`byte_bpe_tokenizer` trains a byte-level BPE tokenizer on a corpus with chat special tokens (the shape of Qwen's
tokenizers, at a few hundred tokens); `tiny_qwen3_vl_config` is a Qwen3-VL config small enough to train on a CPU;
`extend_base` derives a model directory from another with more single tokens.
All are deterministic: the same arguments write the same files.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

CHATML_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Every special token `renderers`' ``qwen3-vl`` renderer reads: ChatML, tool calls and results, thinking, vision.
QWEN_VL_SPECIAL_TOKENS = [
    *CHATML_SPECIAL_TOKENS,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

TINY_DECODER_FIELDS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
"""The tiny decoders' shape (HF config fields): hidden 64, 4 query heads and 2 KV heads of 16, MLP 128."""

# ChatML; an image part renders as one <|image_pad|> between the vision markers, which the processor expands.
QWEN_VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_bpe_tokenizer(
    corpus: Iterable[str],
    special_tokens: list[str],
    *,
    chat_template: str,
    vocab_size: int = 400,
    eos_token: str = "<|im_end|>",
    pad_token: str = "<|endoftext|>",
    bos_token: str | None = None,
) -> Any:
    """A `transformers` fast tokenizer: byte-level BPE trained on ``corpus`` to ``vocab_size`` tokens.

    ``special_tokens`` take the first ids, in order; the byte alphabet is always in the vocabulary, so any text
    encodes. ``eos_token``, ``pad_token`` and ``bos_token`` name tokens of ``special_tokens``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    named = [t for t in (eos_token, pad_token, bos_token) if t is not None]
    if missing := [t for t in named if t not in special_tokens]:
        raise ValueError(f"{missing} are not among the special tokens {special_tokens}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    bos = {"bos_token": bos_token} if bos_token is not None else {}
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=eos_token, pad_token=pad_token, chat_template=chat_template, **bos
    )


def tiny_qwen3_vl_config(
    *, tokenizer: Any = None, vocab_size: int = 300, max_position_embeddings: int = 1024, **text: Any
) -> Any:
    """A Qwen3-VL config: 3-layer language model (hidden 64), 3-block ViT (hidden 32, 4x4 patches, merge 2), two
    DeepStack layers. A 32x32 image is 16 language-model tokens.

    With ``tokenizer`` (one holding the vision tokens, e.g. from `byte_bpe_tokenizer` with `QWEN_VL_SPECIAL_TOKENS`)
    the vocabulary and the special ids come from it; without, the last 4 ids of ``vocab_size`` are the vision ids.
    ``text`` overrides fields of the language model's config.
    """
    from transformers import Qwen3VLConfig

    names = ["image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"]
    tokens = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]
    if tokenizer is None:
        ids = {name: vocab_size - 4 + i for i, name in enumerate(names)}
        special = {}
    else:
        vocab_size = len(tokenizer)
        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in zip(names, tokens, strict=True)}
        special = {"pad_token_id": tokenizer.pad_token_id}
    text_config = dict(
        vocab_size=vocab_size,
        **TINY_DECODER_FIELDS,
        num_hidden_layers=3,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True},
        **special,
        **text,
    )  # fmt: skip
    vision_config = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,
        num_position_embeddings=16,
        deepstack_visual_indexes=[0, 1],
    )
    config = Qwen3VLConfig(text_config=text_config, vision_config=vision_config, tie_word_embeddings=False, **ids)
    if tokenizer is not None:
        config.eos_token_id = tokenizer.eos_token_id
    return config


__all__ = [
    "CHATML_SPECIAL_TOKENS",
    "QWEN_VL_CHAT_TEMPLATE",
    "QWEN_VL_SPECIAL_TOKENS",
    "TINY_DECODER_FIELDS",
    "byte_bpe_tokenizer",
    "tiny_qwen3_vl_config",
]


def extend_base(
    source: Path | str,
    out: Path | str,
    tokens: list[str],
    *,
    chat_template: str | None = None,
    max_positions: int | None = None,
) -> int:
    """Write a model directory (config, tokenizer, generation config; no weights) at ``out`` from the one at
    ``source`` with ``tokens`` added as single tokens, and optionally another chat template or position count. The
    examples derive their bases from the reverse-text one this way; returns the new vocabulary size."""
    from transformers import AutoTokenizer

    source, out = Path(source), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_tokens(tokens)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if max_positions is not None:
        tokenizer.model_max_length = max_positions
    tokenizer.save_pretrained(out)
    config = json.loads((source / "config.json").read_text())
    config["vocab_size"] = len(tokenizer)
    if max_positions is not None:
        config["max_position_embeddings"] = max_positions
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation_config = source / "generation_config.json"
    if generation_config.is_file():
        (out / generation_config.name).write_text(generation_config.read_text())
    return len(tokenizer)
