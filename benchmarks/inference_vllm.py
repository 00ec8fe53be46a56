"""vLLM engine benchmark (GPU): prime's server vs vLLM offline throughput on a random-init Qwen3-shaped model.

    uv run --extra vllm python benchmarks/inference_vllm.py [--prompts 512] [--tokens 512] [--out DIR]

Steps: save two random-init models of the Qwen3-0.6B shape (benchmarks/models/qwen3-0.6b/config.json; the
vocabulary is the tests' small local tokenizer's, so no hub access is needed) + tokenizer; start `inference --engine vllm` in a subprocess; check that
/update_weights to a second random model changes greedy output; measure output tok/s for N prompts x T tokens
through /inference/v1/generate (all requests in flight); stop the server; measure vLLM's offline `LLM.generate` on
the same prompts with the same engine settings; write <out>/inference_vllm-<time>.json with device, commit and both
numbers (written also when a step fails, with the error, so a partial run still reports what it saw).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
    shape = json.loads(Path(args.config).read_text())
    shape.update(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id, max_position_embeddings=4096, use_cache=True,
    )  # fmt: skip
    if args.layers:
        shape["num_hidden_layers"] = shape["max_window_layers"] = args.layers
    config = Qwen3Config(**{k: v for k, v in shape.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random init of ~0.5B parameters is slow on CPU
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    mark_stable(path)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


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


def wait_healthy(url: str, server: subprocess.Popen, timeout: float) -> dict:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise RuntimeError(f"server exited during startup (rc={server.returncode})")
        time.sleep(1)
    raise RuntimeError(f"server not healthy after {timeout:.0f}s")


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM the server, then kill its whole process group (vLLM's engine-core processes included)."""
    import signal

    if server.poll() is None:
        server.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait(timeout=30)


def offline_llm_kwargs(model: str, args: argparse.Namespace) -> dict:
    """vLLM engine settings equal to what the server passes (see `vllm_cli_args`), for a like-for-like offline run."""
    kwargs = dict(
        model=model, dtype="bfloat16", seed=0, max_model_len=args.max_model_len, max_num_seqs=args.prompts,
        gpu_memory_utilization=args.gpu_memory_utilization, logprobs_mode="processed_logprobs",
        enforce_eager=args.enforce_eager,
    )  # fmt: skip
    return kwargs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--config", default=str(ROOT / "benchmarks" / "models" / "qwen3-0.6b" / "config.json"))
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers of --config")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs / torch.compile (both runs)")
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--tokenizer", default=None, help="tokenizer dir/hub id; default: the tests' local one")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="directory of the result JSON")
    parser.add_argument("--commit", default=os.environ.get("PRIME_COMMIT"), help="default: git rev-parse HEAD")
    args = parser.parse_args()

    import httpx
    import torch

    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) / f"inference_vllm-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    commit = (
        args.commit
        or subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    result: dict = {
        "benchmark": "inference_vllm", "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "commit": commit, "config": vars(args), "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "stages_s": {},
    }  # fmt: skip
    stages = result["stages_s"]

    def write() -> None:
        out.write_text(json.dumps(result, indent=2) + "\n")

    t = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="prime-bench-"))
    base, other = work / "base", work / "weights" / "step_1"
    save_model(base, 0, args)
    save_model(other, 1, args)
    stages["save_models"] = time.perf_counter() - t
    model_config = json.loads((base / "config.json").read_text())
    result["model"] = {k: model_config.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")}  # fmt: skip
    vocab = model_config["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "prime_inference.entrypoints.inference", "--engine", "vllm", "--model.name", str(base),
           "--model.dtype", "bfloat16", "--server.port", str(port), "--output-dir", str(work / "run"),
           "--max-model-len", str(args.max_model_len), "--vllm.max-num-seqs", str(args.prompts),
           "--vllm.gpu-memory-utilization", str(args.gpu_memory_utilization)]  # fmt: skip
    if args.enforce_eager:
        cmd.append("--vllm.enforce-eager")
    try:
        t = time.perf_counter()
        server = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        try:
            health = wait_healthy(url, server, args.startup_timeout)
            stages["server_start"] = time.perf_counter() - t
            result["health"] = health
            print("health:", json.dumps(health), flush=True)
            probe = {"token_ids": prompts[0], "sampling_params": {"max_tokens": 16, "temperature": 0}}
            r = httpx.post(f"{url}/inference/v1/generate", json=probe, timeout=600)
            r.raise_for_status()
            before = r.json()["choices"][0]["token_ids"]
            chat = httpx.post(
                f"{url}/v1/chat/completions", timeout=600,
                json={"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 8, "temperature": 0},
            )  # fmt: skip
            chat_body = chat.json()
            result["chat"] = {"status": chat.status_code, "content": chat_body.get("choices", [{}])[0].get("message"),
                              "usage": chat_body.get("usage")}  # fmt: skip
            t0 = time.perf_counter()
            r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(other), "step": 1}, timeout=1200)
            update_s = time.perf_counter() - t0
            after = httpx.post(f"{url}/inference/v1/generate", json=probe, timeout=600).json()["choices"][0]
            result["update_weights"] = {
                "status": r.status_code, "body": r.json(), "seconds": update_s, "before": before,
                "after": after["token_ids"], "output_changed": before != after["token_ids"],
                "weight_step_after": after.get("weight_step", httpx.get(f"{url}/health").json().get("weight_step")),
            }  # fmt: skip
            print("update_weights:", json.dumps(result["update_weights"]), flush=True)
            write()
            asyncio.run(run_generate(url, prompts[:8], 8))  # warm-up
            elapsed, out_tokens = asyncio.run(run_generate(url, prompts, args.tokens))
            result["server"] = {
                "elapsed_s": elapsed,
                "output_tokens": out_tokens,
                "output_tok_per_s": out_tokens / elapsed,
            }
            print("server:", json.dumps(result["server"]), flush=True)
            write()
        finally:
            stop_server(server)
        if args.skip_offline:
            return
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            result["free_gib_before_offline"] = free / 2**30
        from vllm import LLM, SamplingParams

        t = time.perf_counter()
        llm = LLM(**offline_llm_kwargs(str(other), args))
        stages["offline_start"] = time.perf_counter() - t
        sp = SamplingParams(max_tokens=args.tokens, ignore_eos=True, logprobs=0)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], SamplingParams(max_tokens=8))
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        elapsed = time.perf_counter() - start
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result["offline"] = {
            "elapsed_s": elapsed,
            "output_tokens": out_tokens,
            "output_tok_per_s": out_tokens / elapsed,
        }
        result["server_vs_offline"] = result["server"]["output_tok_per_s"] / result["offline"]["output_tok_per_s"]
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        try:
            import vllm

            result["vllm"] = vllm.__version__
        except ImportError:
            pass
        write()
        print(json.dumps(result, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
