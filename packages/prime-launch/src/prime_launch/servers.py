"""The launcher's view of inference servers: the port of the one it starts must be free, the server answering
must be the one it started (its ``/health`` reports the launcher's ``PRIME_RUN_ID``), and a server started
separately must serve this run's model and its step-0 weights before the first rollout, not what another run left
there."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

from prime_core.config.inference import InferenceConfig
from prime_core.preflight import port_in_use
from prime_core.schemas.health import HealthResponse, parse_health


class StartupFailed(Exception):
    """A process did not come up (e.g. inference never became healthy, or another server answered)."""


def check_port_free(inference: InferenceConfig | None, teacher: InferenceConfig | None = None) -> None:
    """Before anything starts: the ports of the servers rl would start (the policy's, a distillation teacher's) are
    free. Raises ``ValueError`` (one line)."""
    if inference is not None and (reason := port_in_use(inference.server.host, inference.server.port)):
        raise ValueError(
            f"inference.server.port: {reason}; stop that server, choose another --inference.server.port, or drop "
            "[inference] and point --orchestrator.client.base-urls at it"
        )
    if teacher is not None and (reason := port_in_use(teacher.server.host, teacher.server.port)):
        raise ValueError(f"teacher.port: {reason}; stop that server or choose another --teacher.port")


def _request(url: str, api_key: str | None, body: dict[str, Any] | None = None, timeout: float = 2.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="GET" if body is None else "POST")
    request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    try:
        return json.loads(raw) if raw else {}
    except (json.JSONDecodeError, UnicodeDecodeError):
        return {}


def health(url: str, api_key: str | None) -> HealthResponse | None:
    """A ``/health`` answering 200, or None while the server does not answer."""
    try:
        answer = _request(url, api_key)
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None
    return parse_health(answer)


def wait_healthy(
    urls: list[str],
    api_key: str | None,
    timeout: float,
    poll: Any,
    run_id: str | None = None,
    say: Any = None,
    say_every: float = 60.0,
) -> dict[str, HealthResponse]:
    """Poll each ``/health`` URL until it answers; ``poll()`` raises if a started process died (or is stuck). With
    ``run_id`` (the server rl started), an answer carrying another run id is a foreign server holding the port.
    ``say(line)`` hears every ``say_every`` seconds what is still awaited."""
    start = time.monotonic()
    deadline, said = start + timeout, start
    answers: dict[str, HealthResponse] = {}
    for url in urls:
        while (answer := health(url, api_key)) is None:
            poll()
            now = time.monotonic()
            if now > deadline:
                raise StartupFailed(f"{url} did not answer within {timeout:.0f} s (health_timeout)")
            if say is not None and now - said >= say_every:
                said = now
                say(f"still waiting for {url} after {now - start:.0f} s (health_timeout {timeout:.0f} s)")
            time.sleep(0.5)
        foreign = answer.run_id
        if run_id is not None and foreign is not None and foreign != run_id:
            raise StartupFailed(
                f"{url} is answered by another server (its run id is {foreign!r}, this run's is {run_id!r}); "
                "stop it or choose another --inference.server.port"
            )
        answers[url] = answer
    return answers


def check_served_model(answers: dict[str, HealthResponse], model_name: str) -> None:
    """Servers started separately must serve this run's model: its base weights are the run's step-0 weights,
    and the orchestrator's requests name it (``/health`` reports the served name and ``model.name``)."""
    for url, answer in answers.items():
        served = [name for name in (answer.model, answer.model_name) if name]
        if served and model_name not in served:
            raise StartupFailed(
                f"the inference server at {url.removesuffix('/health')} serves model {served[-1]!r}, not this run's "
                f"model.name {model_name!r}; start it with --model.name {model_name} or train its model"
            )


def reset_to_base(answers: dict[str, HealthResponse], api_key: str | None, timeout: float) -> list[str]:
    """Servers started separately that serve weights of an earlier run go back to the base weights of their
    ``model.name`` (``POST /reload_weights``), so a fresh run samples step 0 from its own step-0 weights.
    Returns one message per server reset."""
    messages = []
    for url, answer in answers.items():
        step, weight_dir = answer.weight_step, answer.weight_dir
        if step in (0, None) and not weight_dir:
            continue
        root = url.removesuffix("/health")
        try:
            _request(f"{root}/reload_weights", api_key, body={}, timeout=timeout)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            raise StartupFailed(
                f"the inference server at {root} serves weights of step {step} ({weight_dir}) from another run and "
                f"did not reload its base weights: {e}"
            ) from None
        messages.append(
            f"the inference server at {root} served weights of step {step} ({weight_dir}); reloaded its base "
            "weights for step 0"
        )
    return messages
