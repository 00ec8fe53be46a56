"""A prompt that no context of the model holds is refused before the renderer tokenizes it.

An environment that answers a turn with an enormous message (a tool's or a program's output it relays, a file it
reads whole) had the renderer tokenize all of it in the env worker, in verifiers' renderer thread: the fast tokenizers
are superlinear on long words (4 MB of text took 6 s, 100 MB ran past the rollout's timeout and on after it, as a
thread cannot be cancelled) and hold gigabytes of token ids, while every other rollout of that worker waited for the
renderer's lock; all to build a prompt the inference server then refuses as longer than its context.

That outcome is known without tokenizing: no token covers more characters than the vocabulary's longest entry, so
messages holding more than ``context x longest x SLACK`` characters are over any context the model serves. Their render
raises what the server answers for an over-long prompt (a 400 ``ProviderError`` naming the maximum context length):
verifiers ends the episode there as it does on the server's refusal, and as vf-eval does against vLLM, at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SLACK = 4
"""Normalizers that compose characters (NFC: a letter and its combining marks into one) shrink the text before it is
split; a factor of 4 keeps the bound below any prompt a served context holds."""

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def context_ceiling(model_dir: str) -> int | None:
    """The most tokens the model at ``model_dir`` serves (its config's positions, times a rope scaling's factor), or
    None when that is unknown (not a local directory, no such field): then nothing is refused here."""
    from prime_core.io import SMALL_JSON_BYTES, read_json

    try:
        config = read_json(Path(model_dir) / "config.json", "a model config", SMALL_JSON_BYTES)
    except (OSError, ValueError):  # UnreadableFile (not JSON, a FIFO) is a ValueError
        return None
    if not isinstance(config, dict):
        return None
    configs = [c for c in (config, config.get("text_config")) if isinstance(c, dict)]
    for cfg in configs:
        positions = next((cfg[k] for k in _CONTEXT_KEYS if isinstance(cfg.get(k), int) and cfg[k] > 0), None)
        if positions is not None:
            scaling = cfg.get("rope_scaling") or {}
            factor = scaling.get("factor") if isinstance(scaling, dict) else None
            return int(positions * max(1.0, float(factor))) if isinstance(factor, int | float) else positions
    return None


def message_chars(messages: Any) -> int:
    """Characters of the text a template renders of ``messages``: contents (text parts), reasoning, tool calls."""
    total = 0
    for message in messages if isinstance(messages, list | tuple) else ():
        if not isinstance(message, dict):
            message = getattr(message, "__dict__", {})
        for key in ("content", "reasoning_content", "name"):
            total += _text_chars(message.get(key))
        for call in message.get("tool_calls") or ():
            function = call.get("function", call) if isinstance(call, dict) else {}
            for part in (function.get("name"), function.get("arguments")):
                total += len(part) if isinstance(part, str) else len(json.dumps(part, default=str)) if part else 0
    return total


def _text_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list | tuple):
        return sum(_text_chars(part.get("text") if isinstance(part, dict) else part) for part in value)
    return 0


def bound_prompts(renderer: Any, tokenizer: Any, model_dir: str) -> None:
    """Have ``renderer``'s ``render``/``render_ids``/``bridge_to_next_turn`` refuse messages no context holds."""
    from verifiers.v1.errors import ProviderError

    ceiling = context_ceiling(model_dir)
    if ceiling is None:
        return
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    except Exception:  # a custom tokenizer without a readable vocabulary: no bound, as without a config
        return
    if longest <= 0:
        return
    per_token = longest * SLACK

    def check(messages: Any, known_tokens: int) -> None:
        chars = message_chars(messages)
        at_least = known_tokens + chars // per_token
        if at_least > ceiling:
            raise ProviderError(
                f"This model's maximum context length is {ceiling} tokens; the prompt is at least {at_least} tokens "
                f"(messages of {chars} characters, a token covers at most {longest}): refused before tokenizing",
                status_code=400,
            )

    for name, at, key in (("render", 0, "messages"), ("render_ids", 0, "messages"), ("bridge_to_next_turn", 2, "new_messages")):  # fmt: skip
        method = getattr(renderer, name, None)
        if method is None:
            continue

        def bounded(*args: Any, _method=method, _at=at, _key=key, **kwargs: Any) -> Any:
            messages = args[_at] if len(args) > _at else kwargs.get(_key)
            known = sum(len(ids) for ids in args[:_at] if isinstance(ids, list | tuple))  # a bridge's previous ids
            check(messages, known)
            return _method(*args, **kwargs)

        setattr(renderer, name, bounded)
