"""The sampled-log-prob tap (``vllm.fast_token_logprobs``) on CPU: vLLM's V2 model runner and the engine's vLLM
client are stand-ins with the attributes the tap touches; the real thing runs in the GPU test of
test_vllm_engine.py."""

from __future__ import annotations

import asyncio
from collections import namedtuple
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prime_inference.engines.base import EngineRequest
from prime_inference.protocol import SamplingParams
from prime_inference.token_logprobs import TAP_FLAG, SampledLogprobTap, TapFetcher, align

LogprobsTensors = namedtuple("LogprobsTensors", "logprob_token_ids logprobs selected_token_ranks")


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor
    logprobs_tensors: LogprobsTensors | None
    num_sampled: torch.Tensor


class Runner:
    """What the tap reads of vLLM 0.26's V2 ``GPUModelRunner``."""

    is_last_pp_rank = True
    speculator = None
    max_num_reqs = 8

    def __init__(self):
        states = SimpleNamespace(num_logprobs=np.full(self.max_num_reqs, -1, np.int32))
        token_ids = SimpleNamespace(max_num_token_ids=lambda slots: 0)

        def add_request(req_idx, prompt_len, sampling_params):
            states.num_logprobs[req_idx] = -1 if sampling_params.logprobs is None else sampling_params.logprobs

        self.sampler = SimpleNamespace(
            sampling_states=states, logprob_token_ids_state=token_ids, add_request=add_request
        )
        self.next: SamplerOutput | None = None

    def sample(self, hidden_states, input_batch, grammar_output):
        return self.next, self.next.num_sampled, None

    def step(self, rows: list[tuple[str, int, int, int, float, int]]) -> SamplerOutput:
        """rows: (internal request id, slot, sequence length, sampled token, its log-prob, tokens sampled)."""
        rids, slots, seq_lens, tokens, values, sampled = zip(*rows, strict=True)
        self.next = SamplerOutput(
            torch.tensor(tokens).view(-1, 1),
            LogprobsTensors(torch.tensor(tokens).view(-1, 1), torch.tensor(values).view(-1, 1), torch.zeros(len(rows))),
            torch.tensor(sampled),
        )
        batch = SimpleNamespace(
            req_ids=list(rids), num_reqs=len(rows), idx_mapping_np=np.array(slots), seq_lens=torch.tensor(seq_lens)
        )
        out, _, _ = self.sample(None, batch, None)
        return out


def params(logprobs: int | None, tapped: bool) -> SimpleNamespace:
    return SimpleNamespace(logprobs=logprobs, extra_args={TAP_FLAG: True} if tapped else None)


def test_tap_files_values_by_position_and_drops_vllms_tensors_only_when_nobody_else_needs_them():
    runner = Runner()
    tap = SampledLogprobTap.install(runner)
    assert tap is not None
    add = runner.sampler.add_request
    add(0, 3, params(0, tapped=True))  # A: prompt of 3 tokens
    add(1, 5, params(None, tapped=False))  # B: no log-probs
    add(2, 4, params(0, tapped=True))  # C: prompt of 4 tokens
    add(3, 2, params(0, tapped=False))  # D: vLLM's own log-probs (an OpenAI route)

    # A's first prefill chunk samples nothing; B wants no log-probs: vLLM's tensors are not needed downstream.
    out = runner.step([("A-1234abcd", 0, 2, 99, -9.0, 0), ("B-1234abcd", 1, 5, 7, -3.0, 1)])
    assert out.logprobs_tensors is None
    out = runner.step([("A-1234abcd", 0, 3, 11, -0.5, 1), ("C-1234abcd", 2, 4, 21, -1.0, 1)])
    assert out.logprobs_tensors is None
    # D asked vLLM for its log-probs: the tensors stay, the tap still files A's value.
    out = runner.step([("A-1234abcd", 0, 4, 12, -0.25, 1), ("D-1234abcd", 3, 2, 5, -2.0, 1)])
    assert out.logprobs_tensors is not None
    # A preempted and resumed: position 4 sampled again (the last value wins), then a token after A's stop.
    runner.step([("A-1234abcd", 0, 4, 13, -0.75, 1)])
    runner.step([("A-1234abcd", 0, 5, 14, -0.1, 1)])

    got = tap.take(["A", "C", "never-seen"])
    assert sorted(got) == ["A", "C"]
    assert align(got["A"], 3, [11, 13]) == ([-0.5, -0.75], [0, 0])
    assert align(got["C"], 4, [21]) == ([-1.0], [0])
    assert align(got["A"], 3, [11, 12]) is None  # the values belong to other tokens
    assert align(got["C"], 4, [21, 22]) is None  # a token without a value
    assert align(None, 4, [21]) is None
    assert tap.take(["A", "C"]) == {}  # handed over once
    assert tap.filing == {} and tap.internal_ids == {}  # nothing kept for requests handed over
    assert "B" not in got and "D" not in got


