"""GPU trainer benchmarks: prime's `trainer --bench` / `sft --bench` against a transformers + FSDP2 baseline
(benchmarks/baseline_hf.py, with liger-kernel's fused linear cross-entropy and activation checkpointing) on the same
device in the same call.

    python benchmarks/trainer_gpu.py --suite onegpu --out $OUT [--wheels .whl] [--commit <sha>]   # issue 43, one call
    python benchmarks/trainer_gpu.py --jobs smoke,rl16k,base16k_liger_ac,... --out $OUT --commit <sha>
    python benchmarks/trainer_gpu.py --report results.json --commit <sha>   # -> benchmarks/results/*.json
    python benchmarks/trainer_gpu.py --suite onegpu --tiny --device cpu --out /tmp/x   # CPU smoke of the plumbing

Model: benchmarks/models/qwen3-0.6b (config only: Qwen3-0.6B shape, random init). Each job is a fresh process
(clean peak memory); jobs run in the order given until `--budget-s` is spent. Besides the end-to-end jobs:
`micro` times SDPA backends (flash, cudnn, efficient) and FlashAttention-4 (`fa4`, where installed)
forward+backward at 16k/65k and the fused log-prob head, `profile<S>` runs the trainer's own setup and `train_step`
in-process: timed steps (tokens/s, peak memory, the memory plan) and then one step under torch.profiler, CUDA kernel
time grouped by kind. Everything lands in one
`results.json` under `--out` (plus `profile_*.txt`); `--report` turns that into benchmarks/results/trainer_gpu_*.json
records, each with its ratio to the matching baseline; `--suite` runs a fixed job list and writes its records under
`$OUT/records` (benchmarks/trainer_gpu_suite.py). liger-kernel is not on the GPU hosts: `--wheels DIR` installs a
wheel from DIR for the baseline jobs (`pip download liger-kernel==0.8.5 --no-deps -d .whl`, carried with the tree).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "benchmarks/models/qwen3-0.6b"
PY = sys.executable
H100_PEAK = 989e12


def trainer_cmd(
    process: str,
    seq: int,
    extra: list[str],
    out: Path,
    steps: int = 5,
    rows: int = 1,
    micro_rows: int = 1,
    model: Path = MODEL,
    device: str = "auto",
) -> list[str]:
    module = "prime_trainer.entrypoints." + ("trainer" if process == "trainer" else "sft")
    return [PY, "-m", module, "--bench", "--model.name", str(model), "--init.random", "--data.fake.batch-size", str(rows),
            "--data.fake.micro-batch-size", str(micro_rows), "--data.fake.seq-len", str(seq), "--seq-len", str(seq),
            "--max-steps", str(steps), "--output-dir", f"/tmp/prime_bench/{out.stem}", "--bench-file", str(out),
            "--log.file", "false", "--device", device, *extra]  # fmt: skip


def baseline_cmd(seq: int, liger: bool, ac: bool, out: Path, model: Path = MODEL, device: str = "cuda") -> list[str]:
    cmd = [PY, str(ROOT / "benchmarks/baseline_hf.py"), "--model", str(model), "--seq-len", str(seq), "--out", str(out)]
    return cmd + (["--liger"] if liger else []) + (["--ac"] if ac else []) + ["--device", device]


@dataclass
class Host:
    """Where jobs run: the model, the device, how row lengths scale (``--tiny`` shrinks 1k tokens to 4)."""

    model: Path = MODEL
    device: str = "auto"
    tokens_per_k: int = 1024
    gpu_total_gib: float | None = None
    """The GPU's memory, for `_cap<G>` jobs (None on CPU)."""
    pythonpath: str = ""
    """Extra import path of the baseline jobs (an installed liger-kernel wheel)."""


