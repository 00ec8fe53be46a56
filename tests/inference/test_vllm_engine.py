"""The vLLM engine: import-level checks on CPU, real serving on a GPU (marker `gpu`)."""

from __future__ import annotations

import importlib.util
import time

import httpx
import pytest
from prime_core.config.inference import InferenceConfig

from .helpers import start_server, start_vllm_server

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_plugin_module_imports_without_vllm_or_torch():
    import subprocess
    import sys

    code = (
        "import sys, prime_inference.vllm_plugin as p\np.register(); p.register()\n"
        "assert p.plugin_registered()\n"
        "assert p.PrimeWorkerExtension().prime_plugin_status()['general_plugin']\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'vllm'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_plugin_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("prime") == "prime_inference.vllm_plugin:register"


def test_vllm_cli_args_pass_options_through():
    from prime_inference.engines.vllm_engine import WORKER_EXTENSION_CLS, vllm_cli_args

    config = InferenceConfig.model_validate(
        {"model": {"name": "m"}, "max_model_len": 4096,
         "vllm": {"tensor_parallel_size": 2, "data_parallel_size": 4, "data_parallel_size_local": 2,
                  "data_parallel_address": "10.0.0.1", "enforce_eager": True, "extra_args": ["--kv-cache-dtype", "fp8"]}}
    )  # fmt: skip
    args = vllm_cli_args(config, headless=True)
    joined = " ".join(args)
    for part in ("--model m", "--tensor-parallel-size 2", "--data-parallel-size 4", "--data-parallel-size-local 2",
                 "--data-parallel-address 10.0.0.1", "--enforce-eager", "--max-model-len 4096", "--headless",
                 f"--worker-extension-cls {WORKER_EXTENSION_CLS}", "--logprobs-mode raw_logprobs"):  # fmt: skip
        assert part in joined
    assert args[-2:] == ["--kv-cache-dtype", "fp8"]
    assert "--disable-log-stats" in args  # vLLM's per-step statistics cost rollout throughput (vllm.log_stats)
    with_stats = config.model_copy(update={"vllm": config.vllm.model_copy(update={"log_stats": True})})
    assert "--disable-log-stats" not in vllm_cli_args(with_stats)


def test_every_sampling_field_of_a_request_reaches_vllm(monkeypatch):
    """The token-in route's sampling fields on the vLLM engine. min_p, the three penalties, logit_bias,
    allowed_token_ids and structured_outputs were accepted, validated and then not handed to vLLM: a grammar or a
    penalty that bound on the torch engine was silently dropped on a GPU. Each field now reaches vLLM's
    ``SamplingParams`` (a stand-in module records what it is built with; the GPU test samples with them)."""
    import dataclasses
    import enum
    import sys
    import types

    from prime_inference.engines.base import EngineRequest
    from prime_inference.engines.vllm_requests import sampling_params
    from prime_inference.protocol import SamplingParams

    fake = types.ModuleType("vllm.sampling_params")
    fake.RequestOutputKind = enum.Enum("RequestOutputKind", "CUMULATIVE DELTA FINAL_ONLY")
    fake.SamplingParams = lambda **kw: kw
    fake.StructuredOutputsParams = lambda **kw: ("structured", kw)
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", fake)
    spec = {"choice": ["yes", "no"]}
    params = SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, stop=["x"], stop_token_ids=[2],
        ignore_eos=True, min_tokens=1, logprobs=2, prompt_logprobs=1, include_stop_str_in_output=True,
        skip_special_tokens=False, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.2,
        logit_bias={9: 5.0}, allowed_token_ids=[9, 10], grammar="start: \"yes\" | \"no\"", structured_outputs=spec,
    )  # fmt: skip
    sent = sampling_params(EngineRequest("r", [1, 2], params, stream=False), tapped=False)
    for f in dataclasses.fields(SamplingParams):
        if f.name == "grammar" or not f.init:  # the torch engine's compiled grammar and derived tensors; vLLM
            continue  # compiles the request's own spec
        value = getattr(params, f.name)
        assert f.name in sent, f"{f.name} does not reach vLLM"
        assert sent[f.name] == (("structured", spec) if f.name == "structured_outputs" else value), f.name
    default = sampling_params(EngineRequest("r", [1], SamplingParams(max_tokens=1)), tapped=False)
    assert default["structured_outputs"] is None and default["logit_bias"] is None and default["top_k"] == -1


