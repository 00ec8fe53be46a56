"""What every router shares: the served model on ``app.state``, and request bodies parsed into one-line 400s."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from prime_inference.protocol import RequestError
from prime_inference.serving import BodyBudget, ServerState

MAX_BODY_BYTES = 64 * 1024 * 1024
Model = TypeVar("Model", bound=BaseModel)


def state(request: Request) -> ServerState:
    return request.app.state.prime


def _location(loc: tuple) -> str:
    return ".".join(str(x) for x in loc if x != "body")


def validation_error(err: ValidationError, model: type[BaseModel]) -> RequestError:
    """One line naming each bad field (up to five); ``param`` is the first one's top-level field, as in vLLM (a
    check across fields names the field its message starts with)."""
    parts, param = [], None
    for e in err.errors()[:5]:
        loc = _location(e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
        first_word = msg.split(" ", 1)[0].split("=", 1)[0]
        field = str(e["loc"][0]) if e["loc"] else (first_word if first_word in model.model_fields else None)
        param = param or field
    return RequestError("; ".join(parts), param=param)


async def read_json(request: Request) -> dict[str, Any]:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise RequestError(f"request body larger than {MAX_BODY_BYTES} bytes", status_code=413)
    served = getattr(getattr(request.scope.get("app"), "state", None), "prime", None)
    budget = served.body_budget if served is not None else BodyBudget(MAX_BODY_BYTES)  # outside an app: its own
    taken = [0]
    try:
        raw = await _body(request, budget, taken)
        try:
            data = json.loads(raw) if raw else None
        except (ValueError, RecursionError) as e:  # besides syntax: bad UTF-8, deep nesting, a >4300-digit int
            raise RequestError(f"request body is not valid JSON: {e}") from e
    finally:
        budget.give(taken[0])
    if not isinstance(data, dict):
        raise RequestError("request body must be a JSON object")
    return data


async def _body(request: Request, budget: BodyBudget, taken: list[int]) -> bytes:
    """The body, read until ``MAX_BODY_BYTES``: a chunked upload has no Content-Length to refuse up front, and
    Starlette's ``request.body()`` would hold all of it (a 200 MB one raised the server's RSS by 390 MB). Each chunk
    is taken from ``budget`` (``taken[0]`` says how much, for the caller to give back)."""
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise RequestError(f"request body larger than {MAX_BODY_BYTES} bytes", status_code=413)
            budget.take(len(chunk))
            taken[0] += len(chunk)
            chunks.append(chunk)
    except ClientDisconnect:  # the client left (or was cut by the request deadline, `prime_inference.connections`)
        raise RequestError("the client disconnected before sending the whole body") from None
    return b"".join(chunks)


def validate(data: dict[str, Any], model: type[Model]) -> Model:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, model) from e


async def parse_body(request: Request, model: type[Model]) -> Model:
    return validate(await read_json(request), model)
