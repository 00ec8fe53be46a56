"""Write the color-shapes example's model: a random-init tiny Qwen3-VL (no training) for the CPU pipeline run.

    uv run python examples/color_shapes/make_model.py --out examples/color_shapes/model

Language model: 3 layers, hidden 64; vision tower: 3 ViT blocks, hidden 32, 4x4 patches merged 2x2 (a 32x32 image
is 16 LM tokens), two DeepStack layers. The tokenizer is a byte-level BPE (500 tokens) trained on the environment's
prompts, with the special tokens the ``qwen3-vl`` renderer reads. Deterministic: re-running writes identical files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
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

# ChatML; an image part renders as one <|image_pad|> between the vision markers, which the processor expands.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}{% if part['type'] in ('image', 'image_url') %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(vocab_size: int = 500):
    import color_shapes
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [color_shapes.SYSTEM_PROMPT]
    corpus += [f"{e['question']} {e['completion']}" for e in color_shapes.generate_examples(500, seed=7)]
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


def build_config(tokenizer):
    from transformers import Qwen3VLConfig

    text_config = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "pad_token_id": tokenizer.pad_token_id,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000.0,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
    }
    vision_config = {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 64,
        "num_position_embeddings": 16,
        "deepstack_visual_indexes": [0, 1],
    }
    ids = {
        name: tokenizer.convert_tokens_to_ids(token)
        for name, token in [
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        ]
    }
    config = Qwen3VLConfig(text_config=text_config, vision_config=vision_config, tie_word_embeddings=False, **ids)
    config.eos_token_id = tokenizer.eos_token_id
    return config


def main() -> None:
    import torch
    from prime_core.vision import ImageProcessor
    from transformers import Qwen3VLForConditionalGeneration

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "model")
    parser.add_argument("--image-size", type=int, default=32, help="the environment's image_size")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(args.out)
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(build_config(tokenizer))
    with torch.no_grad():  # spread the logits so that sampling is not uniform noise
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(args.out)
    size = args.image_size**2  # keep the environment's square images at their size
    processor = ImageProcessor(patch_size=4, merge_size=2, min_pixels=size, max_pixels=size)
    (args.out / "preprocessor_config.json").write_text(json.dumps(processor.to_dict(), indent=2) + "\n")
    print(f"wrote {args.out} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)")


if __name__ == "__main__":
    main()
