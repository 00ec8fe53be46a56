"""Our vLLM engine without the HTTP server (GPU): the requests `inference_vllm.py` sends, straight into
`VllmEngine.generate` in one process, all in flight. Split the server's time between HTTP and the engine.

    python benchmarks/vllm_engine_direct.py --prompts 512 --tokens 128 --group 8 --out result.json

The model: ``--model DIR``, else a random-init Qwen3-0.6B shape with a word-level tokenizer of ``--vocab`` tokens,
as `inference_vllm.py` builds it.

Phases as `inference_vllm.py` names them: ``no_logprobs``, ``groups_no_logprobs`` (seeded, no log-probs),
``logprobs`` (the tap, no seeds), ``groups_unseeded`` (the groups' prompts and log-probs, no seeds), ``groups``
(seeded + the tap: the orchestrator's pattern). After a warm-up run of each, the phases repeat ``--repeats`` times
interleaved; the median is reported. ``--profile S``: py-spy of the engine core per phase.
``--no-tap-phases``: those phases again on an engine with vLLM's own log-prob path.

``--replicas 1,2``: engines on the same GPU, each in its own process with ``1/K`` of the memory and of every phase's
requests, started one after the other (vLLM sizes its KV cache from the memory it sees in use) and then run in
lockstep (a barrier before each run): whether one engine core's host loop bounds generation on one GPU. A run's time
is the slowest replica's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def engine_config(args: argparse.Namespace):
    from prime_core.config import parse_cli
    from prime_core.config.inference import InferenceConfig

    argv = ["--engine", args.engine, "--model.name", args.model, "--model.dtype", "bfloat16",
            "--output-dir", args.work, "--max-model-len", str(args.max_model_len),
            "--vllm.max-num-seqs", str(args.prompts), "--vllm.gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--vllm.extra-args", json.dumps(["--max-num-batched-tokens", str(args.max_num_batched_tokens)])]  # fmt: skip
    return parse_cli(InferenceConfig, argv, prog="vllm_engine_direct", writes_output_dir=True)


def sets_for(args: argparse.Namespace) -> dict[str, list[dict]]:
    from inference_vllm import request_sets

    return request_sets(args.vocab, args)


async def run_phase(engine, requests: list[dict]) -> dict:
    from prime_inference.engines.base import EngineRequest
    from prime_inference.protocol import SamplingParams

    def request(r: dict) -> EngineRequest:
        params = SamplingParams(max_tokens=r["max_tokens"], temperature=1.0, seed=r["seed"], ignore_eos=True,
                                logprobs=r["logprobs"])  # fmt: skip
        return EngineRequest(uuid.uuid4().hex, r["prompt"], params, stream=False)

    start = time.perf_counter()

    async def one(r: dict) -> tuple[float, int]:
        tokens = 0
        async for out in engine.generate(request(r)):
            tokens += len(out.token_ids)
        return time.perf_counter() - start, tokens

    done = await asyncio.gather(*(one(r) for r in requests))
    elapsed = time.perf_counter() - start
    finished = sorted(t for t, _ in done)
    tokens = sum(n for _, n in done)
    return {"requests": len(requests), "elapsed_s": elapsed, "output_tokens": tokens,
            "output_tok_per_s": tokens / elapsed, "finished_s": {"first": finished[0], "last": finished[-1]}}  # fmt: skip


async def profiled(engine, requests: list[dict], seconds: float) -> dict:
    """py-spy over this process's children (vLLM's engine core) while the phase repeats for ``seconds``: the engine
    core's busy share says whether its host loop (scheduling, output handling, the tap) or the GPU bounds a step."""
    import os
    import tempfile

    from pyspy_profile import summarize

    raw = Path(tempfile.mkdtemp()) / "spy.txt"
    cmd = ["py-spy", "record", "--pid", str(os.getpid()), "--subprocesses", "--nonblocking", "--format", "raw",
           "--rate", "100", "--duration", str(int(seconds)), "--output", str(raw)]  # fmt: skip
    try:
        spy = await asyncio.create_subprocess_exec(
            *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
        )
    except FileNotFoundError:
        return {"error": "py-spy is not installed"}
    await asyncio.sleep(1.0)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds - 1.5:
        await run_phase(engine, requests)
        runs += 1
    work_s = time.perf_counter() - start
    err = (await spy.communicate())[1]
    if spy.returncode != 0 or not raw.exists():
        return {"error": f"py-spy rc={spy.returncode}: {err.decode()[-500:]}"}
    processes = summarize(raw, top=15)
    return {"runs": runs, "work_s": work_s, "seconds": seconds,
            "processes": {p: {"busy_share_of_work": v["samples"] / (100 * work_s), "own": v["own"]}
                          for p, v in processes.items()}}  # fmt: skip