def test_what_vllm_refuses_before_generating_is_a_one_line_400():
    """vLLM checks a request when it is added (its structured-output backend compiles the grammar, its sampler checks
    the parameters) and raises ValueError: that was a 500 with a traceback in the server log; `vllm serve` answers
    it with a 400, and so does this engine now. Once outputs flow, an error stays an error, and closing the stream
    early still closes vLLM's generator (which aborts the request in the engine)."""
    import asyncio

    from prime_inference.engines.vllm_requests import refused_as_400
    from prime_inference.protocol import RequestError

    closed = []

    async def vllm_outputs(fail_after: int | None):
        try:
            for i in range(3):
                if fail_after == i:
                    raise ValueError("Invalid grammar specification.\nTraceback line")
                yield i
        finally:
            closed.append(fail_after)

    async def consume(fail_after: int | None, take: int = 3) -> list[int]:
        got, stream = [], refused_as_400(vllm_outputs(fail_after))
        async for out in stream:
            got.append(out)
            if len(got) == take:
                await stream.aclose()  # as the server's consumer closes a stream whose client left
                assert closed and closed[-1] == fail_after  # vLLM's generator closed with it, not at exit
                break
        return got

    with pytest.raises(RequestError) as refused:
        asyncio.run(consume(0))
    assert refused.value.status_code == 400 and refused.value.param == "sampling_params"
    assert "\n" not in refused.value.message and "Invalid grammar" in refused.value.message
    with pytest.raises(ValueError) as failed:
        asyncio.run(consume(2))
    assert not isinstance(failed.value, RequestError)
    assert asyncio.run(consume(None, take=1)) == [0]


def test_cuda_graphs_cover_every_step_adaptive_concurrency_can_reach():
    from prime_inference.engines.vllm_engine import vllm_cli_args

    def capture(**vllm):
        args = vllm_cli_args(InferenceConfig.model_validate({"model": {"name": "m"}, "vllm": vllm}))
        flag = "--max-cudagraph-capture-size"
        return int(args[args.index(flag) + 1]) if flag in args else None

    # vLLM alone stops at 512; the orchestrator's adaptive ceiling is 1024 rollouts (client.max_concurrent).
    assert capture() == 1024
    assert capture(max_num_seqs=700) == 700
    assert capture(max_num_seqs=64) == 128  # never fewer graphs than vLLM's own min(2 x max_num_seqs, 512)
    assert capture(max_num_seqs=64, max_cudagraph_capture_size=32) == 32
    assert capture(enforce_eager=True) is None
    # extra_args come last: vLLM's parser takes the user's own flag over ours.
    args = vllm_cli_args(InferenceConfig.model_validate(
        {"model": {"name": "m"}, "vllm": {"extra_args": ["--max-cudagraph-capture-size", "256"]}}))  # fmt: skip
    assert args[-2:] == ["--max-cudagraph-capture-size", "256"]
    # vLLM refuses a capture limit that disagrees with an explicit list of sizes: the user's list alone goes through.
    for flags in (["--compilation-config", '{"cudagraph_capture_sizes": [1, 2, 4]}'],
                  ["-cc.cudagraph_capture_sizes=[1,2,4]"], ["--cuda-graph-sizes", "1", "2", "4"]):  # fmt: skip
        assert capture(extra_args=flags) is None


@pytest.mark.skipif(not HAS_VLLM, reason="vllm extra not installed")
def test_vllm_engine_args_parse_with_vllms_parser(model_dir):
    from prime_inference.engines.vllm_engine import engine_args

    # A local directory: vLLM resolves a hub id over the network while parsing.
    config = InferenceConfig.model_validate(
        {"model": {"name": str(model_dir)}, "vllm": {"extra_args": ["--max-num-batched-tokens", "4096"]}}
    )
    args = engine_args(config)
    assert args.max_num_batched_tokens == 4096
    assert args.worker_extension_cls == "prime_inference.vllm_plugin.PrimeWorkerExtension"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="vllm extra not installed")
