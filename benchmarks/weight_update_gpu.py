"""Weight-update latency (issue 9, item 7): from the trainer starting to publish step N to inference serving it.

    python benchmarks/weight_update_gpu.py --shape 0.6b --out $OUT [--reps 5] [--modes filesystem,nccl]
    python benchmarks/weight_update_gpu.py --shape 0.6b --out $OUT --modes filesystem,cuda_ipc   # one shared GPU
    (--vocab 151936 by default: Qwen3's vocabulary size, a padded byte-level tokenizer; --vocab 0: the tests' one)

The trainer side is prime's own: `prime_trainer` builds the model (FSDP2-wrapped, bf16 compute, fp32 master
weights) on GPU 0 and publishes through its weight transport (`prime_trainer.weights`: safetensors + STABLE, or
broadcast.json + STABLE and a broadcast from rank 0, or cuda_ipc.json + STABLE and CUDA IPC handles). The inference
side is `inference --engine vllm` on GPU 1 (GPU 0 too when only one is visible, and always with cuda_ipc, which
needs trainer and inference on one GPU; nccl cannot run then). The orchestrator's part is played here: poll for STABLE every 5 ms, then POST /update_weights.
Latency = time from `publish()` starting to /update_weights returning (the server answers after the new weights are
loaded and generation resumed). Between repetitions every parameter is perturbed, so each update changes outputs; a
final filesystem update of the same weights as the last broadcast must give the same greedy tokens.
Writes <out>/weight_update_gpu-<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from serve_load import free_port, stop_server, wait_healthy  # noqa: E402

SHAPES = {
    "0.6b": {},
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128),
}  # fmt: skip


def save_model(path: Path, shape: str, tokenizer_dir: str | None = None, vocab: int = 0) -> dict:
    """A random-init bf16 model of the shape (0.6B's config with overrides) and a local tokenizer (the tests' one,
    or ``tokenizer_dir``'s, or a byte-level one padded to ``vocab`` tokens), so no hub access is needed."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from tests.inference.helpers import build_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir) if tokenizer_dir else build_tokenizer()
    if vocab:  # the real vocabulary: its embedding and head are a large share of what crosses over
        from examples_gpu import full_vocab_tokenizer

        tokenizer = full_vocab_tokenizer(vocab)
    cfg = json.loads((ROOT / "benchmarks/models/qwen3-0.6b/config.json").read_text())
    cfg.update(SHAPES[shape])
    cfg.update(
        vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id, max_position_embeddings=4096, max_window_layers=cfg["num_hidden_layers"],
    )  # fmt: skip
    config = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return {"params": params, **{k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}}


def greedy(url: str, prompt: list[int]) -> list[int]:
    import httpx

    body = {"token_ids": prompt, "sampling_params": {"max_tokens": 16, "temperature": 0}}
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def publish_into(timings: dict, publisher, step: int, model) -> None:
    """What the trainer does each step (every step served, none kept on disk as files), timings into ``timings``."""
    timings.update(publisher.publish(step, model, durable=False))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=151936, help="tokenizer size (0: the tests' small tokenizer)")
    parser.add_argument("--modes", default="filesystem,nccl")
    parser.add_argument("--weights-root", default=None, help="where weights/step_N go (default: a temp dir)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--commit", default=os.environ.get("PRIME_COMMIT"))
    args = parser.parse_args()

    import httpx
    import torch
    from prime_core.config.trainer import ModelInitConfig, ParallelConfig, WeightBroadcastConfig
    from prime_core.run_dir import RunDir
    from prime_trainer.model import build_model
    from prime_trainer.weights import BroadcastPublisher, CudaIpcPublisher, FilesystemPublisher
    from prime_trainer.world import init_world

    out = Path(args.out) / f"weight_update_gpu-{args.shape}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    result: dict = {
        "benchmark": "weight_update", "shape": args.shape, "device": torch.cuda.get_device_name(0),
        "gpus": gpus, "commit": args.commit, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "reps": args.reps,
    }  # fmt: skip

    def write() -> None:
        out.write_text(json.dumps(result, indent=2) + "\n")

    work = Path(tempfile.mkdtemp(prefix="prime-wu-", dir=args.weights_root))
    base = work / "base"
    result["model"] = save_model(base, args.shape, vocab=args.vocab)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    same_gpu = gpus == 1 or "cuda_ipc" in args.modes
    inference_gpu = "0" if same_gpu else "1"
    result["same_gpu"] = same_gpu
    cmd = [sys.executable, "-m", "prime_inference.entrypoints.inference", "--engine", "vllm", "--model.name", str(base),
           "--model.dtype", "bfloat16", "--server.port", str(port), "--output-dir", str(work / "inference"),
           "--max-model-len", "1024", "--vllm.gpu-memory-utilization", "0.5" if same_gpu else "0.85",
           "--vllm.enforce-eager"]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": inference_gpu, "PYTHONUNBUFFERED": "1"}
    server = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        world = init_world("cuda")
        model, source = build_model(
            str(base), "auto", ModelInitConfig(), ParallelConfig(), world, seed=0
        )  # fp32 master weights, bf16 published: what `trainer` does
        result["health"] = wait_healthy(url, server, 600)
        prompt = list(range(3, 40))
        served = [greedy(url, prompt)]
        run_dir = RunDir(work / "run")
        step = 0
        for mode in args.modes.split(","):
            if mode in ("nccl", "cuda_ipc"):
                transport = WeightBroadcastConfig(type=mode, port=free_port(), timeout_s=120)
                cls = BroadcastPublisher if mode == "nccl" else CudaIpcPublisher
                publisher = cls(run_dir, world, 0, tokenizer=source.tokenizer, config=transport)
            else:
                publisher = FilesystemPublisher(run_dir, world, 0, tokenizer=source.tokenizer)
            runs = []
            for rep in range(args.reps + 1):  # the first nccl update also opens the group: reported apart
                step += 1
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p), alpha=1e-2)
                torch.cuda.synchronize()
                weight_dir = run_dir.weight_step(step)
                t0 = time.perf_counter()
                timings: dict = {}
                sender = threading.Thread(target=publish_into, args=(timings, publisher, step, model))
                sender.start()
                while not (weight_dir / "STABLE").exists():
                    time.sleep(0.005)
                t_stable = time.perf_counter() - t0
                r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(weight_dir), "step": step}, timeout=600)
                t_served = time.perf_counter() - t0
                sender.join()
                r.raise_for_status()
                runs.append({"latency_s": t_served, "stable_s": t_stable, **timings,
                             "server_step": r.json()["weight_step"]})  # fmt: skip
                print(f"{mode} rep {rep}: {json.dumps(runs[-1])}", flush=True)
                served.append(greedy(url, prompt))
            steady = [x["latency_s"] for x in runs[1:]]
            result[mode] = {"runs": runs, "median_latency_s": statistics.median(steady), "max_latency_s": max(steady),
                            "first_latency_s": runs[0]["latency_s"]}  # fmt: skip
            write()
        # The weights of the last update again, from files: the same greedy tokens prove the transfer was exact.
        if args.modes.split(",")[-1] in ("nccl", "cuda_ipc"):
            step += 1
            FilesystemPublisher(run_dir, world, 0, tokenizer=source.tokenizer).publish(step, model)
            weight_dir = run_dir.weight_step(step)
            r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(weight_dir), "step": step}, timeout=600)
            r.raise_for_status()
            again = greedy(url, prompt)
            result["check"] = {"broadcast_tokens": served[-1], "filesystem_tokens": again,
                               "equal": again == served[-1], "outputs_changed": len({tuple(s) for s in served}) > 1}  # fmt: skip
    except BaseException as e:
        result["error"] = f"{type(e).__name__}: {e}"
        raise
    finally:
        stop_server(server)
        write()
        print(json.dumps({k: v for k, v in result.items() if k not in ("filesystem", "nccl")}, indent=2))
        for mode in ("filesystem", "nccl"):
            if mode in result:
                print(mode, "median", result[mode]["median_latency_s"], "max", result[mode]["max_latency_s"])
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
