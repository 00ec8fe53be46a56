"""The torch engine's scheduler thread is the peer every request and weight update waits on: when it dies (an
exception outside the step's own guard) or stops (shutdown), what waited on it fails with one line naming why;
before, each ``generate`` awaited its output queue forever."""

from __future__ import annotations

import asyncio

import pytest


def engine_of(model_dir):
    from prime_core.config.inference import InferenceConfig
    from prime_inference.engines.torch_engine import TorchEngine
    from transformers import AutoTokenizer

    config = InferenceConfig.model_validate(
        {"model": {"name": str(model_dir), "dtype": "float32"}, "engine": "torch", "max_model_len": 64,
         "log": {"file": False}}
    )  # fmt: skip
    return TorchEngine(config, AutoTokenizer.from_pretrained(model_dir))


async def first_output(engine, request_id: str):
    from prime_inference.engines.base import EngineRequest
    from prime_inference.protocol import SamplingParams

    params = SamplingParams(max_tokens=4, temperature=0.0)
    async for out in engine.generate(EngineRequest(request_id, [12, 40, 7], params)):
        return out


def test_requests_fail_when_the_scheduler_dies(model_dir):
    engine = engine_of(model_dir)

    def broken(*_):  # where an error escapes the step's guard (admission runs outside it)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine._waits_for_adapter = broken

    async def main():
        await engine.start()
        try:
            with pytest.raises(RuntimeError, match="scheduler died .*illegal memory access"):
                await asyncio.wait_for(first_output(engine, "a"), 5)
            with pytest.raises(RuntimeError, match="scheduler died"):  # a later request fails at once
                await asyncio.wait_for(first_output(engine, "b"), 5)
            with pytest.raises(RuntimeError, match="scheduler died"):  # so does a weight update
                await asyncio.wait_for(engine.update_weights(str(model_dir), 1), 10)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_a_request_waiting_at_shutdown_fails(model_dir):
    engine = engine_of(model_dir)

    async def main():
        await engine.start()
        await engine.pause()  # nothing is admitted: the request waits
        request = asyncio.create_task(first_output(engine, "a"))
        await asyncio.sleep(0.05)
        await engine.shutdown()
        with pytest.raises(RuntimeError, match="the torch engine shut down"):
            await asyncio.wait_for(request, 5)

    asyncio.run(main())
