"""Fixed job lists of benchmarks/trainer_gpu.py run in one call, and the records they write (`--suite NAME`).

`onegpu` (issue 43, items 2 and 3; about 7 minutes on one H100): the trainer with default flags, where
`parallel.ac = "auto"` picks the memory knobs and one rank computes on a bf16 working copy instead of under FSDP2,
against transformers + liger-kernel + activation checkpointing in the same call:

* one 16k row on the whole GPU and one with 12.5 GiB for the trainer (target >= 45k tok/s at <= 12.5 GiB), each
  with a torch.profiler summary of one step;
* one 64k row on the whole GPU and one with 16 GiB for the trainer (target >= 20k tok/s at <= 16 GiB: on a GPU
  bigger than an H100 the default plan keeps every activation, so only the cap measures the target), profiled;
* the 16k, 64k capped rows and the 64k row without checkpointing with FlashAttention-4 (`_fa4`; a one-line error
  where flash-attn-4 is not installed: benchmarks/fa4_setup.sh stages it on an offline host);
* the one-GPU loop's step, 64 packed 2048-token rows, one row per forward against eight (target >= 90%), the same
  rows under FSDP2 on one rank (the path before: its fixed cost per forward), without the torch.compile'd
  elementwise kernels (whether compiling pays at short rows, where their guards and wrappers cost host time), and
  with each decoder layer compiled (`parallel.compile_layers`, one row and eight a forward), and one row a forward
  with the decoder stack replayed from CUDA graphs (`parallel.cuda_graphs`, eager and compiled layers);
* if time is left, one 16k row with full checkpointing under FSDP2 and on the one-rank path.

Records land in `$OUT/records/trainer_gpu_onegpu_<job>.json` plus `trainer_gpu_onegpu.json` (every target, met or
not); copy them into benchmarks/results/.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ONEGPU = [
    ("profile16k_auto", "one 16k row, default flags, the whole GPU; profiled"),
    ("profile64k_auto", "one 64k row, default flags; profiled"),
    ("profile16k_auto_cap12.5", "one 16k row, default flags, 12.5 GiB of the GPU for the trainer; profiled"),
    ("profile64k_auto_cap16", "one 64k row, default flags, 16 GiB of the GPU for the trainer; profiled"),
    ("rl16k_auto_cap12.5_fa4", "one 16k row, default flags, 12.5 GiB, FlashAttention-4"),
    ("rl64k_auto_cap16_fa4", "one 64k row, default flags, 16 GiB, FlashAttention-4"),
    ("rl64k_noac_fa4", "one 64k row, no checkpointing (the whole GPU), FlashAttention-4"),
    ("base16k_liger_ac", "transformers + FSDP2 + liger FLCE + full AC, one 16k row"),
    ("base64k_liger_ac", "transformers + FSDP2 + liger FLCE + full AC, one 64k row"),
    ("rl2k_auto_b64_m8_var_s3", "the one-GPU loop's step: 64 packed 2048-token rows, 8 rows a forward"),
    ("rl2k_auto_b64_m1_var_s3", "the one-GPU loop's step: 64 packed 2048-token rows, 1 row a forward"),
    ("rl2k_auto_b16_m1_var_s3_fsdp", "16 packed 2048-token rows, 1 a forward, under FSDP2 on one rank (before #43)"),
    ("rl2k_auto_b64_m1_var_s3_nocompile", "the loop's step, 1 row a forward, without torch.compile'd elementwise ops"),
    ("rl2k_auto_b64_m1_var_s3_compilelayers", "the loop's step, 1 row a forward, each decoder layer compiled"),
    ("rl2k_auto_b64_m8_var_s3_compilelayers", "the loop's step, 8 rows a forward, each decoder layer compiled"),
    ("rl2k_auto_b64_m1_var_s3_cudagraphs", "the loop's step, 1 row a forward, the decoder stack from CUDA graphs"),
    (
        "rl2k_auto_b64_m1_var_s3_cudagraphs_compilelayers",
        "the loop's step, 1 row a forward, CUDA graphs of the compiled decoder layers",
    ),
    ("rl16k_s4_fsdp", "one 16k row, full AC, under FSDP2 on one rank (the default before #43)"),
    ("rl16k_s4", "one 16k row, full AC, on the one-rank path"),
]
SUITES = {"onegpu": ONEGPU}
TARGETS = {  # job: (tokens/s, peak GiB), issue 43 on one H100
    "profile16k_auto_cap12.5": (45000, 12.5),
    "profile64k_auto": (20000, 16.0),
    "profile64k_auto_cap16": (20000, 16.0),
}
LOOP_RATIO_TARGET = ("rl2k_auto_b64_m1_var_s3", "rl2k_auto_b64_m8_var_s3", 0.9)
VOCAB = 151936
TINY_CONFIG = {
    "model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
}  # fmt: skip


def suite_jobs(name: str, tiny: bool) -> list[tuple[str, str]]:
    """The suite's (job, what) pairs; `tiny` runs the baselines without liger-kernel and leaves FlashAttention-4 out
    (both need a GPU)."""
    if name not in SUITES:
        raise SystemExit(f"--suite {name!r}: known suites {sorted(SUITES)}")
    if not tiny:
        return list(SUITES[name])
    return [(job.replace("_liger", ""), what) for job, what in SUITES[name] if "_fa4" not in job]


def gpu_total_gib() -> float | None:
    """The first visible GPU's memory from nvidia-smi (no CUDA context in this process: it would hold memory the
    jobs then lack); None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    lines = [float(x) for x in out.split()]
    index = int(visible) if visible.isdigit() and int(visible) < len(lines) else 0
    return lines[index] / 1024 if lines else None