def test_vllm_serves_updates_and_reloads(model_dir, other_weights_dir):
    server = start_vllm_server(model_dir)
    try:
        health = httpx.get(f"{server.url}/health").json()
        assert health["engine"] == "vllm" and health["vllm_plugin"]["loaded"]
        body = {"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 12, "temperature": 0, "logprobs": 0}}
        base = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120).json()["choices"][0]
        r = httpx.post(
            f"{server.url}/update_weights", json={"weight_dir": str(other_weights_dir), "step": 1}, timeout=600
        )
        assert r.status_code == 200, r.text
        updated = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120).json()["choices"][0]
        assert updated["token_ids"] != base["token_ids"]
        assert httpx.post(f"{server.url}/reload_weights", timeout=600).status_code == 200
        again = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120).json()["choices"][0]
        assert again["token_ids"] == base["token_ids"]
        start = time.perf_counter()
        assert httpx.post(f"{server.url}/pause").json() == {"status": "paused"}
        assert httpx.post(f"{server.url}/resume").json() == {"status": "resumed"}
        assert time.perf_counter() - start < 30
    finally:
        server.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="vllm extra not installed")
def test_vllm_fast_token_logprobs_equal_vllms_own(model_dir):
    """vllm.fast_token_logprobs: the tapped values (``logprobs`` 0, and 1 as renderers' client asks) equal what vLLM
    returns for the same seeded request through its own path (``logprobs: 2``: the sampled token's entry), alone and
    in a full batch."""
    import asyncio

    server = start_vllm_server(model_dir, vllm={"fast_token_logprobs": True})

    def body(seed: int, k: int) -> dict:
        sp = {"max_tokens": 24, "temperature": 1.0, "seed": seed, "logprobs": k, "ignore_eos": True}
        return {"token_ids": [5, 6, 7, 8 + seed % 50], "sampling_params": sp}

    async def burst(bodies: list[dict]) -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            posts = [client.post(f"{server.url}/inference/v1/generate", json=b) for b in bodies]
            return [r.json()["choices"][0] for r in await asyncio.gather(*posts)]

    try:
        assert httpx.get(f"{server.url}/health").json()["fast_token_logprobs"]
        for seed in range(3):  # one at a time: the same batch for each, so the same tokens and values
            own = asyncio.run(burst([body(seed, 2)]))[0]
            expected = [c["logprob"] for c in own["logprobs"]["content"]]
            for k in (0, 1):
                tapped = asyncio.run(burst([body(seed, k)]))[0]
                assert tapped["token_ids"] == own["token_ids"]
                assert [c["logprob"] for c in tapped["logprobs"]["content"]] == pytest.approx(expected, abs=1e-5)
                assert all(len(c["top_logprobs"]) == 1 for c in tapped["logprobs"]["content"])
        # A full batch, tapped requests mixed with requests that keep vLLM's tensors in the same steps.
        choices = asyncio.run(burst([body(seed, seed % 3) for seed in range(64)]))
        for c in choices:
            assert len(c["logprobs"]["content"]) == len(c["token_ids"]) == 24
            assert all(-50 < e["logprob"] <= 0 for e in c["logprobs"]["content"])
    finally:
        server.stop()


def test_engine_steps_count_the_engine_cores_output_batches():
    """The stall check's step counter comes from vLLM's own engine loop: each ``EngineCoreOutputs`` batch the output
    handler pulls (``engine_core.get_output_async``) is one engine step; a batch without request outputs (a utility
    reply) is not. A weight swap reports the scheduler paused, so the watchdog expects no step then."""
    import asyncio
    from types import SimpleNamespace

    from prime_inference.engines.vllm_engine import VllmEngine

    batches = [SimpleNamespace(outputs=["r1", "r2"]), SimpleNamespace(outputs=[]), SimpleNamespace(outputs=["r1"])]

    class Core:
        async def get_output_async(self):
            return batches.pop(0)

    swaps = []

    class LLM:
        engine_core = Core()

        async def pause_generation(self, mode, clear_cache):
            swaps.append(engine.info.paused)

        async def collective_rpc(self, method, kwargs=None):
            swaps.append(engine.info.paused)

        async def reset_prefix_cache(self):
            pass

        reset_encoder_cache = resume_generation = reset_prefix_cache

    engine = VllmEngine.__new__(VllmEngine)  # no vLLM here: the engine's state around stand-ins
    engine.llm, engine.config = LLM(), SimpleNamespace(served_model_name="m")
    engine.max_model_len, engine.vocab_size, engine.weight_step, engine.weight_dir = 64, 100, 0, None
    engine._paused, engine._swapping, engine._plugin, engine._tap, engine._adapters = False, False, {}, None, {}
    engine._in_flight, engine._steps, engine.in_flight_updates = 2, 0, False
    engine._load = SimpleNamespace(fields=lambda in_flight: {"running": in_flight})  # no load probe answered yet
    engine._count_engine_steps()

    async def main():
        for _ in range(3):
            await engine.llm.engine_core.get_output_async()  # what vLLM's output handler calls, once per batch
        await engine._swap_weights("prime_reload_weights", {"weights_path": "w"}, 1, "w")

    asyncio.run(main())
    info = engine.info
    assert info.steps == 2 and info.running == 2 and not info.paused
    assert swaps == [True, True]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="vllm extra not installed")
