"""Adaptive concurrency (`prime_orchestrator.concurrency`): the limit of rollouts in flight grows while the engines'
KV caches have room and nothing waits, backs off on preemptions and full caches, stays under ``max_concurrent``, and
holds when a server does not answer. Against an injected load, a fake engine's /health over HTTP, and the real torch
engine under load."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import httpx
import pytest
from prime_core.config.orchestrator import ClientConfig
from prime_core.schemas.health import HealthResponse
from prime_orchestrator.concurrency import AdaptiveController, ConcurrencyLimiter, EngineLoad, HealthPoller


class FakeEngine:
    """A server whose KV usage follows the rollouts in flight: ``per_request`` of the cache each; requests beyond
    ``slots`` wait; ``preempt()`` bumps its cumulative preemption count."""

    def __init__(self, per_request: float = 0.01, slots: int = 10_000):
        self.per_request, self.slots = per_request, slots
        self.in_flight = lambda: 0
        self.preemptions = 0
        self.answers = True

    def health(self) -> HealthResponse | None:
        if not self.answers:
            return None
        n = self.in_flight()
        return HealthResponse(
            running=min(n, self.slots), waiting=max(0, n - self.slots),
            kv_cache_usage=min(1.0, n * self.per_request), preemptions=self.preemptions,
        )  # fmt: skip


def limiter_over(*engines: FakeEngine, limit: int = 8, ceiling: int = 1024, target: float = 0.9):
    async def load():
        return [e.health() for e in engines]

    limiter = ConcurrencyLimiter(
        limit, load=load, controller=AdaptiveController(ceiling=ceiling, target_kv_usage=target)
    )
    for engine in engines:
        engine.in_flight = lambda: limiter.in_flight
    return limiter


async def occupy(limiter: ConcurrencyLimiter, n: int) -> tuple[list[asyncio.Task], asyncio.Event]:
    """``n`` rollouts that hold their slot until the event is set (the rest queue at the limiter)."""
    done = asyncio.Event()

    async def rollout():
        async with limiter:
            await done.wait()

    tasks = [asyncio.create_task(rollout()) for _ in range(n)]
    await asyncio.sleep(0)
    return tasks, done


async def settle(limiter: ConcurrencyLimiter, polls: int) -> list[int]:
    limits = []
    for _ in range(polls):
        await limiter.poll_once()
        await asyncio.sleep(0)
        limits.append(limiter.limit)
    return limits


def test_config_defaults_make_max_concurrent_a_ceiling():
    assert ClientConfig().concurrency == "adaptive" and ClientConfig().max_concurrent == 1024
    assert ClientConfig(concurrency="fixed").max_concurrent == 64
    assert ClientConfig(max_concurrent=16).max_concurrent == 16
    limiter = ConcurrencyLimiter.from_config(ClientConfig(max_concurrent=16, initial_concurrent=64))
    assert limiter.limit == 16 and limiter.controller is not None
    assert ConcurrencyLimiter.from_config(ClientConfig(concurrency="fixed", max_concurrent=5)).controller is None


def test_the_limit_grows_until_usage_nears_the_target():
    async def main():
        engine = FakeEngine(per_request=0.01)  # the target 0.9 is reached at 90 rollouts
        limiter = limiter_over(engine, limit=8)
        tasks, done = await occupy(limiter, 400)
        limits = await settle(limiter, 20)
        assert limits[0] > 8 and limits == sorted(limits), limits  # grows, never overshoots and comes back
        assert 80 <= limiter.limit <= 90 and limiter.in_flight == limiter.limit, limits
        assert limiter.metrics()["engine/kv_cache_usage"] == pytest.approx(limiter.in_flight * 0.01)
        done.set()
        await asyncio.gather(*tasks)
        assert limiter.in_flight == 0 and limiter.queued == 0

    asyncio.run(main())


def test_the_limit_holds_while_requests_wait_or_nobody_queues():
    async def main():
        engine = FakeEngine(per_request=0.001, slots=20)  # the batch is bounded by slots, not by the cache
        limiter = limiter_over(engine, limit=8)
        tasks, done = await occupy(limiter, 400)
        await settle(limiter, 20)
        # Grows past 20 once (the poll sees a queue only after the step that fills the slots), then holds.
        assert 20 < limiter.limit <= 30
        done.set()
        await asyncio.gather(*tasks)
        held = limiter.limit
        await settle(limiter, 5)  # nothing queued at the limiter: the limit is not what holds rollouts back
        assert limiter.limit == held

    asyncio.run(main())


def test_a_preemption_halves_the_limit_once_per_cut():
    async def main():
        engine = FakeEngine(per_request=0.001)
        limiter = limiter_over(engine, limit=64)
        tasks, done = await occupy(limiter, 200)
        await settle(limiter, 1)  # baseline of the preemption counter
        engine.preemptions += 3
        grown = limiter.limit
        await settle(limiter, 1)
        assert limiter.limit == grown // 2 and limiter.in_flight == grown
        engine.preemptions += 5  # still the old limit's rollouts in flight: no second cut
        await settle(limiter, 1)
        assert limiter.limit == grown // 2
        assert limiter.metrics()["engine/preemptions"] == 8
        done.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_a_full_cache_with_requests_waiting_trims_the_limit():
    controller = AdaptiveController(ceiling=1024, target_kv_usage=0.9)
    full = EngineLoad(kv_cache_usage=0.95, waiting=12, preemptions=0, new_preemptions=0)
    assert controller.update(100, full, in_flight=100, queued=50) == 90
    assert controller.update(100, full, in_flight=120, queued=50) == 100  # the last cut is not in effect yet
    near = EngineLoad(kv_cache_usage=0.95, waiting=0, preemptions=0, new_preemptions=0)
    assert controller.update(100, near, in_flight=100, queued=50) == 100  # full but nothing waits: hold
    assert controller.update(1, EngineLoad(1.0, 5, 9, 9), in_flight=1, queued=5) == 1  # never below one


def test_the_limit_respects_the_ceiling():
    async def main():
        engine = FakeEngine(per_request=0.0001)
        limiter = limiter_over(engine, limit=8, ceiling=50)
        tasks, done = await occupy(limiter, 400)
        limits = await settle(limiter, 15)
        assert max(limits) == 50 and limiter.in_flight == 50
        done.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_a_server_that_does_not_answer_leaves_the_limit_unchanged():
    async def main():
        a, b = FakeEngine(per_request=0.001), FakeEngine(per_request=0.001)
        limiter = limiter_over(a, b, limit=8)
        tasks, done = await occupy(limiter, 400)
        await settle(limiter, 2)
        before = limiter.limit
        b.answers = False
        assert await limiter.poll_once() is None
        a.preemptions += 1  # seen while b is silent, then counted once b answers again: the cut comes after
        await settle(limiter, 3)
        assert limiter.limit == before
        b.answers = True
        await settle(limiter, 1)
        assert limiter.limit == before // 2  # a's preemption was counted at the poll that saw it
        done.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_a_server_without_kv_usage_keeps_the_initial_limit():
    async def main():
        async def old_server():
            return [HealthResponse(running=3)]

        limiter = ConcurrencyLimiter(
            16, load=old_server, controller=AdaptiveController(ceiling=64, target_kv_usage=0.9)
        )
        tasks, done = await occupy(limiter, 100)
        assert await limiter.poll_once() is None and limiter.limit == 16
        assert "engine/kv_cache_usage" not in limiter.metrics()
        done.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())


def test_admission_is_first_come_and_survives_cancellation():
    async def main():
        limiter = ConcurrencyLimiter(2)
        order: list[int] = []
        gate = asyncio.Event()

        async def rollout(i: int):
            async with limiter:
                order.append(i)
                await gate.wait()

        tasks = [asyncio.create_task(rollout(i)) for i in range(6)]
        await asyncio.sleep(0.01)
        assert order == [0, 1] and limiter.queued == 4
        tasks[2].cancel()  # waiting: leaves the queue
        limiter.set_limit(4)
        await asyncio.sleep(0.01)
        assert order == [0, 1, 3, 4] and limiter.in_flight == 4
        limiter.set_limit(1)  # lower: nobody in flight is interrupted, nobody new starts
        gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert order == [0, 1, 3, 4, 5] and limiter.in_flight == 0

    asyncio.run(main())


class FakeHealthServer:
    """A fake engine's /health over HTTP (aiohttp in a thread): answers ``body``, or never while ``hang``."""

    def __init__(self):
        from aiohttp import web

        from tests.tiny import free_port

        self.body = HealthResponse(kv_cache_usage=0.1, preemptions=0).model_dump(mode="json")
        self.hang = False
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()

        async def health(request):
            while self.hang:
                await asyncio.sleep(0.05)
            return web.json_response(self.body)

        app = web.Application()
        app.router.add_get("/health", health)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.hang = False
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def fake_server():
    server = FakeHealthServer()
    yield server
    server.stop()


