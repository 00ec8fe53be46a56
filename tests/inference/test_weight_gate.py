"""A token-in request that names the oldest weights it accepts (``extra_args.prime_min_weight_step``, the orchestrator's
``dispatch_ahead``) waits at the server until they serve, within ``server.weight_wait_timeout``."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from .helpers import start_server


@pytest.fixture(scope="module")
def gated(model_dir):
    server = start_server(model_dir, server={"weight_wait_timeout": 2.0})
    yield server
    server.stop()


def generate(server, extra_args: dict) -> httpx.Response:
    body = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4, "temperature": 0, "extra_args": extra_args}}
    return httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=60)


def test_a_request_waits_for_the_weights_it_names_and_samples_with_them(gated, other_weights_dir):
    step = httpx.get(f"{gated.url}/health").json()["weight_step"] + 1
    answers: list[httpx.Response] = []
    held = threading.Thread(target=lambda: answers.append(generate(gated, {"prime_min_weight_step": step,
                                                                           "prime_rollout": "r1"})))  # fmt: skip
    held.start()
    time.sleep(0.5)
    assert held.is_alive()  # held: the server still serves the step before
    update = {"weight_dir": str(other_weights_dir), "step": step}
    assert httpx.post(f"{gated.url}/update_weights", json=update, timeout=60).status_code == 200
    held.join(30)
    assert not held.is_alive() and answers[0].status_code == 200, answers
    record = httpx.post(f"{gated.url}/rollout_versions", json={"tags": ["r1"], "pop": True}).json()["versions"]["r1"]
    assert record["first"] == step and record["num_tokens"] > 0
    assert generate(gated, {"prime_min_weight_step": step}).status_code == 200  # served already: no wait


def test_weights_that_never_come_are_a_503_naming_the_step_within_the_bound(gated):
    t0 = time.monotonic()
    r = generate(gated, {"prime_min_weight_step": 10_000})
    assert r.status_code == 503 and time.monotonic() - t0 < 20
    message = r.json()["error"]["message"]
    assert "weights step 10000" in message and "server.weight_wait_timeout" in message and "\n" not in message


@pytest.mark.parametrize("bad", [-1, "3", 2.5, True, None])
def test_a_malformed_oldest_step_is_a_400_naming_the_field(gated, bad):
    if bad is None:  # absent: no wait at all
        assert generate(gated, {}).status_code == 200
        return
    r = generate(gated, {"prime_min_weight_step": bad})
    assert r.status_code == 400 and "prime_min_weight_step" in r.json()["error"]["message"]
