"""A policy's tool calls are adversarial input to the rollout path: verifiers' env server parses them client-side with
`renderers` and runs the tool loop. Each hostile rollout must be scored, or fail with a one-line reason that the
runner counts, in bounded time; the env server stays up and the honest rollouts beside them score as usual."""

from __future__ import annotations

import asyncio
import json
import re
import time

import pytest
from prime_core.config.orchestrator import ClientConfig, EnvConfig, SamplingConfig

from tests.environments.test_vf_eval import script
from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
from tests.fixtures.scripted import ScriptedServer
from tests.fixtures.vf import use_vf_envs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

DEPTH = 20_000


def raw_call(name_json: str, arguments_json: str) -> str:
    return f'<tool_call>{{"name": {name_json}, "arguments": {arguments_json}}}</tool_call>'


# vf-toolset's tasks ask for the code of alpha, bravo, charlie, delta (examples 0-3, then again 4-7)
HOSTILE = {
    "alpha": raw_call('"table_lookup"', "[" * DEPTH + "]" * DEPTH),  # renderers' json.loads: RecursionError
    "bravo": raw_call('"table_lookup"', '{"key": "\\ud800"}'),  # a lone surrogate in the arguments
    "charlie": raw_call('"no_such_tool"', '{"key": "charlie"}'),
    "delta": raw_call('"table_lookup"', '{"key": ["not", "a", "string"], "extra": 1}'),
}


def hostile_script(prompt: str) -> str | None:
    last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
    m = re.search(r"code of (\w+)\?", prompt)
    if m and "<tool_response>" not in last_user and m.group(1) in HOSTILE and "HONEST" not in prompt:
        return HOSTILE[m.group(1)]
    if m and "<tool_response>" in last_user:
        return "<answer>none</answer>" if "<answer>" not in last_user else None
    return script(prompt)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("tool_model"), build_tool_tokenizer())
    srv = ScriptedServer(model, hostile_script)
    yield srv
    srv.stop()


async def _rollouts(server, examples: list[int]):
    from prime_orchestrator.envs import EnvRunner, sampling_args, server_spec, train_client

    env = EnvConfig.model_validate({"id": "vf-toolset", "harness": "null", "rollout_timeout": 120})
    runner = EnvRunner(env, server_spec(env), max_retries=0)
    await runner.start()
    try:
        client = train_client(ClientConfig(), server.config.model.name, server.url)
        sampling = sampling_args(SamplingConfig(max_tokens=64, temperature=1.0), seed=0)
        results = await asyncio.gather(
            *(runner.rollout(e, client=client, model=server.config.model.name, sampling=sampling) for e in examples)
        )
        return results, runner.server.num_restarts
    finally:
        await runner.close()


def test_hostile_tool_calls_are_scored_or_failed_with_a_reason(server, monkeypatch):
    use_vf_envs(monkeypatch)
    t0 = time.monotonic()
    results, restarts = asyncio.run(_rollouts(server, list(range(4))))
    elapsed = time.monotonic() - t0
    outcomes = {
        key: (r.failed, r.error, r.reward) for key, r in zip(HOSTILE, results, strict=True)
    }  # fmt: skip
    print(json.dumps(outcomes, indent=1, default=str), f"{elapsed:.1f}s")
    assert restarts == 0 and elapsed < 120
    for key, r in zip(HOSTILE, results, strict=True):
        if r.failed:
            assert r.error and "\n" not in r.error and len(r.error) <= 510, key
        else:
            assert r.reward == 0.0 and r.traces, key
    # the reason names the cause: the last line of the harness's traceback, not its first
    assert results[0].failed and "maximum recursion depth exceeded" in results[0].error


def test_one_line_keeps_the_cause_of_a_traceback():
    from prime_orchestrator.traces import one_line

    tail = 'nit__.py", line 482, in exc_check\n    raise X\nhttpx.HTTPStatusError: 500 Internal Server Error\n'
    assert one_line(f"harness 'prime-chat' exited 1: {tail}") == (
        "harness 'prime-chat' exited 1: nit__.py\", line 482, in exc_check ... "
        "httpx.HTTPStatusError: 500 Internal Server Error"
    )
    assert one_line("timed out after 5s") == "timed out after 5s" and one_line("") == "(no message)"