def test_tap_files_each_value_with_the_weight_step_that_sampled_it():
    runner = Runner()
    tap = SampledLogprobTap.install(runner)
    runner.sampler.add_request(0, 2, params(0, tapped=True))
    runner.step([("A-1234abcd", 0, 2, 11, -0.5, 1)])
    tap.set_version(4)  # an in-flight update between two engine steps (the worker runs both on one thread)
    runner.step([("A-1234abcd", 0, 3, 12, -0.25, 1)])
    tap.set_version(5)
    runner.step([("A-1234abcd", 0, 4, 13, -0.125, 1)])
    assert align(tap.take(["A"])["A"], 2, [11, 12, 13]) == ([-0.5, -0.25, -0.125], [0, 4, 5])
    assert align(([2], [11], [-0.5]), 2, [11]) == ([-0.5], None)  # values filed without steps


def test_tap_is_not_installed_where_rows_are_not_requests():
    runner = Runner()
    runner.speculator = object()  # speculative decoding: several logits rows per request
    assert SampledLogprobTap.install(runner) is None
    runner = Runner()
    runner.is_last_pp_rank = False
    assert SampledLogprobTap.install(runner) is None
    assert SampledLogprobTap.install(SimpleNamespace(sampler=None)) is None


def test_fetcher_takes_requests_that_finish_together_in_one_rpc():
    entries = {"a": ([3], [11], [-0.5]), "b": ([4], [21], [-1.0])}
    calls = []

    async def rpc(ids):
        calls.append(ids)
        return [{k: v for k, v in entries.items() if k in ids}, {"a": entries["a"]}]  # two tensor-parallel ranks

    async def main():
        fetcher = TapFetcher(rpc)
        got = await asyncio.gather(fetcher.take("a"), fetcher.take("b"), fetcher.take("c"))
        assert got == [entries["a"], entries["b"], None]
        assert calls == [["a", "b", "c"]]
        fetcher.forget("aborted")
        await asyncio.sleep(0.01)
        assert calls[-1] == ["aborted"]

        async def broken(ids):
            raise ConnectionError("engine core died")

        with pytest.raises(ConnectionError):
            await asyncio.wait_for(TapFetcher(broken).take("a"), 5)

    asyncio.run(main())


class FakeLLM:
    """vLLM's ``AsyncLLM`` as the engine uses it: ``generate`` (one final output) and ``collective_rpc``."""

    def __init__(self, token_ids, vllm_logprobs=None):
        self.token_ids, self.vllm_logprobs, self.rpcs = token_ids, vllm_logprobs, []
        self.renderer = SimpleNamespace(render_cmpl_async=self._render)

    @staticmethod
    async def _render(prompts):
        """vLLM's renderer turns each prompt dict into an engine input (``type`` "token" for token ids)."""
        return [{"type": "token", **p} for p in prompts]

    async def generate(self, prompt, params, request_id, lora_request=None):
        out = SimpleNamespace(
            token_ids=self.token_ids, logprobs=self.vllm_logprobs, finish_reason="length", stop_reason=None
        )
        yield SimpleNamespace(outputs=[out], finished=True)

    async def collective_rpc(self, method, args=()):
        self.rpcs.append((method, args))
        (ids,) = args
        return [{rid: ([2, 3], [11, 12], [-0.5, -0.25]) for rid in ids if rid.startswith("r")}]


def engine_with(llm: FakeLLM):
    from prime_inference.engines.vllm_engine import VllmEngine

    engine = VllmEngine.__new__(VllmEngine)  # no vLLM here: the engine's state around a stand-in client
    engine.llm, engine.weight_step, engine._adapters, engine.seen = llm, 3, {}, []
    engine._in_flight, engine._unusable = 0, None  # the liveness counter and load state __init__ sets
    engine.in_flight_updates = False
    engine._sampling_params = lambda request, tapped: engine.seen.append(tapped)

    async def take(ids):
        return await llm.collective_rpc("prime_take_token_logprobs", args=(ids,))

    engine._tap = TapFetcher(take)
    return engine


def run(engine, request: EngineRequest) -> list:
    async def main():
        return [o async for o in engine.generate(request)]

    return asyncio.run(main())


