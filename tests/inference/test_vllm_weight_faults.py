"""Broken weights on the vLLM engine, without a GPU: vLLM loads weights in place, so a load that brings NaNs (or
fails part-way) is caught after it and the server stops serving under the old step's name until a complete load.

The worker side runs `PrimeWorkerExtension` over a CPU model standing in for vLLM's; the engine side runs
`VllmEngine`'s swap over a stand-in for vLLM's ``AsyncLLM``.
"""

from __future__ import annotations

import asyncio
import importlib.util
from types import SimpleNamespace

import httpx
import pytest
import torch
from prime_inference.engines.vllm_engine import VllmEngine
from prime_inference.protocol import RequestError
from prime_inference.vllm_plugin import PrimeWorkerExtension


class Worker(PrimeWorkerExtension):
    """vLLM's GPU worker as the extension sees it: a model runner, and an in-place ``reload_weights``."""

    def __init__(self, files: dict[str, dict[str, torch.Tensor]]):
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, dtype=torch.bfloat16))
        self.model_runner = SimpleNamespace(get_model=lambda: self.model)
        self.files = files

    def reload_weights(self, weights_path: str) -> None:
        self.model.load_state_dict(self.files[weights_path], strict=False)


def test_the_worker_refuses_weights_it_loaded_with_a_nan_naming_the_tensor():
    nan = torch.full((4, 4), float("nan"), dtype=torch.bfloat16)
    worker = Worker({"good": {"0.weight": torch.ones(4, 4)}, "bad": {"1.weight": nan}})
    assert worker.prime_reload_weights("good", version=1) is None
    # Returned, not raised: vLLM's engine core would log a raised one as a traceback.
    refusal = worker.prime_reload_weights("bad", version=2)
    assert refusal == "the weights of step 2 hold NaN or infinite values (1.weight)"


def test_the_worker_checks_infinities_and_every_float_dtype():
    worker = Worker({"inf": {"0.bias": torch.tensor([0.0, float("inf"), 0.0, 0.0])}})
    assert "(0.bias)" in worker.prime_reload_weights("inf", version=5)


class StandInLLM:
    """The parts of vLLM's ``AsyncLLM`` a weight swap uses; ``fail`` makes the next worker RPC fail as vLLM reports
    a worker's exception."""

    def __init__(self):
        self.fail: str | None = None
        self.refuse: str | None = None
        self.resumed = 0

    async def pause_generation(self, **kwargs):
        pass

    async def resume_generation(self):
        self.resumed += 1

    async def collective_rpc(self, method, kwargs):
        if self.fail is not None:
            raise Exception(f"Call to collective_rpc method failed: {self.fail}")
        return [self.refuse]

    async def reset_prefix_cache(self):
        pass

    async def reset_encoder_cache(self):
        pass


def stand_in_engine() -> VllmEngine:
    engine = VllmEngine.__new__(VllmEngine)  # no vLLM here: the swap's state only
    engine.llm = StandInLLM()
    engine.weight_step, engine.weight_dir = 2, "/w/step_2"
    engine._paused, engine._swapping, engine._unusable = False, False, None
    engine._admin_lock, engine.in_flight_updates = asyncio.Lock(), False
    return engine


async def first_output(engine: VllmEngine):
    async for output in engine.generate(SimpleNamespace()):
        return output


@pytest.mark.parametrize("how", ["raised", "returned"])
def test_a_failed_load_stops_the_server_serving_until_a_complete_one(how):
    """Before, the engine resumed serving the half-loaded (or NaN) weights under step 2's name: every request sampled
    token 0 while /health said step 2. A load fails by raising (a file cut short) or with a worker's refusal (NaN)."""

    async def scenario():
        engine = stand_in_engine()
        reason = "the weights of step 3 hold NaN or infinite values (model.layers.0.mlp.down_proj.weight)"
        setattr(engine.llm, "fail" if how == "raised" else "refuse", reason)
        with pytest.raises(RequestError) as refused:
            await engine.update_weights("/w/step_3", 3)
        assert refused.value.status_code == 400 and refused.value.param == "weight_dir"
        assert "step 3" in refused.value.message and "down_proj.weight" in refused.value.message
        assert "\n" not in refused.value.message and engine.llm.resumed == 1 and engine.weight_step == 2
        with pytest.raises(RequestError) as unserved:
            await first_output(engine)
        assert unserved.value.status_code == 503 and unserved.value.message == refused.value.message
        assert not unserved.value.permanent  # a complete load ends it: clients may retry

        engine.llm.fail = engine.llm.refuse = None  # the next complete load serves again
        await engine.update_weights("/w/step_4", 4)
        assert engine._unusable is None and engine.weight_step == 4 and engine.weight_dir == "/w/step_4"

    asyncio.run(scenario())


class EngineDeadError(Exception):
    """vLLM's, as its engine-core client raises it for every call once the core died."""


class DeadLLM(StandInLLM):
    """An engine whose core died: vLLM's ``errored``, and every call fails."""

    errored = True

    async def pause_generation(self, *args, **kwargs):
        raise EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause.")

    resume_generation = collective_rpc = add_lora = pause_generation