def _trainer_flags(flags: set[str], host: Host) -> list[str]:
    """Trainer options of a job's `_`-separated flags (see `job_spec`)."""
    extra = (
        []
        if "auto" in flags
        else ["--parallel.ac", "none" if "noac" in flags else "selective" if "sel" in flags else "full"]
    )
    for f in sorted(flags):
        if f.startswith("keepattn"):
            extra += ["--parallel.ac-keep-attention", f[len("keepattn") :] or "-1"]
        elif f.startswith("mlpchunk") and f[len("mlpchunk") :].isdigit():
            extra += ["--parallel.ac-mlp-chunks", f[len("mlpchunk") :]]
        elif f == "offloadattn":
            extra += ["--parallel.ac-offload-attention"]
        elif f.startswith("c") and f[1:].isdigit():
            extra += ["--init.logprob-chunk-size", f[1:]]
        elif f == "var":
            extra += ["--data.fake.variable-lengths", "true"]
        elif f.startswith("var") and f[3:].isdigit():
            extra += ["--data.fake.variable-lengths", "true", "--data.fake.max-sample-len", f[3:]]
        elif f == "fsdp":
            extra += ["--parallel.fsdp-one-rank"]
        elif f == "compilelayers":
            extra += ["--parallel.compile-layers", "true"]
        elif f == "cudagraphs":
            extra += ["--parallel.cuda-graphs", "true"]
        elif f == "fa4":
            extra += ["--init.attn", "flash_attn4"]
        elif f == "sdpa":
            extra += ["--init.attn", "sdpa"]
        elif f.startswith("cap") and host.gpu_total_gib:
            extra += ["--gpu-memory-fraction", f"{float(f[3:]) / host.gpu_total_gib:.6f}"]
    return extra


def _flag_int(flags: set[str], letter: str, default: int) -> int:
    return next((int(f[1:]) for f in flags if f.startswith(letter) and f[1:].isdigit()), default)


def job_spec(name: str, tmp: Path, host: Host | None = None) -> tuple[list[str], dict[str, str]]:
    """Command and extra env of a named job. Names: rl<K>k[_noac|_sel|_auto][_cudnn|_flash][_c<chunk>][_keepattn[N]]
    [_offloadattn][_mlpchunk<N>][_gqa|_expandkv][_fa4|_sdpa][_nocompile][_nomaingrad][_compilelayers][_cudagraphs][_fsdp][_cap<GiB>]
    [_b<rows>][_m<rows>][_s<steps>][_var|_var<N>][_mask][_fullhead], sft<K>k..., base<K>k[_liger][_ac], profile<K>k[...], micro.
    `_b<N>` trains N rows of <K>k tokens per step in micro-batches of `_m<M>` rows (default one row of each), and `_var`
    packs random-length samples into each row (`_var<N>`: of at most N tokens): `rl2k_auto_b64_m8_var400` is the
    one-GPU RL loop's step (512 rollouts of ~200 tokens packed into 2048-token rows, eight rows a forward). `_mask`
    attends over packed rows through SDPA's block-diagonal mask instead of torch's varlen kernel (`PRIME_SDPA_VARLEN=0`);
    `_fullhead` runs the LM head on every position, not only those predicting loss tokens (`PRIME_HEAD_ON_LOSS_TOKENS=0`).
    `_auto` leaves `parallel.ac` at its default (chosen from the free memory at the first step); otherwise full AC unless
    `_noac` / `_sel`. `_mlpchunk<N>` runs each dense MLP in N sequence chunks under full AC (`--parallel.ac-mlp-chunks
    N`); `_offloadattn` (with `_keepattn`) holds the kept attention outputs in pinned host memory between forward and
    backward (`--parallel.ac-offload-attention`). `_fsdp` wraps one rank in FSDP2 (`--parallel.fsdp-one-rank`, the path
    before issue 43); `_compilelayers` compiles each decoder layer (`--parallel.compile-layers`); `_cudagraphs` replays
    the decoder stack from CUDA graphs (`--parallel.cuda-graphs`); `_cap<G>` gives the trainer G GiB of the GPU
    (`--gpu-memory-fraction`); `_fa4` attends with FlashAttention-4 (`--init.attn flash_attn4`), `_sdpa` with SDPA (`--init.attn sdpa`: `auto` takes
    FlashAttention-4 for rows of 32k tokens or more where it is installed); `_nomaingrad` keeps
    weight gradients in bf16 until the hooks add them to the fp32 ones (`PRIME_MAIN_GRAD=0`, the path before fp32 sums
    inside the matmuls); `_s<N>` runs N steps (the first is warmup)."""
    host = host or Host()
    out = tmp / f"{name}.json"
    env: dict[str, str] = {}
    if name == "micro":
        return [PY, __file__, "--micro", "--out", str(out)], env
    if name == "smoke":
        return trainer_cmd("trainer", 4096, ["--parallel.ac", "full"], out, steps=3, model=host.model), env
    parts = name.split("_")
    head, flags = parts[0], set(parts[1:])
    kind = head.rstrip("0123456789k")
    seq = int(head[len(kind) :].rstrip("k")) * host.tokens_per_k
    for b in ("cudnn", "flash", "efficient"):
        if b in flags:
            env["PRIME_SDPA_BACKENDS"] = b
    if "gqa" in flags:  # native GQA is the default now; the flag stays so older job names still mean the same
        env["PRIME_SDPA_GQA"] = "1"
    if "expandkv" in flags:
        env["PRIME_SDPA_GQA"] = "0"
    if "nocompile" in flags:
        env["PRIME_COMPILE_ELEMENTWISE"] = "0"
    if "nomaingrad" in flags:
        env["PRIME_MAIN_GRAD"] = "0"
    if "mask" in flags:
        env["PRIME_SDPA_VARLEN"] = "0"
    if "fullhead" in flags:
        env["PRIME_HEAD_ON_LOSS_TOKENS"] = "0"
    if kind == "base":
        if host.pythonpath:
            env["PYTHONPATH"] = host.pythonpath
        device = "cpu" if host.device == "cpu" else "cuda"
        return baseline_cmd(seq, "liger" in flags, "ac" in flags, out, host.model, device), env
    shape = dict(rows=_flag_int(flags, "b", 1), micro_rows=_flag_int(flags, "m", 1), steps=_flag_int(flags, "s", 5))
    cmd = trainer_cmd("sft" if kind == "sft" else "trainer", seq, _trainer_flags(flags, host), out,
                      model=host.model, device=host.device, **shape)  # fmt: skip
    if kind == "profile":
        return [PY, __file__, "--profile", "--out", str(out), "--", *cmd[3:]], env
    return cmd, env


