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
* ``tool_choice`` ``"required"`` or a named function: in the tool-call parser's own syntax where
  `prime_inference.chat_parsing.FORCED_CALL_SYNTAX` has it (vLLM 0.26's structural tag: one call or more, or the
  named function's one call, each with the tool's JSON schema for its arguments); otherwise vLLM's JSON form
  (``get_json_schema_from_tools``: a non-empty array of ``{"name", "parameters"}``, or the named function's
  parameters).
"""

from __future__ import annotations

import functools
import json
import re
import threading
from typing import Any

from prime_inference.protocol import RequestError

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
MAX_GRAMMAR_CHARS = 128 * 1024
"""Longest grammar source (a regex, Lark grammar, the choices, a JSON schema or the tools a forced call uses) this
server compiles. llguidance's compile time grows faster than linearly with the alternatives of one rule (20k choices
took 0.7 s, 500k hung the server for minutes) and its own limits are checked only after that work, so the size is
bounded before; at this bound a compile takes well under a second."""


def _bounded(source: str, param: str) -> str:
    if len(source) > MAX_GRAMMAR_CHARS:
        raise RequestError(
            f"{param} is {len(source)} characters long; this server compiles grammars of at most {MAX_GRAMMAR_CHARS}",
            param=param,
        )
    return source


COMPILE_STACK_BYTES = 512 * 1024 * 1024
"""Stack of the thread that compiles grammars. llguidance recurses once per level of rule references: a Lark grammar
chaining 3000 rules (48 kB) overflowed an 8 MB thread stack and killed the server with a segfault. Only the pages
used are committed; 512 MB holds the deepest chain under `MAX_GRAMMAR_CHARS`."""
_stack_lock = threading.Lock()


def _on_compile_stack(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` in a thread with a `COMPILE_STACK_BYTES` stack (the caller waits for it)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller
            out["error"] = e

    with _stack_lock:  # the stack size is process-wide: set it just for this thread
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(previous)
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


MAIN_STACK_BYTES = 256 * 1024 * 1024
"""Stack limit the inference process raises itself to (`deepen_main_stack`)."""


def deepen_main_stack(limit: int = MAIN_STACK_BYTES) -> int:
    """Raise this process's soft stack limit to ``limit`` (within the hard one); returns the soft limit in force.

    On the vLLM engine a request's grammar is compiled again by vLLM itself, with llguidance, on the server's event
    loop (the main thread, where vLLM validates structured outputs) and in its engine core: a Lark grammar of 3000
    chained rules overflowed that 8 MB stack and the segfault took the server down (one H200, vLLM 0.26). The main
    thread's stack grows up to the soft limit as it is when the fault happens, so raising it at startup is enough
    there; processes started afterwards inherit it. 256 MB holds chains of 40,000 rules, several times the deepest
    grammar under `MAX_GRAMMAR_CHARS`; pages are committed only as used."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_STACK)
    target = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_STACK, (target, hard))
        soft = target
    return soft


def _first_line(message: str) -> str:
    """llguidance's errors can run to a Rust backtrace: the first line names the problem."""
    line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    return line if len(line) <= 300 else line[:300] + "..."


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
        source = json.dumps(schema)
    except (ValueError, RecursionError) as e:  # nesting past the recursion limit
        raise RequestError(f"JSON schema cannot be serialized: {e}", param=param) from e
    _bounded(source, param)
    try:
        defaults = {"whitespace_flexible": False} if compact else None
        return _on_compile_stack(llguidance.LLMatcher.grammar_from_json_schema, schema, defaults=defaults)
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
        return llguidance.LLMatcher.grammar_from_regex(_bounded(value, param))
    if key == "choice" and isinstance(value, list) and value and all(isinstance(c, str) for c in value):
        return llguidance.LLMatcher.grammar_from_lark(
            _bounded("start: " + " | ".join(json.dumps(c) for c in value), param)
        )
    if key == "grammar" and isinstance(value, str):
        return llguidance.LLMatcher.grammar_from_lark(_bounded(value, param))
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


def _functions(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any]) -> dict[str, Any]:
    """name -> arguments schema of the tools a forced choice allows (vLLM: no parameters, or strict false, is any
    JSON value)."""
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    out = {}
    for tool in tools:
        function = tool["function"]
        if named is None or function["name"] == named:
            loose = function.get("strict") is False or function.get("parameters") is None
            out[function["name"]] = {} if loose else function["parameters"]
    return out


