"""A tool answer as large as the policy asks for (``vf-flood``'s ``flood_read``: 200 MiB of text) is read no further
than ``max_tool_output_bytes`` by the env server: its memory stays flat, the model gets the head of the text and a
marker, the rollout is scored in bounded time, and a small answer beside it reads as before."""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from pathlib import Path

import pytest
from prime_core.config.orchestrator import ClientConfig, EnvConfig, SamplingConfig

from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
from tests.fixtures.scripted import ScriptedServer
from tests.fixtures.vf import use_vf_envs

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

FLOOD_MIB = 200
MIB_ASKED = {"amber": FLOOD_MIB, "basalt": 1}  # vf-flood's examples 0 and 1
CONTEXT = 16_384  # room for a 20 kB tool result in the byte-level test tokenizer


class FloodPolicy:
    """Asks ``flood_read`` for its task's size, then answers; records each tool result it is shown."""

    def __init__(self):
        self.tool_results: dict[str, str] = {}

    def __call__(self, prompt: str) -> str | None:
        m = re.search(r"answer (\w+) inside", prompt)
        if m is None:
            return None
        last_user = prompt.rsplit("<|im_start|>user\n", 1)[-1]
        if "<tool_response>" in last_user:
            self.tool_results[m.group(1)] = last_user
            return f"<answer>{m.group(1)}</answer>"
        return f'<tool_call>{{"name": "flood_read", "arguments": {{"megabytes": {MIB_ASKED[m.group(1)]}}}}}</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("flood_model"), build_tool_tokenizer(), max_positions=CONTEXT)
    srv = ScriptedServer(model, FloodPolicy(), max_model_len=CONTEXT)
    yield srv
    srv.stop()


def rss_mib(pid: int) -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) // 1024


class PeakRss:
    """The peak RSS of one process, sampled every 20 ms while in the ``with`` block."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, 0, threading.Event()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mib(self.pid))
            self._stop.wait(0.02)

    def __enter__(self):
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)


@contextlib.asynccontextmanager
async def started_runner(server, env: dict, max_tokens: int):
    """An env runner of ``env`` (EnvConfig data) started against ``server``, and its ``rollout(example)``."""
    from prime_orchestrator.envs import EnvRunner, sampling_args, server_spec, train_client

    config = EnvConfig.model_validate({"harness": "null", "rollout_timeout": 120, **env})
    runner = EnvRunner(config, server_spec(config), max_retries=0)
    await runner.start()
    try:
        client = train_client(ClientConfig(), server.config.model.name, server.url)
        sampling = sampling_args(SamplingConfig(max_tokens=max_tokens, temperature=1.0), seed=0)

        def rollout(example: int):
            return runner.rollout(example, client=client, model=server.config.model.name, sampling=sampling)

        yield runner, rollout
    finally:
        await runner.close()


async def _run(server, policy: FloodPolicy):
    async with started_runner(server, {"id": "vf-flood"}, max_tokens=64) as (runner, rollout):
        warm = await rollout(1)  # loads the renderer's tokenizer, the MCP client, ...: what any first rollout costs
        assert warm.reward == 1.0, warm.error
        base = rss_mib(runner.server.pid)
        t0 = time.monotonic()
        with PeakRss(runner.server.pid) as rss:
            results = await asyncio.gather(rollout(0), rollout(1))
        return results, base, rss.peak, time.monotonic() - t0, runner.server.num_restarts


def test_a_flood_of_tool_output_is_cut_before_the_env_server_holds_it(server, monkeypatch):
    use_vf_envs(monkeypatch)
    server.engine.script = policy = FloodPolicy()
    results, base, peak, elapsed, restarts = asyncio.run(_run(server, policy))
    print(f"env server RSS {base} MiB -> peak {peak} MiB; {elapsed:.1f}s;", [(r.reward, r.error) for r in results])
    assert restarts == 0  # how long it took is no contract (72 s on a loaded CI host); the rollout timeout bounds it
    assert [(r.failed, r.reward) for r in results] == [(False, 1.0), (False, 1.0)]
    # unbounded, the 200 MiB answer took the env server from 0.7 to 3.1 GB (its JSON holds the text twice, escaped)
    assert peak - base < 256, (base, peak)
    flood, small = policy.tool_results["amber"], policy.tool_results["basalt"]
    assert "[... cut: the tool's answer is over 16,777,216 bytes; this is its beginning ...]" in flood
    assert flood.count("the quick brown fox") > 100 and len(flood.encode()) < 20_500  # the head, in verifiers' bound
    assert "cut: the tool's answer" not in small and "truncated" in small  # verifiers' own head-and-tail cut
    assert all(r.prompt_len + r.completion_len < CONTEXT for r in results)