def test_a_stopped_vllm_engine_core_is_named_by_the_stall_check(model_dir):
    """/health's ``engine_steps`` advance while vLLM generates; with its engine core stopped (SIGSTOP) the front end
    still answers /health, and the watchdog names the engine that holds running requests but makes no step."""
    import os
    import signal
    import threading
    from pathlib import Path

    from prime_core.config.liveness import LivenessConfig
    from prime_launch.watchdog import ProcessStuck, Watchdog

    server = start_vllm_server(model_dir)

    def descendants(root: int) -> list[int]:
        found, todo = [], [root]
        while todo:
            pid = todo.pop()
            for task in Path(f"/proc/{pid}/task").glob("*"):
                kids = [int(k) for k in (task / "children").read_text().split()] if (task / "children").exists() else []
                found += kids
                todo += kids
        return found

    def generate() -> None:
        body = {"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 100, "ignore_eos": True}}
        with httpx.Client(timeout=600) as client:
            for _ in range(200):
                client.post(f"{server.url}/inference/v1/generate", json=body)

    dog = Watchdog(LivenessConfig(slack_s=3, probe_timeout_s=2))
    # vLLM names its engine core process (setproctitle); without that, it is the spawned child that is no tracker.
    commands = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in descendants(os.getpid())}
    core = next((p for p, c in commands.items() if b"EngineCore" in c), None) or next(
        p for p, c in commands.items() if b"spawn_main" in c and b"resource_tracker" not in c
    )
    workers = [threading.Thread(target=generate, daemon=True) for _ in range(8)]
    try:
        before = httpx.get(f"{server.url}/health").json()["engine_steps"]
        for w in workers:
            w.start()
        time.sleep(3)
        during = httpx.get(f"{server.url}/health").json()
        assert during["running"] > 0 and during["engine_steps"] > before, during
        dog.probe([f"{server.url}/health"], None, "inference")
        time.sleep(2)
        dog._last_check = 0.0
        dog.check()  # stepping
        os.kill(core, signal.SIGSTOP)
        start, stuck = time.monotonic(), None
        while stuck is None and time.monotonic() - start < 30:
            time.sleep(0.5)
            dog._last_check = 0.0
            try:
                dog.check()
            except ProcessStuck as e:
                stuck = (e, time.monotonic() - start)
        assert stuck is not None, "the stopped engine core was not named"
        error, took = stuck
        print(f"vLLM engine core stopped: named after {took:.1f} s: {error.cause}")
        assert "inference is stuck: its engine made no step for" in error.cause and "requests running" in error.cause
        assert took < 3 + 10
    finally:
        os.kill(core, signal.SIGCONT)
        dog.close()
        server.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="vllm extra not installed")
