"""Build the reverse-text example's base model directory: a Qwen3 config and a character-level tokenizer.

The directory holds config.json, generation_config.json and the tokenizer (no weights): `sft` builds random
weights from the config and trains them (see README.md). Deterministic: re-running writes identical files.

    uv run python examples/reverse_text/make_base.py --out examples/reverse_text/base
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The answer tags are single tokens so that a tiny model learns the format quickly.
TAG_TOKENS = ["<reversed>", "</reversed>"]
CHARACTERS = list(string.printable[:95]) + ["\n"]  # digits, letters, punctuation, space, newline

# ChatML, as Qwen3 uses it (without the thinking blocks).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

MODEL_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 48,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "float32",
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + TAG_TOKENS + CHARACTERS)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    # Every character is its own word; the decoder glues them back without separators.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
    )
    fast.add_tokens(TAG_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "base")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(args.out)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = dict(MODEL_CONFIG, vocab_size=len(tokenizer), eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    (args.out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {"eos_token_id": eos, "pad_token_id": pad, "do_sample": False}
    (args.out / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    print(f"wrote {args.out} (vocab {len(tokenizer)})")


if __name__ == "__main__":
    main()
