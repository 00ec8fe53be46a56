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

DEPTH = 4_000  # past the recursion limit (1000) of json.loads; short enough for the test engine's forward pass


def raw_call(name_json: str, arguments_json: str) -> str:
    return f'<tool_call>{{"name": {name_json}, "arguments": {arguments_json}}}</tool_call>'


# vf-toolset's tasks ask for the code of alpha, bravo, charlie, delta (example e asks for KEYS[e % 4]); two rollouts
# of each. The first rollouts of a key to ask are answered with its attacks in turn; the others are honest: call, then
# answer. Every rollout starts its own tool server, which costs seconds of CPU: eight rollouts, not more.
ATTACKS = {
    "alpha": [
        raw_call('"table_lookup"', "[" * DEPTH + "]" * DEPTH),  # renderers' json.loads: RecursionError
        raw_call('"table_lookup"', '{"key": ' + "9" * 5000 + "}"),  # ValueError: CPython's int-string limit
    ],
    "bravo": [
        raw_call('"table_lookup"', '{"key": "\\ud800"}'),  # a lone surrogate in the arguments
        raw_call('"\\udfff"', '{"key": "bravo"}'),  # and in the name
    ],
    "charlie": [raw_call('"no_such_tool"', '{"key": "charlie"}')],
    "delta": [raw_call('"table_lookup"', '{"key": ["not", "a", "string"], "extra": 1}')],
}
ROLLOUTS_PER_KEY = 2


class HostileScript:
    """The scripted policy: each key's attacks once, first come first served, then honest tool use."""

    def __init__(self):
        self.pending = {key: list(attacks) for key, attacks in ATTACKS.items()}
        self.sent: list[str] = []

    def __call__(self, prompt: str) -> str | None:
        last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
        m = re.search(r"code of (\w+)\?", prompt)
        if m and "<tool_response>" not in last_user and self.pending.get(m.group(1)):
            self.sent.append(self.pending[m.group(1)].pop(0))
            return self.sent[-1]
        if m and "<tool_response>" in last_user and not re.search(r"<tool_response>\s*\d{4}\s", last_user):
            return "<answer>none</answer>"  # a tool error: give up
        return script(prompt)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("tool_model"), build_tool_tokenizer())
    srv = ScriptedServer(model, HostileScript())
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


def test_hostile_tool_calls_are_scored_and_honest_ones_beside_them_score(server, monkeypatch):
    """A call renderers' parser raises on (deep nesting, a huge integer) or that no UTF-8 encoder takes (a lone
    surrogate, which closed the MCP connection) is content with no tool call, as on vLLM: the rollout is scored 0 and
    trained on, like any malformed call; the honest rollouts of the same key beside it score 1."""
    use_vf_envs(monkeypatch)
    server.engine.script = policy = HostileScript()  # a fresh one per test
    keys = list(ATTACKS)
    t0 = time.monotonic()
    results, restarts = asyncio.run(_rollouts(server, list(range(len(keys) * ROLLOUTS_PER_KEY))))
    elapsed = time.monotonic() - t0
    outcomes = [
        (keys[r.example % len(keys)], r.failed, r.error, r.reward, r.completion_len, round(r.latency, 1))
        for r in results
    ]
    print(json.dumps(outcomes, indent=1, default=str), f"{elapsed:.1f}s")
    assert restarts == 0 and elapsed < 120
    assert len(policy.sent) == sum(map(len, ATTACKS.values()))
    for key, attacks in ATTACKS.items():
        mine = [r for r in results if keys[r.example % len(keys)] == key]
        assert not any(r.failed for r in mine), (key, [r.error for r in mine])
        assert sorted(r.reward for r in mine) == [0.0] * len(attacks) + [1.0] * (ROLLOUTS_PER_KEY - len(attacks))
        assert all(r.traces and r.completion_len > 0 for r in mine), key  # every turn's tokens reach the trainer
    # the calls that do not parse or encode are no call: nothing reached the tool server
    for r in results:
        if keys[r.example % len(keys)] in ("alpha", "bravo") and r.reward == 0.0:
            assert r.metrics["tool_calls"] == 0.0 and r.num_turns == 1


def test_one_line_keeps_the_cause_of_a_traceback():
    from prime_core.io import one_line

    tail = 'nit__.py", line 482, in exc_check\n    raise X\nhttpx.HTTPStatusError: 500 Internal Server Error\n'
    assert one_line(f"harness 'prime-chat' exited 1: {tail}") == (
        "harness 'prime-chat' exited 1: nit__.py\", line 482, in exc_check ... "
        "httpx.HTTPStatusError: 500 Internal Server Error"
    )
    assert one_line("timed out after 5s") == "timed out after 5s" and one_line("") == "(no message)"
