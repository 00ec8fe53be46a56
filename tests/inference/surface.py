"""Fixtures-in-code for the OpenAI-surface tests: a tokenizer with Qwen3's reasoning and tool-call tokens and a
Qwen3-style chat template (tools in the system turn, ``<think>`` history, tool calls whose arguments the template
iterates, an empty think block opening the answer when ``enable_thinking`` is false), a tiny model on it, and a test
engine that answers with fixed text."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

from prime_inference.engines.base import Engine, EngineInfo, EngineOutput, EngineRequest

from tests.tiny import build_chatml_tokenizer

from .helpers import CORPUS, save_model

MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
SURFACE_CORPUS = [*CORPUS, 'get_weather {"city": "Paris", "unit": "celsius"} I should call the tool. Hello!'] * 5

# Qwen3's layout, written for these tests: iterating ``arguments.items()`` fails unless the server decoded the
# arguments' JSON string (what vLLM does before templating).
QWEN3_STYLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n"
    "{% endif %}# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' %}{% if not loop.first %}<|im_start|>system\n{{ m['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{%- elif m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{%- if m['reasoning_content'] %}<think>\n{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ m['content'] or '' }}"
    "{%- for tc in m['tool_calls'] or [] %}<tool_call>\n{{ '{' }}\"name\": \"{{ tc['function']['name'] }}\", "
    "\"arguments\": {{ '{' }}{% for k, v in tc['function']['arguments'].items() %}\"{{ k }}\": {{ v | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}{{ '}}' }}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "kelvin"]}},
                "required": ["city"],
            },
        },
    }
]
# The same tool with arguments a grammar bounds (no free string, no extra keys): under a forced call a random-init
# model's output then closes within a few tokens on any backend, instead of running to max_tokens inside a string.
BOUNDED_TOOLS = [
    {
        "type": "function",
        "function": {
            **TOOLS[0]["function"],
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
THINK_TEXT = "<think>\nI should call the tool.\n</think>\n\n"
ANSWER_TEXT = "Hello!"


def build_surface_tokenizer():
    tokenizer = build_chatml_tokenizer(SURFACE_CORPUS, vocab_size=420)
    tokenizer.add_tokens(MARKERS)  # Qwen3's are added tokens that are not special: they survive decoding
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    return tokenizer


def save_surface_model(path: Path, seed: int = 0) -> Path:
    return save_model(path, build_surface_tokenizer(), seed=seed, max_position_embeddings=1024)


class FixedTextEngine(Engine):
    """A test engine that answers every prompt with ``reply(prompt_text)`` then EOS, one token per delta (so
    streams see every step), honouring max_tokens and stop_token_ids; every log-prob is -0.25."""

    name = "fixed"

    def __init__(self, tokenizer, reply: Callable[[str], str], max_model_len: int = 512):
        self.tokenizer, self.reply = tokenizer, reply
        self._info = EngineInfo(engine=self.name, model="fixed", max_model_len=max_model_len, vocab_size=len(tokenizer))
        self.prompts: list[str] = []

    @property
    def info(self) -> EngineInfo:
        return self._info

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        prompt = self.tokenizer.decode(request.prompt_ids)
        self.prompts.append(prompt)
        ids = [*self.tokenizer.encode(self.reply(prompt), add_special_tokens=False), self.tokenizer.eos_token_id]
        params = request.params
        for i, token in enumerate(ids[: params.max_tokens]):
            finish = reason = None
            if token in params.stop_token_ids:
                finish, reason = "stop", token
            elif i == len(ids) - 1:
                finish = "stop"
            elif i == params.max_tokens - 1:
                finish = "length"
            lps = [-0.25] if params.logprobs is not None else None
            yield EngineOutput([token], lps, [{}] if lps else None, finish, reason)
            if finish is not None:
                return

    async def update_weights(self, weight_dir: str, step: int | None) -> None: ...

    async def reload_weights(self) -> None: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...
