"""Build the base model for environments you bring: a tiny Qwen3 (random weights, 4,096 positions) whose tokenizer
and chat template have Qwen3's shape, so any verifiers environment's prompts, tool schemas, tool calls and reasoning
render as they would for a real Qwen3 model.

    uv run python examples/bring_your_own/make_base.py --out examples/bring_your_own/model

- Tokenizer: byte-level BPE (any text encodes) with Qwen3's special tokens: ChatML, ``<tool_call>``,
  ``<tool_response>`` and ``<think>`` markers. ``client.renderer = "auto"`` therefore picks ``renderers``' ``qwen3``
  renderer for token-in rollouts, and the inference server's chat route renders with the template below.
- Chat template: Qwen3's format, written here: tool schemas in the system turn, calls as
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, results as a user turn of ``<tool_response>`` blocks,
  ``reasoning_content`` as a ``<think>`` block after the last user query, ``enable_thinking=False`` prefilling an
  empty one.
- Weights: random (seed 0), 0.12M parameters, saved so that trainer and inference start from the same ones. The model
  knows nothing: it is for running an environment end to end on a CPU (eval, vf-eval, a few rl steps), not for
  learning it. Deterministic: re-running writes identical files.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
                  "</tool_response>", "<think>", "</think>"]  # fmt: skip
MAX_POSITIONS = 4096
VOCAB_SIZE = 1024

CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' and not (m.content is string and "
    "m.content.startswith('<tool_response>')) %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with "
    "function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages and messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role in ('user', 'system') %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content or '' %}"
    "{%- set reasoning = m.reasoning_content or '' %}"
    "{%- if not reasoning and '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if reasoning and loop.index0 > ns.last_query %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- content.lstrip('\\n') }}"
    "{%- for tc in m.tool_calls or [] %}"
    "{%- set f = tc.function if tc.function is defined else tc %}"
    "{%- if not loop.first or content %}{{- '\\n' }}{%- endif %}"
    '{{- \'<tool_call>\\n{"name": "\' + f.name + \'", "arguments": \' }}'
    "{{- f.arguments if f.arguments is string else f.arguments | tojson }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

# What the tokenizer's merges are learned from: the prose, JSON and code third-party prompts are made of.
CORPUS = [
    "You are a helpful assistant. Answer the question, then stop. Think step by step before you answer.",
    "The user asks a question; the assistant calls a tool, reads the result and answers inside <answer></answer>.",
    'Call a tool as {"name": "search", "arguments": {"query": "weather in Paris", "limit": 3}}.',
    '{"type": "function", "function": {"name": "bash", "description": "Run a shell command.", "parameters": '
    '{"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}',
    "def solve(numbers: list[int]) -> int:\n    return sum(n * n for n in numbers if n % 2 == 0)\n",
    "echo 42 > answer.txt && cat answer.txt; ls -la /tmp; python3 -c 'print(1 + 2)'",
    "What is 12 plus 30? The answer is 42. Reverse the text: hello world -> dlrow olleh.",
    "Guess the number between 1 and 100. Higher. Lower. Correct! You win; the other player loses.",
    "Name one animal, fruit, color, city, tool or tree: cat, apple, violet, Lisbon, hammer, maple.",
    "Question: Is the response correct? Respond with ONLY a JSON object: "
    '{"verdicts": [{"name": "correct", "reason": "it matches", "verdict": "yes"}]}',
] * 8

MODEL_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": MAX_POSITIONS,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "use_cache": True,
    "torch_dtype": "float32",
}


def build(out: Path, seed: int = 0) -> int:
    """Write the model directory; returns its parameter count."""
    import torch
    from prime_models.tiny import byte_bpe_tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = byte_bpe_tokenizer(CORPUS, SPECIAL_TOKENS, chat_template=CHAT_TEMPLATE, vocab_size=VOCAB_SIZE)
    tokenizer.model_max_length = MAX_POSITIONS
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    config = Qwen3Config(
        **MODEL_CONFIG,
        vocab_size=len(tokenizer),
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    generation = {"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "model")
    args = parser.parse_args()
    print(f"wrote {args.out}: {build(args.out) / 1e6:.2f}M parameters")


if __name__ == "__main__":
    main()