async def measure(config, sets: dict, phases: list[str], repeats: int, profile_s: float) -> dict:
    """Each phase ``repeats`` times, interleaved (phase after phase, round after round), after one warm-up run of
    each: the engine's first run of a shape includes Triton JIT compiles, which a server pays once."""
    from prime_inference.engines import build_engine

    engine = build_engine(config)[0]
    await engine.start()
    runs: dict[str, list[float]] = {name: [] for name in phases}
    result: dict = {}
    try:
        await run_phase(engine, sets["logprobs"][:16])
        for name in phases:
            await run_phase(engine, sets[name])
        for _ in range(repeats):
            for name in phases:
                runs[name].append((await run_phase(engine, sets[name]))["elapsed_s"])
        for name in phases:
            times = sorted(runs[name])
            result[name] = {"median_s": times[len(times) // 2], "runs_s": runs[name]}
            print(f"  engine direct {name}: median {result[name]['median_s']:.3f} s of {runs[name]}", flush=True)
        if profile_s:
            for name in phases:
                result[name]["profile"] = await profiled(engine, sets[name], profile_s)
    finally:
        await engine.shutdown()
    return result


def _replica(args: argparse.Namespace, index: int, k: int, phases: list[str], ready, barrier, results) -> None:
    """One of ``k`` engines: its slice of each phase, warmed up, then ``args.repeats`` rounds in lockstep."""

    async def run() -> None:
        from prime_inference.engines import build_engine

        config = engine_config(args)
        sets = {name: requests[index::k] for name, requests in sets_for(args).items()}
        engine = build_engine(config)[0]
        await engine.start()
        try:
            for name in phases:
                await run_phase(engine, sets[name])
            ready.put(index)
            for round_ in range(args.repeats):
                for name in phases:
                    await asyncio.to_thread(barrier.wait, 600)
                    results.put((round_, name, index, (await run_phase(engine, sets[name]))["elapsed_s"]))
        finally:
            await engine.shutdown()

    asyncio.run(run())


def replicated(args: argparse.Namespace, k: int, phases: list[str]) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, results, barrier = ctx.Queue(), ctx.Queue(), ctx.Barrier(k)
    share = argparse.Namespace(**{**vars(args), "gpu_memory_utilization": args.gpu_memory_utilization / k})
    procs = []
    for i in range(k):
        procs.append(ctx.Process(target=_replica, args=(share, i, k, phases, ready, barrier, results)))
        procs[-1].start()
        ready.get(timeout=900)  # the next engine starts once this one holds its memory
    runs: dict[str, dict[int, float]] = {name: {} for name in phases}
    for _ in range(args.repeats * len(phases) * k):
        round_, name, _, elapsed = results.get(timeout=900)
        runs[name][round_] = max(runs[name].get(round_, 0.0), elapsed)
    for p in procs:
        p.join(timeout=120)
    out = {}
    for name in phases:
        times = [runs[name][r] for r in sorted(runs[name])]
        out[name] = {"median_s": sorted(times)[len(times) // 2], "runs_s": times}
        print(f"  {k} engine(s) {name}: median {out[name]['median_s']:.3f} s of {times}", flush=True)
    return out


async def main_async(args: argparse.Namespace) -> dict:
    if args.model is None:
        from inference_vllm import make_tokenizer, save_model

        args.model = str(Path(args.work) / "base")
        save_model(Path(args.model), 0, make_tokenizer(args), args)
    if args.replicas:
        phases = args.phases.split(",")
        return {f"replicas_{k}": replicated(args, int(k), phases) for k in args.replicas.split(",")}
    config, sets = engine_config(args), sets_for(args)
    sets["groups_unseeded"] = [{**r, "seed": None} for r in sets["groups"]]
    out = {"tap": await measure(config, sets, args.phases.split(","), args.repeats, args.profile)}
    if args.no_tap_phases:
        untapped = config.model_copy(update={"vllm": config.vllm.model_copy(update={"fast_token_logprobs": False})})
        out["vllm_logprobs"] = await measure(untapped, sets, args.no_tap_phases.split(","), args.repeats, 0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="model dir (default: build one, see the module doc)")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument(
        "--config", default=str(Path(__file__).resolve().parent / "models" / "qwen3-0.6b" / "config.json")
    )
    parser.add_argument("--work", default="/tmp/vllm-engine-direct")
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--phases", default="no_logprobs,groups_no_logprobs,logprobs,groups_unseeded,groups")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", type=float, default=0, help="seconds of py-spy per phase (0: none)")
    parser.add_argument("--no-tap-phases", default="", help="phases again on an engine with vLLM's own log-probs")
    parser.add_argument("--replicas", default="", help="e.g. 1,2: that many engines on one GPU (see the module doc)")
    parser.add_argument("--engine", default="vllm", help="torch: a CPU smoke test of this script")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import os

    import torch
    from provenance import tree_commit

    result = {"benchmark": "vllm_engine_direct", "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "commit": tree_commit(os.environ.get("PRIME_COMMIT")),
              "vocab_size": args.vocab, "config": vars(args), "engine_direct": asyncio.run(main_async(args))}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