def liger_path(wheels: Path | None, tmp: Path) -> tuple[str, str]:
    """(extra PYTHONPATH for the baselines, how liger-kernel was found). Installs a wheel from `wheels` when this
    Python lacks the package; an empty path and the reason when neither has it."""
    probe = [sys.executable, "-c", "import liger_kernel"]
    if subprocess.run(probe, capture_output=True).returncode == 0:
        return "", "installed"
    found = sorted(wheels.glob("liger_kernel-*.whl")) if wheels else []
    if not found:
        return "", f"missing: no liger_kernel-*.whl in {wheels} (pip download liger-kernel==0.8.5 --no-deps -d .whl)"
    target = tmp / "liger"
    shutil.rmtree(target, ignore_errors=True)
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--target",
        str(target),
        str(found[-1]),
    ]
    done = subprocess.run(pip, capture_output=True, text=True)
    if done.returncode != 0:
        return "", f"missing: pip could not install {found[-1].name}: {done.stderr.strip()[-300:]}"
    return str(target), f"wheel {found[-1].name}"


def tiny_model(tmp: Path) -> Path:
    path = tmp / "tiny-qwen3"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return path


def _baseline(results: dict, job: str, res: dict) -> dict:
    seq_k = job.split("_")[0].removeprefix("profile").removeprefix("rl")
    for name in (f"base{seq_k}_liger_ac", f"base{seq_k}_ac"):
        if name in results:
            b = results[name]
            return {"job": name, "tokens_per_s": b.get("tokens_per_s"), "peak_memory_gib": b.get("peak_memory_gib"),
                    "status": b.get("status") or ("ok" if b.get("rc") == 0 else f"rc {b.get('rc')}")}  # fmt: skip
    return {"job": None, "status": "not run in this call"}


def record(job: str, what: str, res: dict, results: dict, meta: dict) -> dict:
    rec = {"benchmark": "trainer_onegpu", "job": job, "what": what, **meta, "rc": res.get("rc")}
    for key in ("device_name", "device", "seq_len", "batch_size", "micro_batch_size", "tokens_per_s", "mfu",
                "step_time_s", "peak_memory_gib", "memory_plan", "one_rank_path", "cuda_graphs", "steps_measured", "wall_s", "env",
                "status", "profile", "log_tail"):  # fmt: skip
        if res.get(key) is not None:
            rec[key] = res[key]
    if not job.startswith("base"):
        rec["baseline"] = _baseline(results, job, res)
        bt = rec["baseline"].get("tokens_per_s")
        rec["ratio_to_baseline"] = res["tokens_per_s"] / bt if bt and res.get("tokens_per_s") else None
    if job in TARGETS:
        tps, gib = TARGETS[job]
        met = res.get("tokens_per_s") is not None and res["tokens_per_s"] >= tps and res["peak_memory_gib"] <= gib
        rec["target"] = {"tokens_per_s": tps, "peak_memory_gib": gib, "met": bool(met)}
    return rec


def write_records(name: str, tiny: bool, results: dict, out_dir: Path, meta: dict) -> Path:
    """One record per job of the suite and a summary of the targets under `out_dir/records`."""
    dest = out_dir / "records"
    dest.mkdir(parents=True, exist_ok=True)
    summary = {"benchmark": "trainer_onegpu", **meta, "jobs": {}, "targets": {}}
    for job, what in suite_jobs(name, tiny):
        res = results.get(job, {"status": "not run"})
        rec = record(job, what, res, results, meta)
        (dest / f"trainer_gpu_{name}_{job}.json").write_text(json.dumps(rec, indent=2) + "\n")
        summary["jobs"][job] = {k: rec.get(k) for k in ("tokens_per_s", "peak_memory_gib", "memory_plan", "rc")}
        if "target" in rec:
            summary["targets"][job] = {**rec["target"], "tokens_per_s_measured": rec.get("tokens_per_s"),
                                       "peak_memory_gib_measured": rec.get("peak_memory_gib")}  # fmt: skip
    one, eight, target = LOOP_RATIO_TARGET
    a, b = results.get(one, {}).get("tokens_per_s"), results.get(eight, {}).get("tokens_per_s")
    ratio = a / b if a and b else None
    summary["targets"]["loop_one_row_vs_eight"] = {
        "ratio": ratio,
        "target": target,
        "met": bool(ratio and ratio >= target),
    }
    path = dest / f"trainer_gpu_{name}.json"
    path.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["targets"], indent=2))
    return path