def test_limiter_polls_a_fake_engines_health_and_survives_it_hanging(fake_server):
    config = ClientConfig(base_url=fake_server.url, initial_concurrent=4, load_poll_interval=0.2)

    async def main():
        limiter = ConcurrencyLimiter.from_config(config)
        tasks, done = await occupy(limiter, 100)  # the first `async with` starts the polling task
        deadline = time.monotonic() + 30
        while limiter.limit <= 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert limiter.limit > 4 and limiter.metrics()["engine/kv_cache_usage"] == pytest.approx(0.1)
        fake_server.hang = True
        await asyncio.sleep(0.3)
        held = limiter.limit
        started = time.monotonic()
        assert await limiter.poll_once() is None  # bounded by the poll interval, not by the server
        assert time.monotonic() - started < 5 and limiter.limit == held
        await asyncio.sleep(0.6)
        assert limiter.limit == held
        fake_server.hang = False
        fake_server.body = {**fake_server.body, "preemptions": 4}
        deadline = time.monotonic() + 30
        while limiter.limit >= held and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert limiter.limit < held
        done.set()
        await asyncio.gather(*tasks)
        await limiter.aclose()

    asyncio.run(main())


def test_a_server_that_is_down_reads_as_no_answer():
    from tests.tiny import free_port

    async def main():
        poller = HealthPoller(ClientConfig(base_url=f"http://127.0.0.1:{free_port()}", load_poll_interval=0.2))
        assert await poller() == [None]
        await poller.aclose()

    asyncio.run(main())