@pytest.mark.parametrize("paused", [False, True])
def test_a_load_after_the_engine_died_fails_in_one_line_naming_it(paused):
    """Before: the load's pause ran outside the code that names a failed load, so vLLM's EngineDeadError went up as
    HTTP 500 "internal error: EngineDeadError"; paused, the RPC's error was taken for a refused load (400, "serves
    nothing until weights load completely": they never will)."""

    async def scenario():
        engine = stand_in_engine()
        engine.llm, engine._paused = DeadLLM(), paused
        with pytest.raises(RequestError) as unserved:  # generation names it too (before: an unnamed 500)
            await first_output(engine)
        assert unserved.value.message == "vLLM engine 0 of 1 died: this server serves nothing until restarted"
        with pytest.raises(RequestError) as refused:
            await engine.update_weights("/w/step_3", 3)
        assert refused.value.status_code == 503 and engine.weight_step == 2
        assert refused.value.message == ("vLLM engine 0 of 1 died (EngineDeadError): weights step 3 not loaded; "
                                         "this server serves nothing until restarted")  # fmt: skip
        with pytest.raises(RequestError) as unserved:
            await first_output(engine)
        assert unserved.value.status_code == 503 and unserved.value.message == refused.value.message
        assert refused.value.permanent and unserved.value.permanent  # until restarted: not worth a retry

    asyncio.run(scenario())


@pytest.mark.parametrize("call", ["pause", "resume", "load_adapter"])
def test_admin_calls_on_a_dead_engine_are_one_line_naming_it(monkeypatch, call):
    """Before: vLLM's EngineDeadError out of /pause, /resume or a LoRA adapter load (a LoRA run's weight update): HTTP
    500 "internal error: EngineDeadError"."""
    import sys

    lora = SimpleNamespace(LoRARequest=lambda **fields: SimpleNamespace(**fields))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora)  # no vllm here

    async def scenario():
        engine = stand_in_engine()
        engine.llm, engine.config = DeadLLM(), SimpleNamespace(lora_enabled=True)
        engine._adapters, engine._next_lora_id = {}, 1
        args = ("policy", "/w/adapter_3", 3) if call == "load_adapter" else ()
        with pytest.raises(RequestError) as refused:
            await getattr(engine, call)(*args)
        return refused.value

    refused = asyncio.run(scenario())
    what = {"pause": "not paused", "resume": "not resumed", "load_adapter": "LoRA adapter 'policy' not loaded"}[call]
    assert refused.status_code == 503
    assert refused.message == f"vLLM engine 0 of 1 died (EngineDeadError): {what}; this server serves nothing until " \
                              "restarted"  # fmt: skip


def test_the_relay_names_the_dead_engine_in_one_line_and_does_not_retry_it(model_dir, other_weights_dir):
    """Through the route and the orchestrator's relay: before, the relay's error was "POST .../update_weights failed
    after 2 attempts: HTTPStatusError('500: {"error":{"message":"internal error: EngineDeadError",...')", naming
    no engine; now one line names the server, the step and the dead engine. The 503 carries the permanent-fault
    header, so the relay ends at the first answer: before, it asked 4 times over 3.5 s (client.max_retries = 3)."""
    from prime_core.schemas.errors import is_permanent
    from prime_orchestrator import client

    from tests.fixtures.scripted import ScriptedServer

    server = ScriptedServer(model_dir, lambda text: None)
    dead = stand_in_engine()
    dead.llm = DeadLLM()
    asked: list[int] = []

    async def update_weights(*args, **kwargs):
        asked.append(1)
        return await dead.update_weights(*args, **kwargs)

    server.engine.update_weights = update_weights  # the route's engine, as a vLLM engine whose core died
    try:
        with pytest.raises(client.WeightUpdateError) as failed:
            asyncio.run(client.update_weights([server.url], str(other_weights_dir), 3, api_key=None, timeout=30,
                                              retries=3))  # fmt: skip
        answer = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(other_weights_dir), "step": 3})
    finally:
        server.stop()
    assert str(failed.value) == (
        f"inference server {server.url} failed to load weights step 3 ({other_weights_dir}): POST {server.url}"
        "/update_weights -> 503: vLLM engine 0 of 1 died (EngineDeadError): weights step 3 not loaded; this server "
        "serves nothing until restarted (permanent: not retried)"
    )
    assert len(asked) == 2  # the relay's one, and the direct one
    assert answer.status_code == 503 and is_permanent(answer.headers)


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm extra not installed")
def test_vllm_refuses_nan_weights_and_serves_nothing_until_a_complete_load(model_dir, other_weights_dir, tmp_path):
    """The stand-ins above, on the real vLLM worker: a weight directory with one NaN tensor is refused in one line
    naming the tensor, generation answers 503 (not token 0 under the old step's name), and the next complete load
    serves its weights."""
    import shutil

    import httpx
    from prime_core.io import mark_stable
    from safetensors.torch import load_file, save_file

    from .helpers import start_vllm_server

    bad = tmp_path / "step_2"
    shutil.copytree(other_weights_dir, bad)
    file = next(bad.glob("*.safetensors"))
    state = load_file(file)
    state["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(state, file, metadata={"format": "pt"})
    mark_stable(bad)
    server = start_vllm_server(model_dir)
    try:
        body = {"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 8, "temperature": 0}}
        generate = f"{server.url}/inference/v1/generate"
        assert httpx.post(generate, json=body, timeout=120).status_code == 200
        refused = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(bad), "step": 2}, timeout=600)
        assert refused.status_code == 400, refused.text
        message = refused.json()["error"]["message"]
        assert "step 2" in message and "down_proj" in message and "\n" not in message
        unserved = httpx.post(generate, json=body, timeout=120)
        assert unserved.status_code == 503 and httpx.get(f"{server.url}/health").json()["weight_step"] == 0
        good = {"weight_dir": str(other_weights_dir), "step": 3}
        assert httpx.post(f"{server.url}/update_weights", json=good, timeout=600).status_code == 200
        served = httpx.post(generate, json=body, timeout=120)
        assert served.status_code == 200 and httpx.get(f"{server.url}/health").json()["weight_step"] == 3
    finally:
        server.stop()
