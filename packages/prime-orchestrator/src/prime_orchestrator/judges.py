"""The judges of a run's environments: pointed at one OpenAI-compatible endpoint, and checked at start.

verifiers keeps a judge's endpoint in its config (``vf.JudgeConfig``: ``base_url``, ``model``, ``api_key_var``),
never in row data: plugged judges under ``task.judges``, and judge fields a task config declares for the judges
its rewards build (``CorrectnessJudge(self.config.judge)``). Both sit in the environment's verifiers config, which
the orchestrator resolves before it starts the env server; ``point_judges`` rewrites the endpoint of each there. By
default that is the policy's own inference server, so a judged environment needs nothing outside the run.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from prime_core.config.orchestrator import ClientConfig, JudgeEndpointConfig

# The variable judges read the policy server's key from (set here, inherited by the env servers started after).
JUDGE_API_KEY_VAR = "PRIME_JUDGE_API_KEY"


class JudgeUnreachable(RuntimeError):
    """A judge endpoint of the run's environments does not answer (or does not serve the judge's model)."""


@dataclass(frozen=True)
class JudgeEndpoint:
    base_url: str
    model: str
    api_key_var: str | None
    timeout: float


def judge_endpoint(config: JudgeEndpointConfig, client: ClientConfig, served_model: str) -> JudgeEndpoint | None:
    """The endpoint every judge is pointed at (None: judges keep their environments' endpoints)."""
    if not config.enabled:
        return None
    if config.base_url is not None:
        return JudgeEndpoint(config.base_url.rstrip("/"), config.model, config.api_key_var, config.timeout)
    var = config.api_key_var
    if var is None:
        key = client.resolved_api_key()
        if key:
            os.environ[JUDGE_API_KEY_VAR] = key
        var = JUDGE_API_KEY_VAR
    return JudgeEndpoint(client.base_urls[0] + "/v1", config.model or served_model, var, config.timeout)


def judge_paths(value: Any, path: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(path, config) of every ``vf.JudgeConfig`` in a resolved verifiers config tree."""
    from pydantic import BaseModel
    from verifiers.v1.configs.judge import JudgeConfig

    if isinstance(value, JudgeConfig):
        yield path, value
    elif isinstance(value, BaseModel):
        for name in type(value).model_fields:
            yield from judge_paths(getattr(value, name), (*path, name))
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            yield from judge_paths(item, (*path, i))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from judge_paths(item, (*path, key))


def _at(data: Any, path: tuple) -> dict | None:
    for key in path:
        try:
            data = data[key]
        except (KeyError, IndexError, TypeError):
            return None
    return data if isinstance(data, dict) else None


def point_judges(config: Any, data: dict[str, Any], endpoint: JudgeEndpoint) -> int:
    """Rewrite, in ``data`` (the full JSON dump of the resolved ``config``), the endpoint of every judge; returns
    how many. Prompts, sampling and weights stay the environment's."""
    count = 0
    for path, _ in judge_paths(config):
        judge = _at(data, path)
        if judge is None:  # a field excluded from the dump is not sent to the env server either
            continue
        judge.update(base_url=endpoint.base_url, model=endpoint.model)
        judge["api_key_var"] = endpoint.api_key_var or JUDGE_API_KEY_VAR
        judge["timeout"] = {**judge.get("timeout", {}), "read": endpoint.timeout}
        count += 1
    return count


# verifiers' built-in judges and the prime plugins that hold the response in its place and read the verdict strictly.
HARDENED = {"reference": "prime-reference-judge", "rubric": "prime-rubric-judge"}


def harden_judges(config: Any, data: dict[str, Any]) -> int:
    """Plug, in ``data`` (the full JSON dump of the resolved ``config``), the prime version of every built-in judge
    (``HARDENED``); the reward keeps its name (``name`` set to the old id when unset) and every other setting,
    an author's ``prompt`` file included. Returns how many."""
    count = 0
    for path, _ in judge_paths(config):
        judge = _at(data, path)
        if judge is None or judge.get("id") not in HARDENED:
            continue
        judge["name"] = judge.get("name") or judge["id"]
        judge["id"] = HARDENED[judge["id"]]
        count += 1
    return count


def env_judges(env_config: dict[str, Any]) -> list[tuple[str, str, str, str | None]]:
    """(where, base_url, model, api_key_var) of every judge an env server's config holds."""
    import copy

    from verifiers.v1.utils.loaders import resolve_env_config

    config = resolve_env_config(copy.deepcopy(env_config))
    return [
        (".".join(str(p) for p in path), j.base_url.rstrip("/"), j.model, j.api_key_var)
        for path, j in judge_paths(config)
    ]


async def _probe(url: str, model: str, key_var: str | None, timeout: float) -> str | None:
    """None when ``url`` answers ``GET /models`` listing ``model``, else why not (one line)."""
    key = os.environ.get(key_var) if key_var else None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
            resp = await client.get(url + "/models")
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if resp.status_code != 200:
        return f"GET /models -> {resp.status_code}: {resp.text[:200]}"
    try:
        served = [m["id"] for m in resp.json().get("data", [])]
    except (ValueError, AttributeError, KeyError, TypeError):
        return "GET /models did not answer an OpenAI model list"
    if served and model not in served:
        return f"does not serve model {model!r} (it serves {', '.join(served[:5])})"
    return None


async def check_judges(specs: list[Any], timeout: float) -> None:
    """Raise ``JudgeUnreachable`` (one line naming the environment and the judge) when a judge endpoint of the
    env servers' configs does not answer in ``timeout`` seconds or does not serve its model."""
    seen: dict[tuple[str, str], tuple[str, str, str | None]] = {}
    for spec in specs:
        judges = await asyncio.to_thread(env_judges, spec.env_config)
        for where, url, model, key_var in judges:
            seen.setdefault((url, model), (spec.name, where, key_var))
    if not seen:
        return
    keys = list(seen)
    answers = await asyncio.gather(*(_probe(url, model, seen[(url, model)][2], timeout) for url, model in keys))
    for (url, model), problem in zip(keys, answers, strict=True):
        if problem is not None:
            env, where = seen[(url, model)][:2]
            raise JudgeUnreachable(
                f"judge endpoint {url} ({where} of env {env}) does not answer: {problem}; "
                "point the judges at a served model with judge.base_url and judge.model"
            )
