"""Several vLLM engines behind one server (``vllm.engines``), without a GPU: `VllmEngine` over stand-ins for vLLM's
``AsyncLLM``. Requests spread over the engines, each request's sampled log-probs come from the engine that ran it,
weight loads and pauses reach every engine, and the step count ``/health`` reports stops when one busy engine stops."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from prime_core.config import ConfigError, load_config
from prime_core.config.inference import InferenceConfig
from prime_inference.engines.base import EngineRequest
from prime_inference.engines.vllm_engine import VllmEngine
from prime_inference.engines.vllm_load import EngineLoad
from prime_inference.engines.vllm_replicas import EngineReplicas, RoutedTap, StepRounds, _prompt_hash, start_engines
from prime_inference.protocol import RequestError, SamplingParams


class StandInLLM:
    """One engine: ``generate`` holds each request until ``release`` (then one final output of token ``tag``), its
    workers' tap knows the requests it generated, and every admin call is recorded."""

    def __init__(self, tag: int):
        self.tag, self.calls, self.generated = tag, [], []
        self.release = asyncio.Event()
        self.refuse: str | None = None
        self.renderer = SimpleNamespace(render_cmpl_async=self._render)

    @staticmethod
    async def _render(prompts):
        return [{"type": "token", **p} for p in prompts]

    async def generate(self, prompt, params, request_id, lora_request=None):
        self.generated.append(request_id)
        await self.release.wait()
        out = SimpleNamespace(token_ids=[self.tag], logprobs=None, finish_reason="length", stop_reason=None)
        yield SimpleNamespace(outputs=[out], finished=True)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        if method == "prime_take_token_logprobs":
            (ids,) = args
            return [{rid: ([2], [self.tag], [-0.1 * self.tag]) for rid in ids if rid in self.generated}]
        return [self.refuse]

    async def pause_generation(self, **kwargs):
        self.calls.append("pause")

    async def resume_generation(self):
        self.calls.append("resume")

    async def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    async def reset_encoder_cache(self):
        self.calls.append("reset_encoder_cache")


def engine_over(llms: list[StandInLLM]) -> VllmEngine:
    engine = VllmEngine.__new__(VllmEngine)  # no vLLM here: the engine's state around stand-in engines
    engine.llm = EngineReplicas(llms)
    engine.weight_step, engine.weight_dir, engine._adapters = 3, None, {}
    engine._in_flight, engine._unusable, engine._steps = 0, None, 0
    engine._paused, engine._swapping = False, False
    engine._admin_lock, engine.in_flight_updates = asyncio.Lock(), False
    engine._sampling_params = lambda request, tapped: None

    def rpc_of(llm):
        async def take(ids):
            return await llm.collective_rpc("prime_take_token_logprobs", args=(ids,))

        return take

    engine._tap = RoutedTap(engine.llm, rpc_of)
    return engine


async def outputs(engine: VllmEngine, request_id: str, prompt: list[int] | None = None, tag: str | None = None) -> list:
    params = SamplingParams(max_tokens=1, logprobs=0)
    request = EngineRequest(request_id, prompt or [1, 2], params, stream=False, session=tag)
    return [o async for o in engine.generate(request)]


def prompt_of(engine: int) -> list[int]:
    """A prompt that hashes to ``engine`` of two."""
    return next([1, n] for n in range(100) if _prompt_hash([1, n]) % 2 == engine)


def test_a_group_shares_an_engine_and_the_engines_stay_within_a_group():
    async def scenario():
        llms = [StandInLLM(10), StandInLLM(20)]
        engine = engine_over(llms)
        home = _prompt_hash([1, 2]) % 2
        runs = [asyncio.create_task(outputs(engine, f"g{i}")) for i in range(12)]  # one prompt: 12 samples
        await asyncio.sleep(0.01)
        assert llms[home].generated[:8] == [f"g{i}" for i in range(8)]  # a group of 8 on one engine's cache
        assert engine.llm.in_flight[home] - engine.llm.in_flight[1 - home] <= 8 + 1
        assert sorted(engine.llm.in_flight) == [2, 10]
        for llm in llms:
            llm.release.set()
        await asyncio.gather(*runs)
        assert engine.llm.in_flight == [0, 0]

    asyncio.run(scenario())