def test_vllm_teacher_scores_prompts_and_stays_frozen(model_dir):
    """A distillation teacher on vLLM (what rl starts from [teacher] on GPUs): prompt log-probs on the token-in route
    (max_tokens 1, prompt_logprobs 0) close to the torch engine's on the same weights, and no weight change."""
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}}
    scores = {}
    for engine, extra in (("torch", {}), ("vllm", {"vllm": {"gpu_memory_utilization": 0.3, "enforce_eager": True}})):
        server = start_server(model_dir, engine=engine, model={"name": str(model_dir), "dtype": "bfloat16"},
                              server={"frozen": True}, startup_timeout=600, **extra)  # fmt: skip
        try:
            out = httpx.post(f"{server.url}/inference/v1/generate", json=body, timeout=120).json()
            entries = out["prompt_logprobs"]
            assert len(entries) == len(ids) and entries[0] is None
            scores[engine] = [e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:], strict=True)]
            assert httpx.post(f"{server.url}/reload_weights", timeout=60).status_code == 403
        finally:
            server.stop()
    assert scores["vllm"] == pytest.approx(scores["torch"], abs=0.05)  # bf16 on both, different kernels


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="vllm extra not installed")
def test_vllm_in_flight_update_keeps_running_requests_and_records_exact_versions(model_dir, other_weights_dir):
    """weight_update = in_flight: an update does not wait for running requests (pause_generation(mode="keep")), they
    go on with the new weights, and the worker tap files each token with the step that sampled it, so the server's
    record of a tagged rollout spans both versions exactly."""
    import asyncio

    TOKENS = 250  # as long as the tiny model allows (256 positions): the update lands while they decode
    server = start_vllm_server(
        model_dir,
        weight_update="in_flight",
        vllm={"fast_token_logprobs": True},
        max_model_len=256,  # the helper's 128 answers these requests with a 400 at once
    )

    async def main() -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:

            async def one(i: int) -> dict:
                sp = {"max_tokens": TOKENS, "temperature": 1.0, "seed": i, "logprobs": 1, "ignore_eos": True,
                      "extra_args": {"prime_rollout": f"r{i}"}}  # fmt: skip
                r = await client.post(
                    f"{server.url}/inference/v1/generate", json={"token_ids": [5, 6, 7], "sampling_params": sp}
                )
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]

            requests = [asyncio.create_task(one(i)) for i in range(16)]
            await asyncio.sleep(0.3)  # they are decoding
            start = time.perf_counter()
            r = await client.post(
                f"{server.url}/update_weights", json={"weight_dir": str(other_weights_dir), "step": 1}
            )
            assert r.status_code == 200, r.text
            assert not all(t.done() for t in requests), "the requests ended before the update: make them longer"
            update_s = time.perf_counter() - start
            choices = await asyncio.gather(*requests)
            print(f"in-flight update took {update_s:.2f}s with 16 requests running")
            return choices

    try:
        choices = asyncio.run(main())
        assert all(len(c["token_ids"]) == TOKENS for c in choices)
        got = httpx.post(f"{server.url}/rollout_versions", json={"tags": [f"r{i}" for i in range(16)]}).json()
        records = got["versions"]
        assert len(records) == 16 and all(v["exact"] and v["num_tokens"] == TOKENS for v in records.values())
        assert any((v["first"], v["last"]) == (0, 1) for v in records.values())  # spans the update
    finally:
        server.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_VLLM, reason="vllm extra not installed")
def test_two_vllm_engines_share_requests_weights_and_seeds_of_their_own(model_dir, other_weights_dir):
    """``vllm.engines = 2`` on one GPU: /health says two, a burst of requests all complete with tapped log-probs, an
    update reaches both engines (every request after it samples the new weights), and the engines' seeds differ (an
    unseeded prompt sampled on both does not repeat itself)."""
    import asyncio

    server = start_vllm_server(model_dir, vllm={"engines": 2, "gpu_memory_utilization": 0.4})

    def body(seed: int | None, temperature: float = 1.0) -> dict:
        sp = {"max_tokens": 16, "temperature": temperature, "seed": seed, "logprobs": 1, "ignore_eos": True}
        return {"token_ids": [5, 6, 7, 8], "sampling_params": sp}

    async def burst(bodies: list[dict]) -> list[dict]:
        async with httpx.AsyncClient(timeout=300) as client:
            posts = [client.post(f"{server.url}/inference/v1/generate", json=b) for b in bodies]
            return [r.json()["choices"][0] for r in await asyncio.gather(*posts)]

    try:
        health = httpx.get(f"{server.url}/health").json()
        assert health["engines"] == 2 and health["vllm_plugin"]["workers"] == 2
        choices = asyncio.run(burst([body(None) for _ in range(32)]))
        assert all(len(c["logprobs"]["content"]) == len(c["token_ids"]) == 16 for c in choices)
        assert len({tuple(c["token_ids"]) for c in choices}) == 32  # two engines, two seeds: no sample repeats
        greedy = asyncio.run(burst([body(0, 0.0) for _ in range(8)]))
        assert len({tuple(c["token_ids"]) for c in greedy}) == 1  # both engines hold the same weights
        r = httpx.post(f"{server.url}/update_weights", json={"weight_dir": str(other_weights_dir), "step": 1},
                       timeout=600)  # fmt: skip
        assert r.status_code == 200, r.text
        updated = asyncio.run(burst([body(0, 0.0) for _ in range(8)]))
        assert len({tuple(c["token_ids"]) for c in updated}) == 1 and updated[0]["token_ids"] != greedy[0]["token_ids"]
    finally:
        server.stop()
