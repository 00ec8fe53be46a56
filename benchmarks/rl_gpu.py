"""The full RL loop on GPUs through `rl` (issue 9, item 5): step times per async level.

    python benchmarks/rl_gpu.py --async-levels 0 1 [--max-steps 8] [--config benchmarks/rl_gpu.toml] --out DIR

Makes a random-init Qwen3-0.6B-shaped model with a locally built tokenizer of Qwen3's 151,936 tokens (``--vocab``;
0: the reverse-text example's small one; no hub access), then runs
`rl @ <config>` once per async level and reads metrics.jsonl: wall time between trainer steps (the loop's step time
once running), the trainer's compute / wait / publish times, the orchestrator's rollout time and wait for the
policy, the mismatch KL and rewards. Writes <out>/rl_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from prime_core.monitor import read_metrics

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


def summarize(metrics: Path, async_level: int = 0) -> dict:
    trainer: dict[int, dict] = {}
    orchestrator: dict[int, dict] = {}
    for record in read_metrics(metrics):
        target = trainer if record.process == "trainer" else orchestrator
        target[record.step] = {"time": record.time, **record.values}
    steps = sorted(trainer)
    walls = [trainer[b]["time"] - trainer[a]["time"] for a, b in zip(steps, steps[1:], strict=False)]
    steady = walls[1:] or walls  # the first interval still holds compile/warm-up

    def mean(rows: dict[int, dict], key: str) -> float | None:
        values = [r[key] for r in rows.values() if r.get(key) is not None]
        return statistics.mean(values) if values else None

    def steady_median(rows: dict[int, dict], key: str) -> float | None:
        values = [r[key] for s, r in rows.items() if s > async_level and r.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "steps": len(steps),
        "step_wall_s": walls,
        # issue 43's bound: a step should cost no more than the longer of its two halves, measured in the same run
        "trainer_compute_median_s": steady_median(trainer, "time/step"),
        "rollout_time_median_s": steady_median(orchestrator, "time/rollouts"),
        "step_wall_median_s": statistics.median(steady) if steady else None,
        "trainer_compute_mean_s": mean(trainer, "time/step"),
        "trainer_wait_mean_s": mean(trainer, "time/wait"),
        "trainer_publish_mean_s": mean(trainer, "time/publish"),
        "trainer_broadcast_send_mean_s": mean(trainer, "time/publish_send"),
        "trainer_tokens_per_s_mean": mean(trainer, "throughput/tokens_per_s"),
        "orchestrator_rollouts_mean_s": mean(orchestrator, "time/rollouts"),
        "orchestrator_wait_for_policy_mean_s": mean(orchestrator, "time/wait_for_policy"),
        # on-policy distillation (rl_gpu_distill.toml): wall time the teacher scored, beside time/rollouts
        "orchestrator_teacher_scoring_mean_s": mean(orchestrator, "time/teacher_scoring"),
        "rollout_tokens_per_s_mean": mean(orchestrator, "throughput/rollout_tokens_per_s"),
        # steps up to the async level start before any policy update: env-worker start-up and vLLM's first batches
        "steady_rollout_tokens_per_s_mean": mean(
            {s: r for s, r in orchestrator.items() if s > async_level}, "throughput/rollout_tokens_per_s"
        ),
        # a NaN step is logged as null (and the trainer stops after optim.max_skipped_steps of them)
        "max_mismatch_kl": max(
            (v for r in trainer.values() if (v := r.get("mismatch_kl/mean")) is not None), default=None
        ),
        "nan_steps": sum(1 for r in trainer.values() if "mismatch_kl/mean" in r and r["mismatch_kl/mean"] is None),
        "off_policy_lag_max": max((r.get("off_policy_lag/max", 0) for r in orchestrator.values()), default=None),
        "reward": [orchestrator[s].get("reward/mean") for s in sorted(orchestrator)],
        "timeline": timeline(trainer, orchestrator),
    }


def timeline(trainer: dict[int, dict], orchestrator: dict[int, dict]) -> list[dict]:
    """Per step, in seconds from the first trainer step's start: when its batch was dispatched (and on which
    served weights), its rollouts admitted, done and shipped, and when the trainer received it, finished computing
    and published the next weights. What one step waits on is then read off, not guessed."""
    starts = [r["time/received_at"] for r in trainer.values() if "time/received_at" in r]
    if not starts:
        return []
    t0 = min(starts)

    def at(value: float | None) -> float | None:
        return None if value is None else round(value - t0, 3)

    rows = []
    for step in sorted(set(trainer) | set(orchestrator)):
        o, t = orchestrator.get(step, {}), trainer.get(step, {})
        sent = o.get("time/dispatched_at")
        row = {"step": step, "weights_served": at(o.get("time/policy_served_at")), "dispatched": at(sent)}
        if sent is not None:
            for key in ("rollouts_admitted", "rollouts_first_done", "rollouts_half_done", "rollouts"):
                if o.get(f"time/{key}") is not None:
                    row[key.replace("rollouts_", "") if key != "rollouts" else "last_done"] = at(
                        sent + o[f"time/{key}"]
                    )
        row["shipped"] = at(o.get("time"))
        if "time/received_at" in t:
            row |= {"trainer_received": at(t["time/received_at"]),
                    "trainer_computed": at(t["time/received_at"] + t["time/step"]),
                    "trainer_published": at(t.get("time/published_at"))}  # fmt: skip
        rows.append(row)
    return rows


def verdict(entry: dict, reference_step_s: float = 4.5) -> dict:
    """Issue 43's loop targets: step <= 1.05x max(trainer compute, rollout time) and >= 1.3x faster than the 4.5 s
    one-GPU step measured before weights went through GPU memory (main 588197a, same config)."""
    step = entry.get("step_wall_median_s")
    halves = [entry.get("trainer_compute_median_s"), entry.get("rollout_time_median_s")]
    if not step or not all(halves):
        return {}
    over = step / max(halves)
    return {
        "step_over_bound": over,
        "step_over_bound_target_met": over <= 1.05,
        "speedup_over_reference": reference_step_s / step,
        "speedup_target_met": reference_step_s / step >= 1.3,
    }


def run_level(cmd: list[str], run: Path, async_level: int) -> dict:
    """Run ``rl`` once into ``run`` and summarize its metrics. The directory is emptied first: metrics a previous run
    left there must never pass for this one's (``rl`` clears its artifacts only once it gets that far). A run that
    fails reports how far it got, not step times."""
    shutil.rmtree(run, ignore_errors=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT)
    entry: dict = {
        "async_level": async_level,
        "returncode": proc.returncode,
        "wall_time_s": time.perf_counter() - start,
    }
    metrics = run / "metrics.jsonl"
    try:
        summary = summarize(metrics, async_level) if metrics.is_file() else {"steps": 0}
    except (ValueError, KeyError) as e:  # a process killed mid-write leaves a partial line
        summary = {"steps": None, "metrics_error": f"{type(e).__name__}: {e}"}
    if proc.returncode == 0:
        entry.update(summary)
    else:
        entry.update(steps=summary["steps"], error=f"rl exited with code {proc.returncode}: no step times recorded")
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--async-levels", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151936, help="tokenizer size (0: the reverse-text example's)")
    parser.add_argument("--config", default=str(ROOT / "benchmarks" / "rl_gpu.toml"))
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `rl` arguments")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--commit", default=os.environ.get("PRIME_COMMIT"))
    args = parser.parse_args()

    import torch
    from examples_gpu import full_vocab_tokenizer
    from provenance import tree_commit
    from weight_update_gpu import save_model

    work = Path(os.environ.get("PRIME_RL_GPU_DIR", "/tmp/prime-rl-gpu"))
    model_dir, tokenizer_dir = work / "model", ROOT / "examples" / "reverse_text" / "model"
    if args.vocab:
        tokenizer_dir = work / "tokenizer"
        full_vocab_tokenizer(args.vocab).save_pretrained(tokenizer_dir)
    model = save_model(model_dir, "0.6b", tokenizer_dir=str(tokenizer_dir))
    rl = os.environ.get("PRIME_LAUNCH_BIN_DIR", str(Path(sys.executable).parent)) + "/rl"
    report = {
        "benchmark": "rl_gpu_reverse_text", "config": args.config, "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(), "commit": tree_commit(args.commit), "model": {"shape": "Qwen3-0.6B", **model},
        "extra": args.extra, "results": [],
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{Path(args.config).stem}.json"  # rl_gpu.json for the default config
    for level in args.async_levels:
        run = work / f"async{level}"
        cmd = [rl, "@", args.config, "--model.name", str(model_dir), "--async-level", str(level),
               "--max-steps", str(args.max_steps), "--output-dir", str(run), "--overwrite", "--console", "logs",
               *args.extra]  # fmt: skip
        print("$", " ".join(cmd), flush=True)
        entry = run_level(cmd, run, level)
        report["results"].append(entry)
        entry.update(verdict(entry))
        print(json.dumps(entry), flush=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        for name in ("inference", "orchestrator", "trainer"):
            log = run / "logs" / f"{name}.log"
            if log.is_file():
                (args.out / f"{out.stem}_async{level}_{name}.log").write_text(log.read_text()[-200_000:])
        if (run / "metrics.jsonl").is_file():
            shutil.copy(run / "metrics.jsonl", args.out / f"{out.stem}_async{level}_metrics.jsonl")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