def test_a_rollouts_next_turn_goes_to_the_engine_that_cached_its_history(monkeypatch):
    """Before: each turn went where its prompt hashed, so with two engines half of a multi-turn rollout's turns
    prefilled its whole history again on the engine whose cache did not hold it."""
    import prime_inference.engines.vllm_replicas as replicas

    async def scenario():
        llms = [StandInLLM(10), StandInLLM(20)]
        engine = engine_over(llms)
        for llm in llms:
            llm.release.set()
        await outputs(engine, "a-turn1", prompt_of(0), tag="rollout-a")
        await outputs(engine, "a-turn2", prompt_of(1), tag="rollout-a")  # its longer prompt hashes to engine 1
        await outputs(engine, "b-turn1", prompt_of(1))  # untagged: where its prompt hashes
        assert llms[0].generated == ["a-turn1", "a-turn2"] and llms[1].generated == ["b-turn1"]

        llms[0].release.clear()  # engine 0 busy with 9 more than engine 1: the turn goes to the least busy
        busy = [asyncio.create_task(outputs(engine, f"g{i}", prompt_of(0))) for i in range(9)]
        await asyncio.sleep(0.01)
        await outputs(engine, "a-turn3", prompt_of(0), tag="rollout-a")
        assert llms[1].generated[-1] == "a-turn3"
        llms[0].release.set()
        await asyncio.gather(*busy)
        await outputs(engine, "a-turn4", prompt_of(0), tag="rollout-a")  # and stays there: its cache is there now
        assert llms[1].generated[-1] == "a-turn4"

        monkeypatch.setattr(replicas, "SESSIONS", 2)  # the least recently served rollouts are forgotten
        for tag in ("c", "d", "e"):
            await outputs(engine, f"{tag}-turn1", prompt_of(1), tag=tag)
        assert list(engine.llm._sessions) == ["d", "e"]

    asyncio.run(scenario())


def test_requests_take_log_probs_from_the_engine_that_ran_them():
    async def scenario():
        llms = [StandInLLM(10), StandInLLM(20)]
        engine = engine_over(llms)
        runs = [asyncio.create_task(outputs(engine, f"r{i}", prompt_of(i % 2))) for i in range(6)]
        await asyncio.sleep(0.01)
        assert engine.llm.in_flight == [3, 3] and llms[0].generated == ["r0", "r2", "r4"]
        for llm in llms:
            llm.release.set()
        done = [(await run)[0] for run in runs]
        # Each request's token and log-prob come from the engine that generated it, asked of that engine only.
        assert [(o.token_ids, o.logprobs) for o in done[:2]] == [([10], [-1.0]), ([20], [-2.0])]
        for llm, mine in zip(llms, (["r0", "r2", "r4"], ["r1", "r3", "r5"]), strict=True):
            assert "prime_take_token_logprobs" in llm.calls and llm.generated == mine
        assert engine.llm.in_flight == [0, 0] and engine.llm._owner == {}

    asyncio.run(scenario())


def test_a_weight_load_reaches_every_engine_and_one_refusal_stops_the_server():
    async def scenario():
        llms = [StandInLLM(10), StandInLLM(20)]
        engine = engine_over(llms)
        await engine.update_weights("/w/step_4", 4)
        for llm in llms:
            assert llm.calls == ["pause", "prime_reload_weights", "reset_prefix_cache", "reset_encoder_cache", "resume"]
        assert engine.weight_step == 4
        llms[1].refuse = "the weights of step 5 hold NaN or infinite values (lm_head.weight)"
        with pytest.raises(RequestError, match="lm_head.weight"):
            await engine.update_weights("/w/step_5", 5)
        assert engine.weight_step == 4 and all(llm.calls[-1] == "resume" for llm in llms)
        with pytest.raises(RequestError) as unserved:  # neither engine serves half-loaded weights under step 4
            await outputs(engine, "r0")
        assert unserved.value.status_code == 503

    asyncio.run(scenario())


