"""GPU benchmarks of expert and context parallelism (issue 10): a Qwen3-30B-A3B-shaped MoE RL step with EP, the
DeepEP vs torch all-to-all dispatch, and the longest row CP=1 and CP=2 fit.

    python benchmarks/moe_gpu.py --jobs rl16k_ep4_torch,rl16k_ep4_deepep,dispatch,cp_ladder --out $OUT --commit <sha>
    python benchmarks/moe_gpu.py --report $OUT/results.json --commit <sha>      # -> benchmarks/results/moe_gpu_*.json

Jobs (each in fresh processes, run in order until `--budget-s` is spent):
* ``rl<K>k_ep<N>_<torch|deepep>[_l<layers>]``: `torchrun --nproc-per-node N trainer --bench --model.ep N` on the
  Qwen3-30B-A3B shape (hidden 2048, 128 experts, top-8, moe_intermediate 768, 32 heads, 4 kv heads, head_dim 128,
  vocab 151936) cut to `layers` decoder layers (default 24, what fits 4 x H200 with fp32 master weights and AdamW),
  random init, K*1024 tokens per GPU (one row per rank), full activation checkpointing. MFU counts active parameters.
* ``dispatch``: one MoE layer of that shape, forward + backward of 16k tokens per GPU, torch all-to-all vs DeepEP on
  the same inputs: time per call and the relative difference of outputs and gradients.
* ``cp_ladder``: the Qwen3-0.6B shape (benchmarks/models/qwen3-0.6b), `trainer --bench` at doubling row lengths with
  CP=1 on one GPU and CP=2 on two (one row per rank; a CP group trains its ranks' rows one after another), each
  process capped at `--mem-cap-gib` of GPU memory (`torch.cuda.set_per_process_memory_fraction`: "the same memory"
  for both), until out of memory; reports the longest row each CP size trains and its peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DENSE_MODEL = ROOT / "benchmarks/models/qwen3-0.6b"
PY = sys.executable
TMP = Path("/tmp/prime_bench_moe")

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "router_aux_loss_coef": 0.001,
}


def moe_model_dir(layers: int) -> Path:
    path = TMP / f"qwen3-30b-a3b-l{layers}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "num_hidden_layers": layers}, indent=2))
    return path


def torchrun(nproc: int) -> list[str]:
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def trainer_bench(
    model: Path,
    seq: int,
    nproc: int,
    out: Path,
    extra: list[str],
    steps: int = 4,
    mem_cap_gib: float = 0,
) -> list[str]:
    entry = (
        [__file__, "--capped-trainer", str(mem_cap_gib)] if mem_cap_gib else ["-m", "prime_trainer.entrypoints.trainer"]
    )
    return [*torchrun(nproc), *entry, "--bench", "--model.name", str(model),
            "--init.random", "--data.fake.batch-size", str(nproc), "--data.fake.micro-batch-size", "1",
            "--data.fake.seq-len", str(seq), "--seq-len", str(seq), "--max-steps", str(steps), "--parallel.ac", "full",
            "--output-dir", str(TMP / out.stem), "--bench-file", str(out), "--log.file", "false", *extra]  # fmt: skip


def run(cmd: list[str], timeout: float) -> tuple[int | str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        return proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        return "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")


def rl_job(name: str, timeout: float) -> dict:
    parts = name.split("_")
    seq = int(parts[0][2:].rstrip("k")) * 1024
    ep = int(parts[1][2:])
    dispatcher = parts[2]
    layers = next((int(p[1:]) for p in parts[3:] if p.startswith("l")), 24)
    out = TMP / f"{name}.json"
    extra = ["--model.ep", str(ep), "--model.ep-dispatcher", dispatcher]
    rc, log = run(trainer_bench(moe_model_dir(layers), seq, ep, out, extra), timeout)
    res = json.loads(out.read_text()) if out.exists() and rc == 0 else {}
    res.update({"rc": rc, "layers": layers, "ep": ep, "dispatcher": dispatcher, "seq_len": seq})
    if rc != 0:
        res["log_tail"] = log[-3000:]
    return res


def cp_ladder(timeout: float, mem_cap_gib: float, start: int) -> dict:
    """Longest row (doubling from `start` tokens per rank) each CP size trains within `mem_cap_gib` per GPU."""
    deadline = time.time() + timeout
    result: dict = {"mem_cap_gib": mem_cap_gib}
    for cp in (1, 2):
        runs = []
        seq = start
        while time.time() < deadline - 30:
            out = TMP / f"cp{cp}_{seq}.json"
            out.unlink(missing_ok=True)
            cmd = trainer_bench(
                DENSE_MODEL, seq * cp, cp, out, ["--model.cp", str(cp)], steps=2, mem_cap_gib=mem_cap_gib
            )
            rc, log = run(cmd, deadline - time.time())
            ok = rc == 0 and out.exists()
            oom = "OutOfMemory" in log or "out of memory" in log
            errors = [line for line in log.splitlines() if "Error" in line]
            error = "out of memory" if oom else (errors[-1] if errors else log[-800:])
            rec = json.loads(out.read_text()) if ok else {"error": error}
            runs.append({"seq_len": seq * cp, "ok": ok, **{k: rec.get(k) for k in ("tokens_per_s", "peak_memory_gib")},
                         **({} if ok else {"error": rec.get("error")})})  # fmt: skip
            print(f"cp={cp} seq={seq * cp}: {runs[-1]}", flush=True)
            if not ok:
                break
            seq *= 2
        done = [r for r in runs if r["ok"]]
        result[f"cp{cp}"] = {"runs": runs, "max_seq_len": max((r["seq_len"] for r in done), default=None)}
    m1, m2 = result["cp1"]["max_seq_len"], result["cp2"]["max_seq_len"]
    result["ratio"] = m2 / m1 if m1 and m2 else None
    return result


# --- in-process mode: dispatch micro-benchmark (run under torchrun) ---------------------------------------------


def dispatch_micro(out: Path, tokens: int) -> None:
    import torch
    import torch.distributed as dist
    from prime_models import ParallelDims, load_model
    from prime_models.parallel.expert_parallel import apply_expert_parallel

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("cuda:nccl,cpu:gloo", device_id=device)
    cfg = {**QWEN3_30B_A3B, "num_hidden_layers": 1}
    mesh = ParallelDims(ep=world, world_size=world).build_mesh("cuda")
    torch.manual_seed(rank)  # different tokens (and routings) per rank
    x = torch.randn(tokens, cfg["hidden_size"], device=device, dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    res: dict = {"tokens_per_gpu": tokens, "world_size": world, "device": torch.cuda.get_device_name(device)}
    outputs = {}
    for kind in ("torch", "deepep"):
        try:
            model = load_model(cfg, seed=0, device=device, dtype=torch.bfloat16)
            apply_expert_parallel(model, mesh.ep, dispatcher=kind)
        except ImportError as e:
            res[kind] = {"error": str(e)}
            continue
        moe = model.moe_layers()[0]

        def step(moe=moe):
            xi = x.detach().requires_grad_()
            y = moe(xi)
            y.backward(grad)
            return y, xi.grad

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        y, gx = step()
        outputs[kind] = (y.float(), gx.float())
        res[kind] = {"fwd_bwd_ms": 1e3 * sorted(times)[len(times) // 2]}
    if len(outputs) == 2:
        (ya, ga), (yb, gb) = outputs["deepep"], outputs["torch"]
        res["rel_diff"] = {"out": float((ya - yb).norm() / yb.norm()), "grad_x": float((ga - gb).norm() / gb.norm())}
        res["speedup"] = res["torch"]["fwd_bwd_ms"] / res["deepep"]["fwd_bwd_ms"]
    if rank == 0:
        out.write_text(json.dumps(res, indent=2))
        print(json.dumps(res, indent=2), flush=True)
    dist.destroy_process_group()


# --- driver and report ------------------------------------------------------------------------------------------


def run_jobs(jobs: list[str], out_dir: Path, budget_s: float, mem_cap_gib: float = 20, cp_start: int = 32768) -> None:
    TMP.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    results_file = out_dir / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    deadline = time.time() + budget_s
    for name in jobs:
        left = deadline - time.time()
        if left < 30:
            results[name] = {"status": "skipped (budget spent)"}
            continue
        print(f"== {name}", flush=True)
        t0 = time.time()
        if name.startswith("rl"):
            res = rl_job(name, left)
        elif name == "dispatch":
            out = TMP / "dispatch.json"
            out.unlink(missing_ok=True)
            import torch

            n = min(torch.cuda.device_count(), 4)
            rc, log = run([*torchrun(n), __file__, "--dispatch-micro", "--out", str(out)], left)
            res = json.loads(out.read_text()) if out.exists() else {"rc": rc, "log_tail": log[-3000:]}
        elif name == "cp_ladder":
            res = cp_ladder(left, mem_cap_gib, cp_start)
        else:
            raise SystemExit(f"unknown job {name!r}")
        res["wall_s"] = round(time.time() - t0, 1)
        results[name] = res
        print(json.dumps({k: v for k, v in res.items() if k != "log_tail"}, indent=1)[:2000], flush=True)
        results_file.write_text(json.dumps(results, indent=2))


def report(results_file: Path, commit: str, dest: Path) -> None:
    results = json.loads(results_file.read_text())
    dest.mkdir(parents=True, exist_ok=True)
    for name, r in results.items():
        if name.startswith("rl") and r.get("tokens_per_s") is not None:
            rec = {
                "benchmark": "trainer_rl_step_moe_ep",
                "job": name,
                "model": f"Qwen3-30B-A3B shape, {r['layers']} of 48 layers (random init)",
                "seq_len": r["seq_len"],
                "device": f"{r.get('world_size')} x {r.get('device_name')}",
                "commit": commit,
                "tokens_per_s": r["tokens_per_s"],
                "mfu": r["mfu"],
                "peak_memory_gib": r["peak_memory_gib"],
                "step_time_s": r.get("step_time_s"),
                "ep": r["ep"],
                "dispatcher": r["dispatcher"],
                "target": {"mfu": 15.0, "met": bool(r["mfu"] is not None and r["mfu"] >= 15.0)},
            }
        elif name == "dispatch" and "torch" in r:
            # Tokens through one MoE layer's forward + backward per second, all GPUs, with the faster dispatcher.
            best = min(
                (r[k] for k in ("torch", "deepep") if "fwd_bwd_ms" in r.get(k, {})), key=lambda d: d["fwd_bwd_ms"]
            )
            rec = {"benchmark": "moe_dispatch_fwd_bwd", "job": name, "model": "Qwen3-30B-A3B MoE layer",
                   "seq_len": r.get("tokens_per_gpu"), "device": f"{r.get('world_size')} x {r.get('device')}",
                   "commit": commit, "tokens_per_s": r["tokens_per_gpu"] * r["world_size"] / best["fwd_bwd_ms"] * 1e3,
                   "mfu": None, "peak_memory_gib": None,
                   **{k: r.get(k) for k in ("torch", "deepep", "rel_diff", "speedup")}}  # fmt: skip
        elif name == "cp_ladder" and "cp1" in r:
            longest = max((x for x in r["cp2"]["runs"] if x["ok"]), key=lambda x: x["seq_len"], default={})
            rec = {"benchmark": "context_parallel_max_seq_len", "job": name, "model": "Qwen3-0.6B shape (random init)",
                   "seq_len": longest.get("seq_len"), "device": "2 x NVIDIA H200", "commit": commit,
                   "tokens_per_s": longest.get("tokens_per_s"), "mfu": None,
                   "peak_memory_gib": longest.get("peak_memory_gib"), **r}  # fmt: skip
        else:
            continue
        (dest / f"moe_gpu_{name}.json").write_text(json.dumps(rec, indent=2) + "\n")
        print(name, {k: rec.get(k) for k in ("tokens_per_s", "mfu", "peak_memory_gib", "speedup", "ratio")})


def capped_trainer(cap_gib: float, argv: list[str]) -> None:
    """Run the trainer with this process's GPU memory capped: the allocator raises OOM beyond `cap_gib`."""
    import runpy

    import torch

    device = int(os.environ.get("LOCAL_RANK", 0))
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total), device)
    sys.argv = ["trainer", *argv]
    runpy.run_module("prime_trainer.entrypoints.trainer", run_name="__main__")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--capped-trainer":
        return capped_trainer(float(sys.argv[2]), sys.argv[3:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", default="rl16k_ep4_torch,rl16k_ep4_deepep,dispatch,cp_ladder")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget-s", type=float, default=1500)
    ap.add_argument("--report", type=Path)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--dispatcher", choices=("torch", "deepep"), help="shorthand: run only rl16k_ep4_<dispatcher>")
    ap.add_argument("--dispatch-micro", action="store_true")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--mem-cap-gib", type=float, default=20.0, help="cp_ladder: GPU memory each process may use")
    ap.add_argument("--cp-start", type=int, default=32768, help="cp_ladder: first row length per rank")
    args = ap.parse_args()
    if args.dispatch_micro:
        dispatch_micro(args.out, args.tokens)
    elif args.report:
        report(args.report, args.commit, ROOT / "benchmarks/results")
    else:
        jobs = [f"rl16k_ep4_{args.dispatcher}"] if args.dispatcher else [j for j in args.jobs.split(",") if j]
        run_jobs(jobs, args.out or TMP / "out", args.budget_s, args.mem_cap_gib, args.cp_start)


if __name__ == "__main__":
    main()
