"""Shared test fixtures-in-code: a locally built ChatML tokenizer, a tiny Qwen3 config, a free port."""

from __future__ import annotations

import socket

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_chatml_tokenizer(corpus: list[str], vocab_size: int = 400):
    """A byte-level BPE tokenizer trained on ``corpus`` with ChatML special tokens (no hub access)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def tiny_decoder_fields(tokenizer, *, max_position_embeddings: int) -> dict:
    """Config fields of a 2-layer decoder sized for CPU tests, with the tokenizer's vocabulary and special ids."""
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
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
# Qwen3-VL's rendering of content parts: an image part becomes one <|image_pad|>, which the processor expands.
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_vl_chatml_tokenizer(corpus: list[str], vocab_size: int = 400):
    """``build_chatml_tokenizer`` plus Qwen-VL's vision special tokens and a chat template that renders images."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=VL_SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=VL_CHAT_TEMPLATE
    )


def tiny_qwen3_vl_config(*, vocab_size: int = 300, tokenizer=None, max_position_embeddings: int = 1024, **text):
    """A Qwen3-VL config for CPU tests: 3-layer LM (hidden 64), 3-block ViT (hidden 32, 4x4 patches, merge 2), two
    DeepStack layers. With ``tokenizer`` the vocabulary and special ids come from it."""
    from transformers import Qwen3VLConfig

    ids = {"image_token_id": vocab_size - 4, "video_token_id": vocab_size - 3}
    ids |= {"vision_start_token_id": vocab_size - 2, "vision_end_token_id": vocab_size - 1}
    extra = {}
    if tokenizer is not None:
        vocab_size = len(tokenizer)
        ids = {
            "image_token_id": tokenizer.convert_tokens_to_ids("<|image_pad|>"),
            "video_token_id": tokenizer.convert_tokens_to_ids("<|video_pad|>"),
            "vision_start_token_id": tokenizer.convert_tokens_to_ids("<|vision_start|>"),
            "vision_end_token_id": tokenizer.convert_tokens_to_ids("<|vision_end|>"),
        }
        extra = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    text_config = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 3, 3],
                         "mrope_interleaved": True},
        **{k: v for k, v in extra.items() if k == "pad_token_id"},
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
    cfg = Qwen3VLConfig(text_config=text_config, vision_config=vision_config, tie_word_embeddings=False, **ids)
    if "eos_token_id" in extra:
        cfg.eos_token_id = extra["eos_token_id"]
    return cfg


def write_tiny_vl_model_dir(path, corpus: list[str], *, image_size: int = 32):
    """A config-only Qwen3-VL dir (random init by whoever loads it): VL tokenizer trained on ``corpus``, config.json
    and a preprocessor_config.json that keeps ``image_size`` square images at their size (4x4 patches, merge 2)."""
    import json
    from pathlib import Path

    from prime_core.vision import ImageProcessor

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vl_chatml_tokenizer(corpus)
    tokenizer.save_pretrained(path)
    tiny_qwen3_vl_config(tokenizer=tokenizer).save_pretrained(path)
    processor = ImageProcessor(patch_size=4, merge_size=2, min_pixels=image_size**2, max_pixels=image_size**2)
    (path / "preprocessor_config.json").write_text(json.dumps(processor.to_dict(), indent=2))
    return path, tokenizer