def test_the_step_count_stops_when_one_busy_engine_stops():
    busy = [True, True]
    rounds = StepRounds(2, lambda i: busy[i])
    rounds.stepped(0)  # the first round began with nobody pending
    start = rounds.count
    for _ in range(50):  # engine 0 steps on; engine 1 holds requests and makes no step
        rounds.stepped(0)
    assert rounds.count == start
    rounds.stepped(1)
    assert rounds.count == start + 1
    busy[1] = False  # engine 1 let its requests go (aborted): engine 0 alone counts again
    rounds.stepped(1)
    rounds.released(1)
    before = rounds.count
    rounds.stepped(0)
    rounds.stepped(0)
    assert rounds.count == before + 2


def test_engine_steps_on_health_are_rounds_and_loads_add_up():
    llms = [StandInLLM(10), StandInLLM(20)]
    engine = engine_over(llms)
    replicas = engine.llm
    replicas.read_loads([EngineLoad(3, 0, 0.5, 1), EngineLoad(0, 0, 0.0, 0)])
    assert replicas.running == [3, 0]  # what vLLM's routes run on the first engine counts it busy too
    counted = [engine._counting(lambda: None, i) for i in range(2)]
    assert counted and engine._engine_steps() == replicas.rounds.count
    merged = EngineLoad.merge([EngineLoad(3, 1, 0.5, 1), EngineLoad(1, 0, 0.25, 2)])
    assert merged == EngineLoad(4, 1, 0.375, 3)


def test_engines_need_one_data_parallel_replica(tmp_path):
    base = ["--model.name", "m", "--output-dir", str(tmp_path), "--engine", "vllm", "--vllm.engines", "2"]
    assert load_config(InferenceConfig, base).vllm.engines == 2
    with pytest.raises(ConfigError, match="data_parallel_size = 1"):
        load_config(InferenceConfig, [*base, "--vllm.data-parallel-size", "2"])
    with pytest.raises(ConfigError, match="engines"):
        load_config(InferenceConfig, [*base[:-1], "9"])


def test_engines_start_in_turn_and_a_failed_start_stops_those_up():
    started, stopped = [], []

    class Up:
        def __init__(self, i):
            self.i = i

        def shutdown(self):
            stopped.append(self.i)

    def start(i):
        if i == 2:
            raise RuntimeError("CUDA out of memory")  # the third engine finds no room
        started.append(i)
        return Up(i)

    with pytest.raises(RuntimeError, match="out of memory"):
        start_engines(3, start)
    assert started == [0, 1] and stopped == [0, 1]
    assert isinstance(start_engines(2, Up), EngineReplicas) and isinstance(start_engines(1, Up), Up)


def test_the_generate_route_hands_the_engine_the_rollout_each_request_is_a_turn_of(model_dir):
    import httpx

    from tests.fixtures.scripted import ScriptedServer

    server = ScriptedServer(model_dir, lambda text: None)
    sessions = []
    inner = server.engine.inner
    generate = inner.generate

    def recorded(request):
        sessions.append(request.session)
        return generate(request)

    inner.generate = recorded
    try:
        for extra in ({"prime_rollout": "rollout-7"}, None):
            sp = {"max_tokens": 2, "n": 2, "extra_args": extra}
            r = httpx.post(f"{server.url}/inference/v1/generate", json={"token_ids": [5, 6], "sampling_params": sp})
            assert r.status_code == 200, r.text
    finally:
        server.stop()
    assert sessions == ["rollout-7", "rollout-7", None, None]


class EngineDeadError(Exception):
    """vLLM's, as its engine-core client raises it for every call once the core died."""

    def __init__(self):
        super().__init__("EngineCore encountered an issue. See stack trace (above) for the root cause.")


