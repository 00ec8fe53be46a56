"""On-policy distillation against plain RL on reverse-text, CPU: samples each needs from the same start model.

    uv run python benchmarks/distill_cpu.py [--no-run]

Runs `rl @ examples/reverse_text/rl.toml` (plain RL, 60 steps; its final weights are the teacher shipped in
examples/distill_reverse_text/teacher) and `rl @ examples/distill_reverse_text/rl.toml` (distillation from that
teacher, which rl serves from [teacher]), both evaluating every ``--interval`` steps, or with ``--no-run`` reads their
run directories. Writes benchmarks/results/distill_cpu.json: each run's eval curve (64 held-out prompts x 4 samples at
temperature 1.0, and greedily) against the samples (rollouts) drawn so far, the teacher's eval (RL's final), the samples
distillation took to come within ``--tolerance`` of the teacher at temperature 1.0, the samples RL took to reach its
own final eval, and both runs at equal samples.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from provenance import tree_commit

ROOT = Path(__file__).resolve().parents[1]
# name -> (config, run directory, steps)
RUNS = {
    "rl": ("examples/reverse_text/rl.toml", "outputs/reverse-text-rl", 60),
    "distill": ("examples/distill_reverse_text/rl.toml", "outputs/distill-reverse-text", 40),
}
T1, T0 = "eval/reverse-text/t1/reward/mean", "eval/reverse-text/t0/reward/mean"


def curve(run_dir: Path) -> tuple[list[dict], dict]:
    """[{step, samples drawn by the steps before it, eval at T=1, greedy}], and the run's totals. A sample is a
    rollout drawn (the inference spent), trained or not: RL drops groups whose rewards are all equal."""
    samples, trained, evals, teacher_s, rollout_s, kl = {}, {}, {}, [], [], {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        values, step = record["values"], record["step"]
        if record["process"] != "orchestrator":
            continue
        if T1 in values:
            evals[step] = (values[T1], values[T0])
        if "samples/trained" in values:
            samples[step] = sum(v for k, v in values.items() if k.startswith("batch/"))
            trained[step] = values["samples/trained"]
            rollout_s.append(values["time/rollouts"])
            teacher_s.append(values.get("time/teacher_scoring", 0.0))
            if "distill/reverse-text/reverse_kl" in values:
                kl[step] = values["distill/reverse-text/reverse_kl"]
    points = [
        {"step": s, "samples": sum(n for t, n in samples.items() if t < s), "eval_t1": e[0], "eval_t0": e[1]}
        for s, e in sorted(evals.items())
    ]
    totals = {"samples": sum(samples.values()), "trained_samples": sum(trained.values()), "steps": len(samples)}
    totals["time_rollouts_s"] = round(sum(rollout_s), 1)
    if kl:
        totals["time_teacher_scoring_s"] = round(sum(teacher_s), 1)
        totals["reverse_kl"] = {str(s): round(v, 4) for s, v in sorted(kl.items()) if s % 5 == 0 or s == max(kl)}
    return points, totals


def at(results: dict, samples: int) -> dict[str, float]:
    """Each run's evals (T=1, greedy) after ``samples`` samples."""
    out = {}
    for name, r in results.items():
        point = next(p for p in r["evals"] if p["samples"] == samples)
        out |= {f"{name}_t1": round(point["eval_t1"], 4), f"{name}_t0": round(point["eval_t0"], 4)}
    return out


def first(points: list[dict], at_least: float) -> dict | None:
    return next((p for p in points if p["eval_t1"] >= at_least), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-run", action="store_true", help="only read the run directories")
    parser.add_argument("--interval", type=int, default=5, help="eval interval of the runs (steps)")
    parser.add_argument("--tolerance", type=float, default=0.05)
    parser.add_argument("--ports", type=int, nargs=2, default=(8631, 8633))
    parser.add_argument("--commit", default=None, help="the commit the runs were made at (default: this checkout's)")
    parser.add_argument("--wall", action="append", default=[], help="NAME=SECONDS of a run made by hand (--no-run)")
    parser.add_argument("--note", action="append", default=[], help="a line describing the runs")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "distill_cpu.json")
    args = parser.parse_args()
    rl = Path(sys.executable).with_name("rl")
    walls = {name: float(sec) for name, sec in (w.split("=") for w in args.wall)}
    for name, (config, out, steps) in RUNS.items():
        if args.no_run:
            continue
        cmd = [str(rl), "@", config, "--output-dir", out, "--max-steps", str(steps), "--overwrite"]
        cmd += ["--orchestrator.eval.interval", str(args.interval), "--console", "quiet"]
        cmd += ["--inference.server.port", str(args.ports[0])]
        cmd += ["--teacher.port", str(args.ports[1])] if name == "distill" else []
        print("$", " ".join(cmd), flush=True)
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True)
        walls[name] = round(time.perf_counter() - start, 1)
    results = {}
    for name, (config, out, _) in RUNS.items():
        points, totals = curve(ROOT / out)
        results[name] = {"config": config, "evals": points, **totals}
        if name in walls:
            results[name]["wall_time_s"] = walls[name]
    rl_points, distill_points = results["rl"]["evals"], results["distill"]["evals"]
    teacher = rl_points[-1]
    target = teacher["eval_t1"] - args.tolerance
    rl_final = first(rl_points, teacher["eval_t1"])
    reached = first(distill_points, target)
    same = {p["samples"] for p in rl_points} & {p["samples"] for p in distill_points}
    report = {
        "benchmark": "distill_cpu_reverse_text",
        "model": "student examples/reverse_text/model (Qwen3-shaped, 1.64M params, character vocabulary)",
        "teacher": "examples/distill_reverse_text/teacher = the weights of the rl run's final step",
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)",
        "commit": tree_commit(args.commit),
        "eval": "64 held-out prompts (seed 4242) x 4 samples at temperature 1.0 (t1), and greedily (t0)",
        "notes": args.note,
        "teacher_eval": {"t1": teacher["eval_t1"], "t0": teacher["eval_t0"]},
        "student_eval_before": {"t1": distill_points[0]["eval_t1"], "t0": distill_points[0]["eval_t0"]},
        "distill_target_t1": round(target, 4),
        "distill_samples_to_target": reached["samples"] if reached else None,
        "rl_samples_to_its_final_eval": rl_final["samples"] if rl_final else None,
        "at_equal_samples": [{"samples": n, **at(results, n)} for n in sorted(same)],
        "accepted": bool(reached and rl_final and reached["samples"] < rl_final["samples"]),
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    keys = ("teacher_eval", "distill_target_t1", "distill_samples_to_target", "rl_samples_to_its_final_eval")
    print(json.dumps({k: report[k] for k in (*keys, "at_equal_samples", "accepted")}, indent=2))


if __name__ == "__main__":
    main()
