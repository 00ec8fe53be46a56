"""Admin HTTP calls to the inference servers: health and weight updates (rollouts go through verifiers' client)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from prime_core.schemas.errors import is_permanent
from prime_core.schemas.health import parse_health
from prime_core.schemas.weights import WeightUpdateRequest, read_manifest

logger = logging.getLogger("prime.orchestrator.client")

RETRYABLE = (httpx.TransportError, httpx.TimeoutException)


class WeightUpdateError(RuntimeError):
    pass


class NoAnswer(RuntimeError):
    """`post_json`'s every attempt failed without an answer that says why (no connection, a broken one, a 5xx): a
    server that is down or restarting, unlike one that answers slowly (a timeout) or refuses (4xx, permanent 5xx)."""


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


MAX_ANSWER_BYTES = 256 * 2**20
"""Largest answer body ``post_json`` reads (as decoded). A teacher's scores of a long sequence are tens of MiB at
most; a server answering gigabytes had the orchestrator killed for memory, without a line naming it."""


_BODY_HEADERS = {"content-encoding", "content-length", "transfer-encoding"}


async def _post(client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout: float) -> httpx.Response:
    """The answer, its body read up to ``MAX_ANSWER_BYTES`` (past it: a ``RuntimeError`` naming the server)."""
    async with client.stream("POST", url, json=body, timeout=timeout) as resp:
        data = bytearray()
        async for chunk in resp.aiter_bytes():
            data += chunk
            if len(data) > MAX_ANSWER_BYTES:
                raise RuntimeError(f"POST {url} -> {resp.status_code}: an answer over {MAX_ANSWER_BYTES} bytes; cut")
    # The body is decoded already: its encoding and length headers go (the others, e.g. a fault's marks, stay).
    kept = [(k, v) for k, v in resp.headers.multi_items() if k.lower() not in _BODY_HEADERS]
    return httpx.Response(resp.status_code, headers=kept, content=bytes(data), request=resp.request)


async def post_json(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], *, timeout: float, retries: int
) -> dict[str, Any]:
    """POST with retries on connection errors, timeouts and 5xx; 4xx, a 5xx the server marks permanent (a dead engine:
    `prime_core.schemas.errors`), an answer that is not JSON and one over ``MAX_ANSWER_BYTES`` raise at once. Either
    names the server's last answer in one line (its error message, as our servers send it). ``timeout`` bounds each
    attempt as a whole: httpx's restarts at every chunk, and an answer trickled a few bytes at a time held its caller
    (a teacher's scoring, a weight update) for as long as the trickle lasted."""
    last, gone = "", False
    for attempt in range(retries + 1):
        try:
            async with asyncio.timeout(timeout):
                resp = await _post(client, url, body, timeout)
            if resp.status_code >= 500 and is_permanent(resp.headers):
                raise RuntimeError(f"POST {url} -> {resp.status_code}: {_reason(resp)} (permanent: not retried)")
            if resp.status_code >= 500:
                raise httpx.HTTPStatusError(f"{resp.status_code}: {_reason(resp)}", request=resp.request, response=resp)
            if resp.status_code >= 400:
                raise RuntimeError(f"POST {url} -> {resp.status_code}: {_reason(resp)}")
            try:
                return resp.json()
            except ValueError:
                raise RuntimeError(f"POST {url} -> {resp.status_code}: not JSON: {_reason(resp)[:200]}") from None
        except httpx.HTTPStatusError as e:
            last, gone = str(e), True
        except TimeoutError:
            last, gone = f"no complete answer after {timeout:g}s", False
        except RETRYABLE as e:
            last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            gone = not isinstance(e, httpx.TimeoutException)
        if attempt < retries:
            await asyncio.sleep(min(0.5 * 2**attempt, 5.0))
    raise (NoAnswer if gone else RuntimeError)(f"POST {url} failed after {retries + 1} attempts: {last}")


def _reason(resp: httpx.Response) -> str:
    """The server's error message (our servers answer ``{"error": {"message": ...}}``), else the body's start."""
    try:
        message = resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = resp.text[:500]
    return " ".join(str(message).split())  # one line: the run's cause is printed as one


class ServerUnreachable(RuntimeError):
    """No inference server answers at a configured URL."""


async def wait_healthy(
    base_urls: list[str], *, api_key: str | None, timeout: float, fail_fast: bool = False, run_id: str | None = None
) -> None:
    """Wait until every server answers /health. ``fail_fast``: a refused connection fails at once (``eval`` against
    a server that is not there) instead of waiting for a starting server. ``run_id``: only an answer carrying this
    run id counts (the launcher, which started the server, reports a foreign one and stops the run)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with httpx.AsyncClient(headers=headers(api_key)) as client:
        for url in base_urls:
            while not await _answers(client, url, run_id, fail_fast):
                if loop.time() > deadline:
                    raise TimeoutError(f"inference server {url} not healthy after {timeout:.0f}s")
                await asyncio.sleep(0.2)


async def _answers(client: httpx.AsyncClient, url: str, run_id: str | None, fail_fast: bool) -> bool:
    try:
        # As a whole: httpx's timeout restarts at every chunk, and a /health trickled a byte a second held the
        # start-up past its deadline (checked only between answers) for as long as the trickle lasted.
        async with asyncio.timeout(5.0):
            response = await client.get(url.rstrip("/") + "/health", timeout=5.0)
    except TimeoutError:
        return False
    except httpx.TransportError as e:
        if fail_fast:
            raise ServerUnreachable(f"no inference server at {url} ({type(e).__name__})") from None
        return False
    if response.status_code != 200:
        return False
    if run_id is None:
        return True
    try:
        return parse_health(response.json()).run_id == run_id
    except ValueError:
        return False


async def update_weights(
    base_urls: list[str],
    weight_dir: str,
    step: int,
    *,
    api_key: str | None,
    timeout: float,
    retries: int,
    source: str = "auto",
) -> None:
    """POST /update_weights to every server (concurrently); a failure names the server and the step.

    ``retries`` applies to weights the directory holds; a one-time transfer it announces (a broadcast: see
    `prime_core.schemas.weights`) is asked for once, of all servers together, as the sender sends once to all.
    """
    try:
        manifest = read_manifest(weight_dir, source)
    except (OSError, ValueError) as e:
        raise WeightUpdateError(f"weights step {step} ({weight_dir}) cannot be relayed: {e}") from e
    body = WeightUpdateRequest(weight_dir=str(weight_dir), step=step, source=source).model_dump()
    attempts = retries if manifest.repeatable else 0

    async def one(client: httpx.AsyncClient, url: str) -> None:
        try:
            answer = await post_json(
                client, url.rstrip("/") + "/update_weights", body, timeout=timeout, retries=attempts
            )
        except Exception as e:
            raise WeightUpdateError(
                f"inference server {url} failed to load weights step {step} ({weight_dir}): {e}"
            ) from e
        # What the server says it serves now, not what was asked: rollouts' versions are counted from it.
        served = answer.get("weight_step") if isinstance(answer, dict) else None
        if served is not None and served != step:
            raise WeightUpdateError(f"inference server {url} serves weights step {served} after loading step {step}")

    async with httpx.AsyncClient(headers=headers(api_key)) as client:
        await asyncio.gather(*(one(client, u) for u in base_urls))


async def reload_weights(base_urls: list[str], *, api_key: str | None, timeout: float, retries: int) -> None:
    async with httpx.AsyncClient(headers=headers(api_key)) as client:
        for url in base_urls:
            await post_json(client, url.rstrip("/") + "/reload_weights", {}, timeout=timeout, retries=retries)