class DeadLLM(StandInLLM):
    """An engine whose core died: vLLM's ``errored``, and every request fails at once, every admin call too.
    ``dies_in``: the admin call during which the core dies."""

    errored = False
    dies_in: str | None = None

    def _alive(self, call: str) -> None:
        if call == self.dies_in:
            self.errored = True
        if self.errored:
            raise EngineDeadError()

    async def pause_generation(self, **kwargs):
        self._alive("pause")
        await super().pause_generation(**kwargs)

    async def resume_generation(self):
        self._alive("resume")
        await super().resume_generation()

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self._alive(method)
        return await super().collective_rpc(method, timeout, args, kwargs)

    async def reset_prefix_cache(self):
        self._alive("reset_prefix_cache")
        await super().reset_prefix_cache()

    async def reset_encoder_cache(self):
        self._alive("reset_encoder_cache")
        await super().reset_encoder_cache()

    async def generate(self, prompt, params, request_id, lora_request=None):
        if self.errored:
            self.generated.append(request_id)
            raise RuntimeError("EngineDeadError")
        async for output in super().generate(prompt, params, request_id, lora_request):
            yield output


def test_an_engine_that_died_takes_no_more_requests():
    """Before: a dead engine fails each request at once, so it always held the fewest in flight and took every request
    the least-busy rule placed, and the rollouts it had served stayed with it: with engine 1 of 2 dead, 31 of 40
    concurrent and 40 of 40 sequential turns failed."""

    async def scenario():
        llms = [DeadLLM(10), DeadLLM(20)]
        engine = engine_over(llms)
        for llm in llms:
            llm.release.set()
        await outputs(engine, "a-turn1", prompt_of(1), tag="rollout-a")  # served by engine 1, which then dies
        llms[1].errored = True
        done = await asyncio.gather(
            *(outputs(engine, f"r{i}", prompt_of(i % 2), tag=f"rollout-{'a' if i < 5 else i}") for i in range(40)),
            return_exceptions=True,
        )
        assert [o for o in done if isinstance(o, BaseException)] == []
        assert llms[1].generated == ["a-turn1"] and len(llms[0].generated) == 40
        llms[0].errored = True  # both dead: the request fails naming them (before, vLLM's EngineDeadError: a 500)
        with pytest.raises(RequestError) as unserved:
            await outputs(engine, "last", prompt_of(0))
        assert unserved.value.status_code == 503 and unserved.value.permanent  # a client does not retry it
        assert unserved.value.message == "vLLM engines 0, 1 of 2 died: this server serves nothing until restarted"

    asyncio.run(scenario())


def test_a_weight_load_skips_dead_engines_and_fails_in_one_line_once_none_is_left():
    """Before: the load's pause reached the dead engine first, and vLLM's EngineDeadError went up unnamed: HTTP 500
    "internal error: EngineDeadError", for this and every later load, while the live engines went on serving the old
    step. Now the live engines load and serve; a dead engine (one that dies under the load too) missed the load and
    never takes a request again; once none is left, the load fails in one line naming them, and generation too."""

    async def scenario():
        llms = [DeadLLM(10), DeadLLM(20), DeadLLM(30)]
        engine = engine_over(llms)
        for llm in llms:
            llm.release.set()
        llms[1].errored = True  # died before the load
        llms[2].dies_in = "prime_reload_weights"  # dies under it
        await engine.update_weights("/w/step_4", 4)
        loaded = ["pause", "prime_reload_weights", "reset_prefix_cache", "reset_encoder_cache", "resume"]
        assert engine.weight_step == 4 and llms[0].calls == loaded
        assert llms[1].calls == [] and llms[2].calls == ["pause"] and engine.llm.dead == [1, 2]
        llms[2].errored = False  # even were it to answer again: it missed step 4
        await asyncio.gather(*(outputs(engine, f"r{i}", prompt_of(i % 2), tag=f"t{i}") for i in range(9)))
        assert len(llms[0].generated) == 9 and llms[1].generated == llms[2].generated == []

        llms[0].errored = True
        with pytest.raises(RequestError) as refused:
            await engine.update_weights("/w/step_5", 5)
        message = refused.value.message
        assert refused.value.status_code == 503 and engine.weight_step == 4
        assert message == "vLLM engines 0, 1, 2 of 3 died: weights step 5 not loaded; this server serves nothing " \
                          "until restarted"  # fmt: skip
        with pytest.raises(RequestError) as unserved:
            await outputs(engine, "last", prompt_of(0))
        assert unserved.value.status_code == 503 and unserved.value.message == message
        assert refused.value.permanent and unserved.value.permanent

    asyncio.run(scenario())