def test_torch_engine_reports_kv_cache_usage_under_load(torch_server):
    """The real torch engine: while rollouts decode, /health reports the cache they hold and the limiter reads it."""
    body = {"token_ids": list(range(5, 25)), "sampling_params": {"max_tokens": 160, "temperature": 1.0,
                                                                 "ignore_eos": True}}  # fmt: skip

    async def main():
        poller = HealthPoller(ClientConfig(base_url=torch_server.url))
        async with httpx.AsyncClient(timeout=300) as client:
            posts = [asyncio.create_task(client.post(f"{torch_server.url}/inference/v1/generate", json=body))
                     for _ in range(40)]  # fmt: skip
            seen: list[HealthResponse] = []
            while not all(p.done() for p in posts):
                (health,) = await poller()
                if health is not None and health.running:
                    seen.append(health)
                await asyncio.sleep(0.05)
            assert [p.result().status_code for p in posts] == [200] * len(posts)
        (idle,) = await poller()
        await poller.aclose()
        return seen, idle

    seen, idle = asyncio.run(main())
    assert seen, "no /health answer while requests ran"
    busiest = max(seen, key=lambda h: h.kv_cache_usage or 0)
    # 32 slots of 512 positions: the running sequences hold their prompt and sampled tokens.
    assert 0 < busiest.kv_cache_usage <= 32 * (20 + 160) / (32 * 512)
    assert busiest.running == 32 and max(h.waiting for h in seen) > 0  # 40 requests, 32 slots
    assert all(h.preemptions == 0 for h in seen)
    assert idle.kv_cache_usage == 0 and idle.running == 0


def test_a_server_whose_engine_died_is_a_warning_once(caplog):
    """A server with several vLLM engines serves on when one dies (its weight loads skip it); before, nothing on the
    orchestrator's side said so, and the run went on at part of its throughput unnoticed."""
    poller = HealthPoller(ClientConfig(base_url="http://127.0.0.1:9"))
    with caplog.at_level(logging.WARNING, logger="prime.orchestrator.concurrency"):
        for dead in ([], [1], [1], [0, 1]):
            poller._check("http://127.0.0.1:9", HealthResponse(weight_step=3, engines=2, dead_engines=dead))
    assert [r.getMessage() for r in caplog.records] == [
        "inference server http://127.0.0.1:9: vLLM engine(s) 1 of 2 died; it serves with the others (slower)",
        "inference server http://127.0.0.1:9: vLLM engine(s) 0 of 2 died; it serves nothing",
    ]


def test_a_server_restarted_before_any_poll_saw_the_loaded_step_is_named():
    """The relay loaded steps 1 and 2 within one poll interval and the server restarted right after: every poll had
    seen step 0, so its 0 after the restart was nothing new, and the rollouts sampled from the base model counted as
    step 2's (CI failed on it: the run went on until the next load, which hid the restart for good). The poll now
    knows each step the relay loaded; an answer to a poll that left before the load ended is not held against it."""
    from prime_orchestrator.concurrency import ServerChanged

    url = "http://127.0.0.1:9"
    poller = HealthPoller(ClientConfig(base_url=url))
    poller._polls = 4
    poller._check(url, HealthResponse(weight_step=0), poll=4)
    poller.served(1)
    poller.served(2)
    poller._check(url, HealthResponse(weight_step=1), poll=4)  # left before the load of step 2 ended
    with pytest.raises(ServerChanged, match=r"now serves weights step 0 after step 2 \(it restarted"):
        poller._check(url, HealthResponse(weight_step=0), poll=5)
    poller._check(url, HealthResponse(weight_step=2), poll=5)