def test_engine_reads_tapped_logprobs_for_the_rl_pattern_only():
    engine = engine_with(FakeLLM([11, 12]))
    (out,) = run(engine, EngineRequest("r1", [1, 2], SamplingParams(max_tokens=2, logprobs=0), stream=False))
    assert out.logprobs == [-0.5, -0.25] and out.token_ids == [11, 12] and out.weight_step == 3
    assert out.weight_steps == [3, 3] and out.versions_exact is False  # the stand-in worker filed no steps: bounds
    assert engine.seen == [True] and engine.llm.rpcs == [("prime_take_token_logprobs", (["r1"],))]
    # renderers' client asks for logprobs=1: on the token-in route that is the sampled token's entry alone too.
    (out,) = run(engine, EngineRequest("r5", [1, 2], SamplingParams(max_tokens=2, logprobs=1), stream=False))
    assert out.logprobs == [-0.5, -0.25] and engine.seen == [True, True] and len(engine.llm.rpcs) == 2
    # Streamed, top-k, or no log-probs: vLLM's own path, no RPC.
    run(engine, EngineRequest("r2", [1, 2], SamplingParams(max_tokens=2, logprobs=0), stream=True))
    run(engine, EngineRequest("r3", [1, 2], SamplingParams(max_tokens=2, logprobs=2), stream=False))
    (out,) = run(engine, EngineRequest("r4", [1, 2], SamplingParams(max_tokens=2), stream=False))
    assert engine.seen == [True, True, False, False, False] and len(engine.llm.rpcs) == 2 and out.logprobs is None


def test_engine_falls_back_to_vllms_values_and_fails_loudly_without_either():
    engine = engine_with(FakeLLM([11, 12], vllm_logprobs=[{11: SimpleNamespace(logprob=-0.1)},
                                                          {12: SimpleNamespace(logprob=-0.2)}]))  # fmt: skip
    (out,) = run(engine, EngineRequest("x1", [1, 2], SamplingParams(max_tokens=2, logprobs=0), stream=False))
    assert out.logprobs == [-0.1, -0.2]  # the tap had nothing for x1: vLLM's values, complete
    engine = engine_with(FakeLLM([11, 12]))
    with pytest.raises(RuntimeError, match="sampled log-probs missing for request x2"):
        run(engine, EngineRequest("x2", [1, 2], SamplingParams(max_tokens=2, logprobs=0), stream=False))


class UpdatingLLM(FakeLLM):
    """A stand-in that records how the engine brackets a weight update, and whose tap files weight steps."""

    def __init__(self):
        super().__init__([11, 12])
        self.calls, self.prompts = [], []

    async def generate(self, prompt, params, request_id, lora_request=None):
        self.prompts.append(prompt)
        async for out in super().generate(prompt, params, request_id, lora_request):
            yield out

    async def pause_generation(self, *, mode, clear_cache):
        self.calls.append(("pause", mode, clear_cache))

    async def resume_generation(self):
        self.calls.append(("resume",))

    async def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    async def reset_encoder_cache(self):
        self.calls.append(("reset_encoder_cache",))

    async def collective_rpc(self, method, args=(), kwargs=None):
        if method == "prime_take_token_logprobs":
            return [{rid: ([2, 3], [11, 12], [-0.5, -0.25], [3, 4]) for rid in args[0]}]
        self.calls.append((method, kwargs))
        return [None]


@pytest.mark.parametrize("mode", ["in_flight", "drain"])
def test_vllm_update_keeps_running_requests_in_flight_and_drains_otherwise(mode):
    import asyncio as aio

    llm = UpdatingLLM()
    engine = engine_with(llm)
    engine.in_flight_updates, engine._paused, engine._admin_lock, engine.weight_dir = (
        mode == "in_flight",
        False,
        None,
        None,
    )

    async def main():
        engine._admin_lock = aio.Lock()
        await engine.update_weights("/w/step_4", 4)
        return [o async for o in engine.generate(EngineRequest("r1", [1, 2], SamplingParams(max_tokens=2, logprobs=0),
                                                               stream=False))]  # fmt: skip

    (out,) = aio.run(main())
    reload = ("prime_reload_weights", {"weights_path": "/w/step_4", "version": 4})
    if mode == "in_flight":  # frozen at a step boundary, KV kept; new requests' prefixes salted by the weight step
        assert llm.calls == [("pause", "keep", False), reload, ("reset_encoder_cache",), ("resume",)]
        assert llm.prompts[-1]["cache_salt"] == "prime-weights-4"
    else:
        assert llm.calls == [("pause", "wait", False), reload, ("reset_prefix_cache",), ("reset_encoder_cache",),
                             ("resume",)]  # fmt: skip
        assert "cache_salt" not in llm.prompts[-1]
    assert engine.weight_step == 4 and engine.weight_dir == "/w/step_4"
    # The worker filed each token with the step that sampled it: exact per-token steps of a request spanning an update.
    assert out.weight_steps == [3, 4] and out.versions_exact is True