def json_tool_grammar(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any]) -> str:
    """vLLM's JSON form of a forced tool choice (``get_json_schema_from_tools``)."""
    functions = _functions(tools, tool_choice)
    if isinstance(tool_choice, dict):
        return _validated(_json_grammar(next(iter(functions.values())), "tools"), "tools")
    calls = [
        {
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
            "required": ["name", "parameters"],
        }
        for name, params in functions.items()
    ]
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    return _validated(_json_grammar(schema, "tools"), "tools")


def _lark_text(text: str, marker_ids: dict[str, int]) -> str:
    """``text`` as Lark: each marker that is one token as a token reference (llguidance cannot emit an added token
    from its text), the rest as string literals."""
    if not marker_ids:
        return json.dumps(text, ensure_ascii=False)
    pieces = re.split("(" + "|".join(map(re.escape, marker_ids)) + ")", text)
    return " ".join(f"<[{marker_ids[p]}]>" if p in marker_ids else json.dumps(p, ensure_ascii=False)
                    for p in pieces if p)  # fmt: skip


def forced_call_grammar(
    tools: list[dict[str, Any]], tool_choice: str | dict[str, Any], syntax: tuple, marker_ids: dict[str, int]
) -> str:
    """vLLM 0.26's structural tag for a forced tool choice as a Lark grammar: each call is one of ``syntax``'s
    ``(begin, end)`` forms around the arguments (the tool's JSON schema); required: one call or more, named: one."""
    rules, calls = [], []
    for i, (name, schema) in enumerate(_functions(tools, tool_choice).items()):
        if not isinstance(schema, dict):
            raise RequestError(f"tool {name!r}: parameters must be a JSON schema object", param="tools")
        rules.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        for begin, end in syntax:
            head = _lark_text(begin.replace("{name}", name), marker_ids)
            calls.append(f"{head} args_{i} {_lark_text(end, marker_ids)}")
    start = "start: call" if isinstance(tool_choice, dict) else "start: call+"
    grammar = "\n".join([start, "call: " + "\n    | ".join(calls), *rules])
    import llguidance

    return _validated(llguidance.LLMatcher.grammar_from_lark(grammar), "tools")


def _validated(grammar: str, param: str) -> str:
    """``grammar`` once llguidance has compiled it (its JSON schemas included): a bad one is a 400 naming ``param``."""
    import llguidance

    result = _on_compile_stack(llguidance.LLMatcher.validate_grammar, _bounded(grammar, param))
    error = result[1] if isinstance(result, tuple) else result  # (ok, message) in some releases
    if error and not (isinstance(result, tuple) and result[0]):
        raise RequestError(f"invalid JSON schema: {_first_line(error)}", param=param)
    return grammar


def request_grammar(
    structured: dict[str, Any] | None, response_format: dict[str, Any] | None = None, tool_grammar: str | None = None
) -> str | None:
    """The llguidance grammar a request asks for, or None; a bad spec is a `RequestError` naming the field."""
    grammars = [tool_grammar] if tool_grammar is not None else []
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


@functools.lru_cache(maxsize=32)
def _compiled(tokenizer: Any, grammar: str) -> Any:
    """A matcher at the grammar's start, compiled once: each sequence of a request (``n`` of them) and each request
    with the same grammar starts from a copy, not from another compile in the event loop."""
    import llguidance

    return _on_compile_stack(llguidance.LLMatcher, ll_tokenizer(tokenizer), grammar)


def check_grammar(tokenizer: Any, grammar: str, param: str = "structured_outputs") -> None:
    """Compile ``grammar`` once for ``tokenizer`` so that a bad one is a 400, not a failed generation."""
    matcher = _compiled(tokenizer, grammar)
    if matcher.is_error():
        raise RequestError(f"invalid grammar: {_first_line(matcher.get_error())}", param=param)


class GrammarState:
    """One sequence's position in its grammar: masks the next token's logits, then consumes the sampled token.

    The mask is llguidance's bitmask (bit i of byte j allows token 8j + i) unpacked with plain torch ops;
    llguidance's own torch helper compiles a kernel with torch.compile, which costs 20+ s on a CPU."""

    def __init__(self, tokenizer: Any, grammar: str):
        import torch

        self.tokenizer = ll_tokenizer(tokenizer)
        self.matcher = _compiled(tokenizer, grammar).deep_copy()
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
