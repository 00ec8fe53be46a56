"""Structured output on the torch engine: vLLM's request fields compiled to an llguidance grammar, and the
per-sequence matcher that masks the logits before sampling.

llguidance (Microsoft's guidance engine, a Rust core with a small wheel and no dependencies) is the library: it
takes JSON schemas, regexes and Lark grammars, computes a token mask on the CPU in tens of microseconds, needs no
GPU and no torch build of its own, and is one of vLLM's own structured-output backends (``guidance``), so a schema
means the same thing on both engines. The fields, as vLLM reads them:

* ``structured_outputs``: ``{"json": schema}``, ``{"regex": r}``, ``{"choice": [..]}``, ``{"grammar": lark}``,
  ``{"json_object": true}`` (one key), plus ``"disable_any_whitespace": true`` for JSON without free whitespace
  (JSON allows it by default, as in vLLM);
* ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {"schema": ..}}``;
* ``tool_choice`` ``"required"`` (a non-empty JSON array of ``{"name", "parameters"}``) or a named function (that
  function's parameters), built as vLLM's ``get_json_schema_from_tools`` does.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from prime_inference.protocol import RequestError

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _json_grammar(schema: Any, param: str, compact: bool = False) -> str:
    import llguidance

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise RequestError(f"JSON schema is not valid JSON: {e}", param=param) from e
    if not isinstance(schema, dict):
        raise RequestError("a JSON schema must be an object", param=param)
    try:
        defaults = {"whitespace_flexible": False} if compact else None
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    except Exception as e:  # llguidance reports unsupported schema features as ValueError/RuntimeError
        raise RequestError(f"unsupported JSON schema: {e}", param=param) from e


def _from_structured(spec: dict[str, Any]) -> str:
    import llguidance

    keys = [k for k in STRUCTURED_KEYS if spec.get(k) not in (None, False)]
    unknown = set(spec) - {*STRUCTURED_KEYS, "disable_any_whitespace"}
    if unknown:
        raise RequestError(f"unsupported structured_outputs keys {sorted(unknown)}", param="structured_outputs")
    if len(keys) != 1:
        raise RequestError(
            f"structured_outputs needs exactly one of {', '.join(STRUCTURED_KEYS)}", "structured_outputs"
        )
    key, value = keys[0], spec[keys[0]]
    param = f"structured_outputs.{key}"
    compact = bool(spec.get("disable_any_whitespace"))
    if key == "json":
        return _json_grammar(value, param, compact)
    if key == "json_object":
        return _json_grammar({"type": "object"}, param, compact)
    if key == "regex" and isinstance(value, str):
        return llguidance.LLMatcher.grammar_from_regex(value)
    if key == "choice" and isinstance(value, list) and value and all(isinstance(c, str) for c in value):
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if key == "grammar" and isinstance(value, str):
        return llguidance.LLMatcher.grammar_from_lark(value)
    raise RequestError(f"{param} has the wrong type", param=param)


def _from_response_format(fmt: dict[str, Any]) -> str | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise RequestError("response_format.json_schema.schema is required", param="response_format")
        return _json_grammar(spec["schema"], "response_format.json_schema.schema")
    raise RequestError(f"response_format type {kind!r} is not supported", param="response_format")


def _tool_schema(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any]) -> dict[str, Any]:
    functions = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools if "function" in t}
    if isinstance(tool_choice, dict):
        return functions[tool_choice["function"]["name"]]
    calls = [
        {
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"],
        }
        for name, params in functions.items()
    ]
    return {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}


def request_grammar(
    structured: dict[str, Any] | None,
    response_format: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: str | dict[str, Any] | None = None,
) -> str | None:
    """The llguidance grammar a request asks for, or None; a bad spec is a `RequestError` naming the field."""
    grammars = []
    if tools and tool_choice is not None and tool_choice not in ("none", "auto"):
        grammars.append(_json_grammar(_tool_schema(tools, tool_choice), "tool_choice"))
    if structured:
        grammars.append(_from_structured(structured))
    if response_format:
        grammar = _from_response_format(response_format)
        if grammar is not None:
            grammars.append(grammar)
    if len(grammars) > 1:
        raise RequestError("use one of structured_outputs, response_format and a forced tool_choice", "response_format")
    return grammars[0] if grammars else None


@functools.lru_cache(maxsize=4)
def ll_tokenizer(tokenizer: Any) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


def check_grammar(tokenizer: Any, grammar: str, param: str = "structured_outputs") -> None:
    """Compile ``grammar`` once for ``tokenizer`` so that a bad one is a 400, not a failed generation."""
    import llguidance

    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer), grammar)
    if matcher.is_error():
        raise RequestError(f"invalid grammar: {matcher.get_error()}", param=param)


class GrammarState:
    """One sequence's position in its grammar: masks the next token's logits, then consumes the sampled token.

    The mask is llguidance's bitmask (bit i of byte j allows token 8j + i) unpacked with plain torch ops;
    llguidance's own torch helper compiles a kernel with torch.compile, which costs 20+ s on a CPU."""

    def __init__(self, tokenizer: Any, grammar: str):
        import llguidance
        import torch

        self.tokenizer = ll_tokenizer(tokenizer)
        self.matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        self._bits = torch.arange(8, dtype=torch.uint8)

    def allowed(self) -> Any:
        """Bool mask `[vocab of the tokenizer]` of the tokens the grammar allows next."""
        import torch

        if self.matcher.is_error():  # a dead end: only EOS remains (what vLLM's guidance backend does)
            mask = torch.zeros(self.tokenizer.vocab_size, dtype=torch.bool)
            mask[self.tokenizer.eos_token] = True
            return mask
        packed = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        return ((packed[:, None] >> self._bits) & 1).flatten()[: self.tokenizer.vocab_size].bool()

    def mask(self, logits_V: Any) -> Any:
        import torch

        allowed = torch.zeros(logits_V.numel(), dtype=torch.bool)
        ok = self.allowed()
        n = min(ok.numel(), logits_V.numel())
        allowed[:n] = ok[:n]
        return logits_V.masked_fill(~allowed.to(logits_V.device), float("-inf"))

    def consume(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)

    @property
    def stopped(self) -> bool:
        return self.matcher.is_stopped()
