"""Engine load on /health (KV-cache usage, queue, preemptions): the torch engine's accounting, the vLLM engine's
scheduler probe against a stand-in engine core on CPU, and a real vLLM server (marker `gpu`). The torch engine under
load through HTTP: tests/orchestrator/test_concurrency.py."""

from __future__ import annotations

import asyncio
import importlib.util
from types import SimpleNamespace

import httpx
import pytest
from prime_core.schemas.health import parse_health

from .helpers import start_server

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def seq(prompt: int, out: int) -> SimpleNamespace:
    return SimpleNamespace(request=SimpleNamespace(prompt_ids=[0] * prompt), output_ids=[1] * out)


def test_torch_usage_is_cached_tokens_over_slots_times_max_len():
    from prime_inference.engines.torch_load import kv_cache_usage, load_fields

    # The newest sampled token is the next step's input, not yet in the cache; a fresh admission holds its prompt.
    assert kv_cache_usage([seq(10, 5), seq(20, 0)], num_slots=4, max_len=100) == pytest.approx((14 + 20) / 400)
    assert kv_cache_usage([], 4, 100) == 0.0
    assert kv_cache_usage([seq(100, 1)] * 4, 4, 100) == 1.0
    assert load_fields([seq(3, 2)], 2, 10) == {"running": 1, "kv_cache_usage": 0.2, "preemptions": 0}


def test_health_reports_the_torch_engines_load_fields(model_dir):
    server = start_server(model_dir)
    try:
        health = parse_health(httpx.get(f"{server.url}/health").json())
        assert health.kv_cache_usage == 0 and health.preemptions == 0 and health.running == health.waiting == 0
    finally:
        server.stop()


def test_health_of_another_version_still_parses():
    health = parse_health({"status": "ok", "kv_cache_usage": "full", "preemptions": -1, "running": 3})
    assert health.kv_cache_usage is None and health.preemptions is None and health.running == 3


class FakeCore:
    """vLLM's engine-core client, its utility calls answered by ``engine_load`` over stand-in schedulers."""

    def __init__(self, *schedulers):
        from prime_inference.engines.vllm_load import engine_load

        self.cores = [SimpleNamespace(scheduler=s) for s in schedulers]
        self.core_engines = list(range(len(schedulers)))
        self.engine_load = engine_load
        self.calls = 0

    async def call_utility_async(self, method, *args):
        return await self._call_utility_async(method, *args, engine=0)

    async def _call_utility_async(self, method, *args, engine):
        from prime_inference.engines.vllm_load import PROBE

        assert method == PROBE and not args
        self.calls += 1
        return self.engine_load(self.cores[engine])


def scheduler(running: int, waiting: int, usage: float, preemptions: int = 0, skipped: int = 0):
    s = SimpleNamespace(running=[0] * running, waiting=[0] * waiting, skipped_waiting=[0] * skipped,
                        kv_cache_manager=SimpleNamespace(usage=usage))  # fmt: skip
    s._prime_num_preemptions = preemptions  # what the wrapped _preempt_request counts
    return s


def test_vllm_load_sums_data_parallel_engines():
    from prime_inference.engines.vllm_load import LoadPoller

    load = asyncio.run(LoadPoller.read(FakeCore(scheduler(4, 1, 0.5, 2, skipped=1), scheduler(6, 0, 0.7, 1))))
    assert (load.running, load.waiting, load.preemptions) == (10, 2, 3)
    assert load.kv_cache_usage == pytest.approx(0.6)  # equal caches: the server's usage is their mean
    one = asyncio.run(LoadPoller.read(FakeCore(scheduler(2, 0, 0.25))))
    assert (one.running, one.waiting, one.kv_cache_usage, one.preemptions) == (2, 0, 0.25, 0)


def test_vllm_poller_refreshes_in_the_background_and_stops_on_a_missing_probe(monkeypatch):
    from prime_inference.engines import vllm_load

    monkeypatch.setattr(vllm_load, "install_probe", lambda: True)  # no vLLM here

    async def main():
        poller = vllm_load.LoadPoller(interval_s=0.01)
        assert poller.fields(in_flight=5) == {"running": 5}  # before any answer: requests in flight only
        core = FakeCore(scheduler(3, 2, 0.4, 7))
        poller.start([core])
        await asyncio.sleep(0.1)
        assert poller.fields(5) == {"running": 3, "waiting": 2, "kv_cache_usage": 0.4, "preemptions": 7}
        assert core.calls > 2
        await poller.stop()

        class NoProbe:
            core_engines = [0]

            async def call_utility_async(self, method):
                raise Exception(f"Call to {method} method failed: 'EngineCoreProc' object has no attribute")

        poller = vllm_load.LoadPoller(interval_s=0.01)
        poller.start([NoProbe()])
        await asyncio.sleep(0.05)
        assert poller._task.done() and poller.fields(2) == {"running": 2}
        await poller.stop()

    asyncio.run(main())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="vllm extra not installed")
def test_vllm_health_reports_kv_usage_and_counts_preemptions(model_dir):
    """A real vLLM server with a KV cache of 64 blocks (1024 tokens at block size 16) and 32 requests of 160 tokens:
    the cache fills, requests wait, the scheduler preempts; /health shows each, then an idle engine."""
    server = start_server(
        model_dir,
        engine="vllm",
        model={"name": str(model_dir), "dtype": "bfloat16"},
        vllm={"gpu_memory_utilization": 0.3, "enforce_eager": True, "extra_args": ["--num-gpu-blocks-override", "64"]},
        max_model_len=256,  # 20 prompt + 160 sampled tokens (the helper's 128 answers these requests with a 400)
        startup_timeout=600,
    )
    body = {"token_ids": list(range(5, 25)), "sampling_params": {"max_tokens": 160, "temperature": 1.0,
                                                                 "ignore_eos": True}}  # fmt: skip

    async def main():
        seen = []
        async with httpx.AsyncClient(timeout=300) as client:
            posts = [asyncio.create_task(client.post(f"{server.url}/inference/v1/generate", json=body))
                     for _ in range(32)]  # fmt: skip
            while not all(p.done() for p in posts):
                seen.append(parse_health((await client.get(f"{server.url}/health")).json()))
                await asyncio.sleep(0.05)
            assert [p.result().status_code for p in posts] == [200] * 32
            await asyncio.sleep(1.0)  # the probe runs every 0.5 s
            idle = parse_health((await client.get(f"{server.url}/health")).json())
        return seen, idle

    try:
        seen, idle = asyncio.run(main())
    finally:
        server.stop()
    assert max(h.kv_cache_usage or 0 for h in seen) > 0.5
    assert max(h.running for h in seen) > 1 and max(h.waiting for h in seen) > 0
    assert idle.preemptions is not None and idle.preemptions > 0, [h.preemptions for h in seen]
    assert idle.kv_cache_usage == pytest.approx(0, abs=0.05) and idle.running == idle.waiting == 0
