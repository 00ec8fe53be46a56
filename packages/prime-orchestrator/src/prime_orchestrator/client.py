"""HTTP calls to the inference servers: token-in generation, chat completions, weight updates."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from prime_core.schemas.weights import WeightUpdateRequest

logger = logging.getLogger("prime.orchestrator.client")

RETRYABLE = (httpx.TransportError, httpx.TimeoutException)


class WeightUpdateError(RuntimeError):
    pass


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def post_json(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], *, timeout: float, retries: int
) -> dict[str, Any]:
    """POST with retries on connection errors, timeouts and 5xx; 4xx raises at once."""
    last: Exception | None = None
    for attempt in range(retries + 1):
        try:
            resp = await client.post(url, json=body, timeout=timeout)
            if resp.status_code >= 500:
                raise httpx.HTTPStatusError(
                    f"{resp.status_code}: {resp.text[:300]}", request=resp.request, response=resp
                )
            if resp.status_code >= 400:
                raise RuntimeError(f"POST {url} -> {resp.status_code}: {resp.text[:500]}")
            return resp.json()
        except (*RETRYABLE, httpx.HTTPStatusError) as e:
            last = e
            if attempt < retries:
                await asyncio.sleep(min(0.5 * 2**attempt, 5.0))
    raise RuntimeError(f"POST {url} failed after {retries + 1} attempts: {last!r}")


def parse_logprobs(raw: Any, n: int) -> list[float]:
    """Per-token log-probs from the shapes servers use (floats, {id: lp}, {"logprob": lp}, OpenAI content)."""
    if raw is None:
        return [0.0] * n
    if isinstance(raw, dict) and "content" in raw:
        raw = raw["content"]
    if isinstance(raw, dict) and "token_logprobs" in raw:
        raw = raw["token_logprobs"]
    out = []
    for item in raw:
        if isinstance(item, int | float):
            out.append(float(item))
        elif isinstance(item, dict):
            if "logprob" in item:
                out.append(float(item["logprob"]))
            else:
                v = next(iter(item.values()))
                out.append(float(v["logprob"] if isinstance(v, dict) else v))
        elif item is None:
            out.append(0.0)
        else:
            raise ValueError(f"unrecognized log-prob entry {item!r}")
    if len(out) != n:
        raise ValueError(f"server returned {len(out)} log-probs for {n} tokens")
    return out


async def generate_tokens(
    client: httpx.AsyncClient,
    base_url: str,
    path: str,
    *,
    model: str,
    token_ids: list[int],
    sampling: dict[str, Any],
    timeout: float,
    retries: int,
    images: list[str] | None = None,
) -> tuple[list[int], list[float], str | None]:
    """Token-in generation: returns (completion ids, their log-probs, finish reason).

    ``images``: data: URLs of the images whose placeholder runs ``token_ids`` holds (vision-language models).
    """
    body = {"model": model, "token_ids": token_ids, "sampling_params": {**sampling, "logprobs": 0}}
    if images:
        body["images"] = images
    data = await post_json(client, base_url.rstrip("/") + path, body, timeout=timeout, retries=retries)
    choice = data["choices"][0]
    ids = list(choice["token_ids"])
    return ids, parse_logprobs(choice.get("logprobs"), len(ids)), choice.get("finish_reason")


async def chat_completion(
    client: httpx.AsyncClient,
    base_url: str,
    *,
    model: str,
    messages: list[dict[str, Any]],
    sampling: dict[str, Any],
    timeout: float,
    retries: int,
) -> tuple[str, int, str | None]:
    """OpenAI chat completion: returns (text, completion tokens, finish reason)."""
    body = {"model": model, "messages": messages, **sampling}
    data = await post_json(
        client, base_url.rstrip("/") + "/v1/chat/completions", body, timeout=timeout, retries=retries
    )
    choice = data["choices"][0]
    usage = data.get("usage") or {}
    return choice["message"].get("content") or "", int(usage.get("completion_tokens", 0)), choice.get("finish_reason")


async def wait_healthy(base_urls: list[str], *, api_key: str | None, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with httpx.AsyncClient(headers=headers(api_key)) as client:
        for url in base_urls:
            while True:
                try:
                    if (await client.get(url.rstrip("/") + "/health", timeout=5.0)).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if loop.time() > deadline:
                    raise TimeoutError(f"inference server {url} not healthy after {timeout:.0f}s")
                await asyncio.sleep(0.2)


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

    Servers receiving a broadcast must be asked together: the trainer sends once, to all of them at the same time.
    """
    body = WeightUpdateRequest(weight_dir=str(weight_dir), step=step, source=source).model_dump()

    async def one(client: httpx.AsyncClient, url: str) -> None:
        try:
            await post_json(client, url.rstrip("/") + "/update_weights", body, timeout=timeout, retries=retries)
        except Exception as e:
            raise WeightUpdateError(
                f"inference server {url} failed to load weights step {step} ({weight_dir}): {e}"
            ) from e

    async with httpx.AsyncClient(headers=headers(api_key)) as client:
        await asyncio.gather(*(one(client, u) for u in base_urls))


async def reload_weights(base_urls: list[str], *, api_key: str | None, timeout: float, retries: int) -> None:
    async with httpx.AsyncClient(headers=headers(api_key)) as client:
        for url in base_urls:
            await post_json(client, url.rstrip("/") + "/reload_weights", {}, timeout=timeout, retries=retries)