def run_jobs(jobs: list[str], out_dir: Path, budget_s: float, host: Host | None = None) -> dict:
    tmp = Path("/tmp/prime_bench")
    tmp.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    results_file = out_dir / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    deadline = time.time() + budget_s
    # The tree's packages come first, so the jobs run the code of this checkout (the commit its records name) even
    # where older wheels of them are installed (benchmarks/gpu_setup.sh).
    src = os.pathsep.join(str(p) for p in sorted(ROOT.glob("packages/*/src")))
    base_env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    for name in jobs:
        left = deadline - time.time()
        if left < 20:
            print(f"== {name}: skipped (budget spent)", flush=True)
            results[name] = {"status": "skipped"}
            continue
        cmd, env = job_spec(name, tmp, host)
        print(f"== {name}: {' '.join(cmd[1:])} {env}", flush=True)
        for stale in (tmp / f"{name}.json", tmp / f"{name}.txt"):  # a job that fails must not report an older run
            stale.unlink(missing_ok=True)
        t0 = time.time()
        job_env = {**base_env, **env}
        if "PYTHONPATH" in env:  # a job's own path (liger-kernel) goes in front of the tree's
            job_env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + base_env["PYTHONPATH"]
        try:
            proc = subprocess.run(cmd, env=job_env, capture_output=True, text=True, timeout=left)
            rc, log = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, log = "timeout", (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        wall = time.time() - t0
        res_path = tmp / f"{name}.json"
        res = json.loads(res_path.read_text()) if res_path.exists() else {}
        res.update({"job": name, "rc": rc, "wall_s": round(wall, 1), "env": env})
        if rc != 0:
            res["log_tail"] = log[-3000:]
        results[name] = res
        lines = [ln for ln in log.splitlines() if any(k in ln for k in ("step ", "memory: ", "Error", "error"))]
        print("\n".join(lines[-8:]), flush=True)
        print(f"-> rc={rc} wall={wall:.0f}s tok/s={res.get('tokens_per_s')} peak={res.get('peak_memory_gib')}",
              flush=True)  # fmt: skip
        if name.startswith("profile") and (tmp / f"{name}.txt").exists():
            (out_dir / f"{name}.txt").write_text((tmp / f"{name}.txt").read_text())
        results_file.write_text(json.dumps(results, indent=2))
        if name == "smoke" and rc != 0:
            print("smoke failed: stopping", flush=True)
            break
    return results


# --- in-process modes ---------------------------------------------------------------------------------------------


def _time_cuda(fn, iters: int = 3) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _fa4_attend(seq: int, dim: int):
    """FlashAttention-4 through prime-models' op, called like SDPA on one `[1, N, S, D]` row."""
    import torch
    from prime_models.layers.flash_attn4 import flash_attn4_varlen

    cu = torch.tensor([0, seq], dtype=torch.int32, device="cuda")

    def attend(q, k, v, is_causal):
        flat = [t[0].transpose(0, 1) for t in (q, k, v)]  # [S, N, D]
        return flash_attn4_varlen(*flat, cu, seq, dim**-0.5)[0].transpose(0, 1)[None]

    return attend


def micro(out: Path) -> None:
    """Per-layer attention fwd / fwd+bwd per SDPA backend, and the fused head fwd+bwd, at Qwen3-0.6B shapes."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sys.path.insert(0, str(ROOT / "packages/prime-models/src"))
    from prime_models.fused_head import fused_logprobs

    dev = torch.device("cuda")
    res: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "attention": {}, "head": {}}
    heads, dim = 16, 128
    for seq in (16384, 65536):
        # Causal attention FLOPs (fwd): 2 matmuls x 2 flops x S^2/2 x D per head.
        fwd_flops = 2 * 2 * seq * seq / 2 * dim * heads
        for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("fa4", None)]:  # fmt: skip
            qkv = [torch.randn(1, heads, seq, dim, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv"]
            grad = torch.randn(1, heads, seq, dim, device=dev, dtype=torch.bfloat16)
            try:
                attend = _fa4_attend(seq, dim) if backend is None else F.scaled_dot_product_attention
                with sdpa_kernel([backend or SDPBackend.MATH]):

                    def fwd(qkv=qkv, attend=attend):
                        with torch.no_grad():
                            attend(*qkv, is_causal=True)

                    def fwd_bwd(qkv=qkv, grad=grad, attend=attend):
                        o = attend(*qkv, is_causal=True)
                        torch.autograd.grad(o, qkv, grad)

                    tf, tfb = _time_cuda(fwd), _time_cuda(fwd_bwd)
                res["attention"][f"{name}_{seq}"] = {
                    "fwd_ms": tf * 1e3,
                    "fwd_bwd_ms": tfb * 1e3,
                    "fwd_tflops": fwd_flops / tf / 1e12,
                    "bwd_tflops": 2 * fwd_flops / (tfb - tf) / 1e12,
                    # One RL step with full AC: fwd + recompute fwd + bwd, 28 layers.
                    "step_s_28_layers_full_ac": 28 * (tfb + tf),
                }
            except Exception as e:  # a backend may not support this shape / build
                res["attention"][f"{name}_{seq}"] = {"error": str(e)[:300]}
            print(name, seq, res["attention"][f"{name}_{seq}"], flush=True)
            del qkv, grad
            torch.cuda.empty_cache()
    vocab, hidden = 151936, 1024
    w = (torch.randn(vocab, hidden, device=dev) * 0.02).to(torch.bfloat16).requires_grad_()
    # GPU check of the compiled head against its eager path (same bf16 inputs): relative error of each output.
    import prime_models.fused_head as fh
    from prime_models import kernels

    h = torch.randn(4096, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, vocab, (4096,), device=dev)
    g_lp, g_ent = torch.randn(4096, device=dev), torch.randn(4096, device=dev)
    outs = []
    for compiled in (False, True):
        fh.COMPILE_ON_CUDA = compiled
        h.grad = w.grad = None
        lp, ent = fused_logprobs(h, w, t, temperature=0.8, chunk_size=1024)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        outs.append([lp.detach(), ent.detach(), h.grad.float(), w.grad.float()])
    fh.COMPILE_ON_CUDA = True
    res["head_check_rel_err"] = {
        k: float((a - b).norm() / b.norm())
        for k, a, b in zip(("lp", "ent", "grad_h", "grad_w"), outs[1], outs[0], strict=True)
    }
    print("head check", res["head_check_rel_err"], "addmm fp32:", kernels.ADDMM_FP32_OUT, flush=True)
    w.grad = None
    for seq in (16384, 65536):
        for chunk in (1024, 2048, 4096):
            h = torch.randn(seq, hidden, device=dev, dtype=torch.bfloat16, requires_grad=True)
            t = torch.randint(0, vocab, (seq,), device=dev)

            def head(h=h, t=t, chunk=chunk):
                lp, _ = fused_logprobs(h, w, t, chunk_size=chunk)
                lp.sum().backward()

            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            th = _time_cuda(head)
            res["head"][f"{seq}_c{chunk}"] = {
                "fwd_bwd_ms": th * 1e3,
                "tflops": 3 * 2 * seq * vocab * hidden / th / 1e12,
                "extra_peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
            }
            print("head", seq, chunk, res["head"][f"{seq}_c{chunk}"], flush=True)
            w.grad = None
    out.write_text(json.dumps(res, indent=2))


KINDS = [
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    ("optimizer", ("adam",)),
    ("nccl", ("nccl",)),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "sm90", "cublas", "aten::mm", "aten::addmm", "aten::bmm")),
]


def _profile_summary(prof, wall: float, on_cuda: bool) -> tuple[dict, str]:
    """Kernel time of one profiled step grouped by kind (CUDA; operator self time on CPU), and the top kernels."""
    import torch

    if on_cuda:
        # User annotations (FSDP::..., Optimizer.step#...) carry the device time of the kernels inside them: skip them.
        events = [
            e
            for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        self_s = {e.key: e.self_device_time_total / 1e6 for e in events}
    else:
        events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        self_s = {e.key: e.self_cpu_time_total / 1e6 for e in events}
    total = sum(self_s.values())
    by_kind: dict[str, float] = {}
    for key, t in self_s.items():
        kind = next((k for k, pats in KINDS if any(p in key.lower() for p in pats)), "elementwise/other")
        by_kind[kind] = by_kind.get(kind, 0.0) + t
    top = sorted(events, key=lambda e: -self_s[e.key])[:15]
    summary = {
        "step_wall_s": wall,
        "kernel_s": total,
        "idle_s": wall - total,
        "by_kind_s": dict(sorted(by_kind.items(), key=lambda x: -x[1])),
        "top_kernels": [{"name": e.key[:120], "calls": e.count, "s": round(self_s[e.key], 5)} for e in top],
    }
    if on_cuda:  # where the host time between kernels goes: operators by self CPU time (launches, syncs, Python)
        host = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CPU]
        host = sorted(host, key=lambda e: -e.self_cpu_time_total)[:25]
        summary["top_host_ops"] = [
            {"name": e.key[:120], "calls": e.count, "self_cpu_s": round(e.self_cpu_time_total / 1e6, 5)} for e in host
        ]
    what = "CUDA kernel time" if on_cuda else "CPU operator self time"
    lines = [f"step wall {wall:.3f}s, {what} {total:.3f}s (idle/launch gap {wall - total:.3f}s)"]
    lines += [f"{k:20s} {v:8.3f}s {100 * v / max(total, 1e-9):5.1f}%" for k, v in summary["by_kind_s"].items()]
    lines += ["", f"{'kernel':100s} {'calls':>6s} {'total ms':>10s}"]
    lines += [f"{e.key[:100]:100s} {e.count:6d} {self_s[e.key] * 1e3:10.1f}" for e in top]
    if on_cuda:
        lines += ["", f"{'host operator':100s} {'calls':>6s} {'self ms':>10s}"]
        lines += [
            f"{h['name'][:100]:100s} {h['calls']:6d} {h['self_cpu_s'] * 1e3:10.1f}" for h in summary["top_host_ops"]
        ]
    return summary, "\n".join(lines)


def profile(out: Path, argv: list[str], warmup: int = 1, measured: int = 3) -> None:
    """The trainer's own setup and `train_step` in this process: `warmup` + `measured` timed steps (tokens/s, peak
    memory, as `--bench` reports them), then one step under torch.profiler, kernel time grouped by kind."""
    import torch
    from prime_core.config import parse_cli
    from prime_core.config.trainer import TrainerConfig
    from prime_trainer import common
    from prime_trainer.rl.data import TensorMicroBatch, fake_micro_batches
    from prime_trainer.rl.loss import build_objective
    from prime_trainer.rl.train import train_step

    cfg = parse_cli(TrainerConfig, argv, prog="trainer")
    c = common.setup(cfg, "trainer")
    objective, device = build_objective(cfg.loss), c.world.device
    on_cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    tokens = cfg.data.fake.batch_size * (cfg.data.fake.seq_len or cfg.seq_len)

    def one(step: int) -> float:
        _, batches = fake_micro_batches(cfg.data.fake, cfg.seq_len, c.model_source.vocab_size, step, c.world, cfg.seed)
        mbs = [TensorMicroBatch.from_numpy(mb, device) for mb in batches]
        sync()
        t0 = time.perf_counter()
        train_step(c, objective, step, mbs, 1.0)
        sync()
        return time.perf_counter() - t0

    times, peaks = [], []
    for step in range(warmup + measured):
        common.perf.reset_peak_memory(device)
        times.append(one(step))
        peaks.append(common.perf.peak_memory_gib(device))
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if on_cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        wall = one(warmup + measured)
    summary, text = _profile_summary(prof, wall, on_cuda)
    print(text)
    out.with_suffix(".txt").write_text(text)
    step_s = sum(times[warmup:]) / measured
    result = {
        "process": "trainer", "device_name": common.perf.device_name(device), "world_size": c.world.world_size,
        "seq_len": cfg.data.fake.seq_len or cfg.seq_len, "batch_size": cfg.data.fake.batch_size,
        "micro_batch_size": cfg.data.fake.micro_batch_size, "steps_measured": measured,
        "tokens_per_s": tokens / step_s, "step_time_s": step_s, "peak_memory_gib": max(peaks[warmup:]),
        "mfu": common.perf.mfu(c.flops_per_token(cfg.seq_len), tokens / step_s, c.peak_flops, c.world.world_size),
        "memory_plan": c.memory_plan.describe() if c.memory_plan is not None else None,
        "one_rank_path": common.one_rank_path(c), "cuda_graphs": common.cuda_graphs_summary(c.model),
        "profile": summary,
    }  # fmt: skip
    out.write_text(json.dumps(result, indent=2))


# --- report -------------------------------------------------------------------------------------------------------

PRIME_RL = {16384: {"rl": (11900, 12.5), "sft": (25500, 52.8)}, 65536: {"rl": (10100, 19.6)}}
TARGETS = {16384: (30000, 12.5), 65536: (17000, 20.0)}
ANCHORS = {  # transformers, same H100 (issue 9)
    "base16k": (24500, 42.7), "base64k": None, "base16k_liger_ac": (24100, 11.8),
    "base64k_liger_ac": (12300, 18.4), "base16k_liger": (29600, 40.6),
}  # fmt: skip


def report(results_file: Path, commit: str, dest: Path) -> None:
    """One JSON record per trainer job, with its ratio to the baseline of the same length run in the same call."""
    results = json.loads(results_file.read_text())
    dest.mkdir(parents=True, exist_ok=True)
    for name, r in results.items():
        if (
            name in ("micro",)
            or name.startswith("profile")
            or r.get("tokens_per_s") is None
            and r.get("status") != "oom"
        ):
            continue
        seq = r.get("seq_len")
        kind = name.split("_")[0].rstrip("0123456789k")
        head = name.split("_")[0]
        k = head[len(kind) :]
        base_name = f"base{k}_liger_ac"
        base = results.get(base_name, {})
        rec = {
            "benchmark": {"rl": "trainer_rl_step", "sft": "trainer_sft_step", "base": r.get("benchmark")}.get(
                kind, name
            ),
            "job": name,
            "model": "Qwen3-0.6B shape (random init)",
            "seq_len": seq,
            "device": r.get("device_name") or r.get("device"),
            "commit": commit,
            "tokens_per_s": r.get("tokens_per_s"),
            "mfu": r.get("mfu"),
            "peak_memory_gib": r.get("peak_memory_gib"),
            "step_time_s": r.get("step_time_s"),
            "env": r.get("env", {}),  # knobs: PRIME_SDPA_GQA, PRIME_SDPA_BACKENDS
        }
        if kind != "base":
            bt = base.get("tokens_per_s")
            rec["baseline"] = {"job": base_name, "tokens_per_s": bt, "peak_memory_gib": base.get("peak_memory_gib")}
            rec["ratio_to_baseline"] = rec["tokens_per_s"] / bt if bt and rec["tokens_per_s"] else None
            ref = PRIME_RL.get(seq, {}).get(kind)
            if ref:
                rec["prime_rl"] = {"tokens_per_s": ref[0], "peak_memory_gib": ref[1]}
            if kind == "rl" and seq in TARGETS:
                t, m = TARGETS[seq]
                rec["target"] = {"tokens_per_s": t, "peak_memory_gib": m,
                                 "met": bool(rec["tokens_per_s"] >= t and rec["peak_memory_gib"] <= m)}  # fmt: skip
        else:
            rec["status"] = r.get("status")
            rec["anchor"] = ANCHORS.get(name)
        (dest / f"trainer_gpu_{name}.json").write_text(json.dumps(rec, indent=2) + "\n")
        print(name, rec["tokens_per_s"], rec["peak_memory_gib"], rec.get("ratio_to_baseline"))


def run_suite(args: argparse.Namespace) -> None:
    """`--suite NAME`: the suite's jobs (benchmarks/trainer_gpu_suite.py), then its records under `--out`/records."""
    from importlib.metadata import PackageNotFoundError, version

    import trainer_gpu_suite as suite
    from provenance import tree_commit

    tmp = Path("/tmp/prime_bench")
    tmp.mkdir(parents=True, exist_ok=True)
    jobs = suite.suite_jobs(args.suite, args.tiny)
    pythonpath, liger = ("", "not used (--tiny)") if args.tiny else suite.liger_path(args.wheels, tmp)
    host = Host(
        model=suite.tiny_model(tmp) if args.tiny else MODEL,
        device=args.device,
        tokens_per_k=4 if args.tiny else 1024,
        gpu_total_gib=None if args.device == "cpu" else suite.gpu_total_gib(),
        pythonpath=pythonpath,
    )
    print(f"suite {args.suite}: {len(jobs)} jobs, GPU {host.gpu_total_gib} GiB, liger-kernel {liger}", flush=True)
    t0 = time.time()
    results = run_jobs([job for job, _ in jobs], args.out, args.budget_s, host)

    def ver(pkg: str) -> str | None:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    device = next((r.get("device_name") for r in results.values() if r.get("device_name")), None)
    meta = {
        "suite": args.suite, "device": device, "commit": tree_commit(args.commit if args.commit != "unknown" else None),
        "model": "tiny qwen3 (--tiny)" if args.tiny else "Qwen3-0.6B shape (random init, benchmarks/models/qwen3-0.6b)",
        "vocab_size": suite.TINY_CONFIG["vocab_size"] if args.tiny else suite.VOCAB,
        "torch": ver("torch"), "transformers": ver("transformers"), "liger_kernel": liger,
        "gpu_total_gib": host.gpu_total_gib, "suite_wall_s": round(time.time() - t0, 1),
    }  # fmt: skip
    print("records:", suite.write_records(args.suite, args.tiny, results, args.out, meta).parent, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", default="")
    ap.add_argument("--suite", help="run a fixed job list and write its records (benchmarks/trainer_gpu_suite.py)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--budget-s", type=float, default=520)
    ap.add_argument("--micro", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--report", type=Path)
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto", help="of the suite's jobs")
    ap.add_argument("--tiny", action="store_true", help="suite on a tiny model with short rows (CPU smoke)")
    ap.add_argument("--wheels", type=Path, help="directory with a liger-kernel wheel for the baselines")
    ap.add_argument("rest", nargs="*")
    args = ap.parse_args()
    if (args.jobs or args.suite or args.micro or args.profile) and args.out is None:
        ap.error("--out is required")
    if args.micro:
        micro(args.out)
    elif args.profile:
        profile(args.out, args.rest)
    elif args.report:
        report(args.report, args.commit, ROOT / "benchmarks/results")
    elif args.suite:
        run_suite(args)
    else:
        import trainer_gpu_suite as suite

        jobs = [j for j in args.jobs.split(",") if j]
        pythonpath = ""
        if args.wheels and any(j.startswith("base") for j in jobs):  # the baselines' liger-kernel, as the suite does
            pythonpath, liger = suite.liger_path(args.wheels, Path("/tmp/prime_bench"))
            print(f"liger-kernel: {liger}", flush=True)
        # `_cap<G>` jobs need the GPU's size, as in a suite.
        gpu_gib = None if args.device == "cpu" else suite.gpu_total_gib()
        host = Host(device=args.device, gpu_total_gib=gpu_gib, pythonpath=pythonpath)
        run_jobs(jobs, args.out, args.budget_s, host)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
