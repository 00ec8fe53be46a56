"""Write the color-shapes example's base: a tiny Qwen3-VL config, its tokenizer and image preprocessor (no weights).

    uv run python examples/color_shapes/make_model.py --out examples/color_shapes/base

``sft.toml`` trains ``model/`` from random init of this directory. Language model: 3 layers, hidden 64; vision tower:
3 ViT blocks, hidden 32, 4x4 patches merged 2x2 (a 32x32 image is 16 LM tokens), two DeepStack layers
(``prime_models.tiny.tiny_qwen3_vl_config``). The tokenizer is a byte-level BPE (500 tokens at most) trained on the
environment's prompts, with the special tokens the ``qwen3-vl`` renderer reads
(``prime_models.tiny.byte_bpe_tokenizer``). Deterministic: re-running writes identical files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def build_tokenizer(vocab_size: int = 500):
    """Byte-level BPE trained on the environment's prompts and answers, with the Qwen-VL special tokens."""
    import color_shapes
    from prime_models.tiny import QWEN_VL_CHAT_TEMPLATE, QWEN_VL_SPECIAL_TOKENS, byte_bpe_tokenizer

    corpus = [color_shapes.SYSTEM_PROMPT]
    corpus += [f"{e['question']} {e['completion']}" for e in color_shapes.generate_examples(500, seed=7)]
    return byte_bpe_tokenizer(
        corpus, QWEN_VL_SPECIAL_TOKENS, chat_template=QWEN_VL_CHAT_TEMPLATE, vocab_size=vocab_size
    )


def main() -> None:
    from prime_core.vision import ImageProcessor
    from prime_models.tiny import tiny_qwen3_vl_config
    from transformers import GenerationConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "base")
    parser.add_argument("--image-size", type=int, default=32, help="the environment's image_size")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(args.out)
    config = tiny_qwen3_vl_config(tokenizer=tokenizer)
    config.architectures, config.dtype = ["Qwen3VLForConditionalGeneration"], "float32"
    config.save_pretrained(args.out)
    GenerationConfig.from_model_config(config).save_pretrained(args.out)
    size = args.image_size**2  # keep the environment's square images at their size
    processor = ImageProcessor(patch_size=4, merge_size=2, min_pixels=size, max_pixels=size)
    (args.out / "preprocessor_config.json").write_text(json.dumps(processor.to_dict(), indent=2) + "\n")
    print(f"wrote {args.out}: vocabulary {len(tokenizer)}")


if __name__ == "__main__":
    main()
