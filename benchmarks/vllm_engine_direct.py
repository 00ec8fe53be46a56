"""Our vLLM engine without the HTTP server (GPU): the requests `inference_vllm.py` sends, straight into
`VllmEngine.generate` in one process, all in flight. Split the server's time between HTTP and the engine.

    python benchmarks/vllm_engine_direct.py --prompts 512 --tokens 128 --group 8 --out result.json

The model: ``--model DIR``, else a random-init Qwen3-0.6B shape with a word-level tokenizer of ``--vocab`` tokens,
as `inference_vllm.py` builds it.

Phases as `inference_vllm.py` names them: ``no_logprobs``, ``groups_no_logprobs`` (seeded, no log-probs),
``logprobs`` (the tap, no seeds), ``groups`` (seeded + the tap: the orchestrator's pattern). Each phase runs
twice (first is warm-up for that shape); the second is reported, with when its first and last request finished.
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

    argv = ["--engine", "vllm", "--model.name", args.model, "--model.dtype", "bfloat16",
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


async def main_async(args: argparse.Namespace) -> dict:
    from prime_inference.engines.vllm_engine import VllmEngine

    if args.model is None:
        from inference_vllm import make_tokenizer, save_model

        args.model = str(Path(args.work) / "base")
        save_model(Path(args.model), 0, make_tokenizer(args), args)
    engine = VllmEngine(engine_config(args))
    await engine.start()
    sets, result = sets_for(args), {}
    try:
        await run_phase(engine, sets["logprobs"][:16])
        for name in args.phases.split(","):
            await run_phase(engine, sets[name])
            result[name] = await run_phase(engine, sets[name])
            print(f"  engine direct {name}: {result[name]['elapsed_s']:.3f} s", flush=True)
    finally:
        await engine.shutdown()
    return result


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
    parser.add_argument("--phases", default="no_logprobs,groups_no_logprobs,logprobs,groups")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    result = {"config": vars(args), "engine_direct": asyncio.run(main_async(args))}
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
