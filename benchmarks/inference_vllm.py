"""vLLM engine benchmark (GPU): prime's server vs vLLM offline throughput on a random-init Qwen3-shaped model.

    uv run --extra vllm python benchmarks/inference_vllm.py [--prompts 512] [--tokens 512] [--hidden 1024 ...]

Steps: save a random-init Qwen3 model + tokenizer; start `inference --engine vllm` in a subprocess; check that
/update_weights to a second random model changes greedy output; measure output tok/s for N prompts x T tokens
through /inference/v1/generate (all requests in flight); stop the server; measure vLLM's offline `LLM.generate` on
the same prompts; write benchmarks/results/inference_vllm-<time>.json with device, commit and both numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def save_model(path: Path, seed: int, args: argparse.Namespace) -> None:
    import torch
    from prime_core.io import mark_stable
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer) if args.tokenizer else _local_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128, num_key_value_heads=max(1, args.hidden // 512),
        head_dim=128, max_position_embeddings=4096, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    mark_stable(path)


def _local_tokenizer():
    sys.path.insert(0, str(ROOT))
    from tests.inference.helpers import build_tokenizer

    return build_tokenizer()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_generate(url: str, prompts: list[list[int]], tokens: int) -> tuple[float, int]:
    import httpx

    async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=len(prompts))) as client:
        body = lambda p: {"token_ids": p, "sampling_params": {"max_tokens": tokens, "ignore_eos": True, "logprobs": 0}}  # noqa: E731
        start = time.perf_counter()
        rs = await asyncio.gather(*[client.post(f"{url}/inference/v1/generate", json=body(p)) for p in prompts])
        elapsed = time.perf_counter() - start
    return elapsed, sum(len(r.json()["choices"][0]["token_ids"]) for r in rs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir/hub id; default: the tests' local one")
    args = parser.parse_args()

    import httpx
    import torch

    work = Path(tempfile.mkdtemp(prefix="prime-bench-"))
    base, other = work / "base", work / "weights" / "step_1"
    save_model(base, 0, args)
    save_model(other, 1, args)
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "prime_inference.entrypoints.inference", "--engine", "vllm", "--model.name", str(base),
           "--server.port", str(port), "--output-dir", str(work / "run"), "--max-model-len", "2048",
           "--vllm.max-num-seqs", str(args.prompts)]  # fmt: skip
    server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    result: dict = {}
    try:
        deadline = time.time() + 900
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                if server.poll() is not None:
                    raise SystemExit("server exited during startup") from None
            time.sleep(1)
        health = httpx.get(f"{url}/health").json()
        probe = {"token_ids": prompts[0], "sampling_params": {"max_tokens": 16, "temperature": 0}}
        before = httpx.post(f"{url}/inference/v1/generate", json=probe, timeout=600).json()["choices"][0]["token_ids"]
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(other), "step": 1}, timeout=1200)
        update_s = time.perf_counter() - t0
        after = httpx.post(f"{url}/inference/v1/generate", json=probe, timeout=600).json()["choices"][0]["token_ids"]
        asyncio.run(run_generate(url, prompts[:8], 8))  # warm-up
        elapsed, out_tokens = asyncio.run(run_generate(url, prompts, args.tokens))
        result["server"] = {"elapsed_s": elapsed, "output_tokens": out_tokens, "output_tok_per_s": out_tokens / elapsed}
        result["update_weights"] = {"status": r.status_code, "seconds": update_s, "output_changed": before != after}
        result["plugin"] = health.get("vllm_plugin")
    finally:
        server.terminate()
        server.wait(timeout=120)

    from vllm import LLM, SamplingParams

    llm = LLM(model=str(other), max_model_len=2048, max_num_seqs=args.prompts, seed=0)
    sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True, logprobs=0)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], SamplingParams(max_tokens=8))
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result["offline"] = {"elapsed_s": elapsed, "output_tokens": out_tokens, "output_tok_per_s": out_tokens / elapsed}
    result["server_vs_offline"] = result["server"]["output_tok_per_s"] / result["offline"]["output_tok_per_s"]

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    import vllm

    result.update(
        benchmark="inference_vllm",
        device=torch.cuda.get_device_name(0),
        commit=commit,
        vllm=vllm.__version__,
        config=vars(args),
        time=time.strftime("%Y-%m-%dT%H:%M:%S"),
    )
    out = ROOT / "benchmarks" / "results" / f"inference_vllm-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
