"""Build the tool-use example's base model directory: the reverse-text base (Qwen3 config, character-level
tokenizer) with single tokens for the tool-call markup and a chat template that renders tool calls and results.

    uv run python examples/tool_use/make_base.py --out examples/tool_use/base

The template writes a call as Qwen3 does, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the
``qwen3`` tool parser reads it back), and a tool result as a user turn ``<tool_response>...</tool_response>``, the
result right-aligned in 12 characters. The SFT answers are right-aligned the same way (``<answer>       15201
</answer>``; the environment's parser strips the spaces), so copying the result is a copy over a fixed distance,
which a 4-layer model learns in a few hundred steps; results of 3 to 8 characters copied as they come it had not
learned after 500 steps. It does not render the tool schemas: the model learns the one tool's name from its SFT
data, and the prompts stay short for a 512-position model. Deterministic: re-running writes identical files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prime_models.tiny import extend_base

ROOT = Path(__file__).resolve().parents[2]
REVERSE_TEXT_BASE = ROOT / "examples" / "reverse_text" / "base"
# Single tokens, so that a 1.6M-parameter model learns the format in a few hundred steps.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<answer>", "</answer>"]

CHAT_TEMPLATE = (
    "{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>' + ('%12s' | format(m['content'])) + '</tool_response><|im_end|>\\n' }}"
    "{%- elif m['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + (m['content'] or '') }}"
    "{%- for tc in m['tool_calls'] or [] %}"
    "{%- set args = tc['function']['arguments'] %}"
    "{{- '<tool_call>{\"name\": \"' + tc['function']['name'] + '\", \"arguments\": ' }}"
    "{{- args if args is string else args | tojson }}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "base")
    args = parser.parse_args()
    vocab = extend_base(REVERSE_TEXT_BASE, args.out, TOOL_TOKENS, chat_template=CHAT_TEMPLATE)
    print(f"wrote {args.out}: vocabulary {vocab}")


if __name__ == "__main__":
    main()
