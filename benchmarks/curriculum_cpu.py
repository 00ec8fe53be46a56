"""Samples the difficulty curriculum needs to reach the plain run's final eval, on arithmetic with easy and hard problems.

    uv run python benchmarks/curriculum_cpu.py [--no-run]

Runs `rl @ examples/arithmetic/rl_mix.toml` (plain) and `rl @ rl_mix.toml @ curriculum.toml` (curriculum), or with
``--no-run`` reads their run directories, and writes benchmarks/results/curriculum_cpu.json: per run the eval curve
(eval at temperature 1.0 after each interval) against the rollouts drawn so far, the samples trained, and the
rollouts each run drew before its eval first reached the plain run's final and best evals. ``--also NAME=DIR`` adds
the curve of another run directory (a variant made by hand, described with ``--note``).
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
MIX, CURRICULUM = "examples/arithmetic/rl_mix.toml", "examples/arithmetic/curriculum.toml"
# name -> (config files, extra arguments, run directory)
RUNS = {
    "plain": ([MIX], [], "outputs/arithmetic-mix"),
    "curriculum": ([MIX, CURRICULUM], [], "outputs/arithmetic-curriculum"),
}
EVAL_KEY = "eval/arithmetic/t1/reward/mean"


def curve(run_dir: Path) -> tuple[list[dict], dict]:
    """[(step, rollouts drawn by the steps before it, eval)], and totals of the run."""
    rollouts, evals, trained = {}, {}, {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["process"] != "orchestrator":
            continue
        values, step = record["values"], record["step"]
        if EVAL_KEY in values:
            evals[step] = values[EVAL_KEY]
        if "samples/trained" in values:
            rollouts[step] = sum(v for k, v in values.items() if k.startswith("batch/"))
            trained[step] = values["samples/trained"]
    points = [
        {"step": s, "rollouts": sum(n for t, n in rollouts.items() if t < s), "eval_t1": evals[s]}
        for s in sorted(evals)
    ]
    return points, {"rollouts": sum(rollouts.values()), "trained_samples": sum(trained.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-run", action="store_true", help="only read the run directories")
    parser.add_argument("--port", type=int, default=8471)
    parser.add_argument("--commit", default=None, help="the commit the runs were made at (default: this checkout's)")
    parser.add_argument("--wall", action="append", default=[], help="NAME=SECONDS of a run made by hand (--no-run)")
    parser.add_argument("--also", action="append", default=[], help="NAME=RUN_DIR of another run to record")
    parser.add_argument("--note", action="append", default=[], help="a line describing the runs")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "curriculum_cpu.json")
    args = parser.parse_args()
    rl = Path(sys.executable).with_name("rl")
    walls = {name: float(sec) for name, sec in (w.split("=") for w in args.wall)}
    for name, (configs, extra, out) in RUNS.items():
        if args.no_run:
            continue
        cmd = [str(rl), *[a for c in configs for a in ("@", c)], *extra, "--output-dir", out]
        cmd += ["--inference.server.port", str(args.port)]
        cmd += ["--overwrite", "--console", "quiet"]
        print("$", " ".join(cmd), flush=True)
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True)
        walls[name] = round(time.perf_counter() - start, 1)
    results = {}
    dirs = {name: ROOT / out for name, (_, _, out) in RUNS.items()}
    dirs |= {name: Path(d) for name, d in (a.split("=", 1) for a in args.also)}
    for name, run_dir in dirs.items():
        points, totals = curve(run_dir)
        results[name] = {"evals": points, **totals, **({"wall_time_s": walls[name]} if name in walls else {})}
    for name, r in results.items():
        # Each run against its plain twin (the name with "curriculum" replaced by "plain").
        plain = results.get(name.replace("curriculum", "plain"), results["plain"])["evals"]
        final, best = plain[-1]["eval_t1"], max(p["eval_t1"] for p in plain)
        r["rollouts_to_plain_final_eval"] = next((p["rollouts"] for p in r["evals"] if p["eval_t1"] >= final), None)
        r["rollouts_to_plain_best_eval"] = next((p["rollouts"] for p in r["evals"] if p["eval_t1"] >= best), None)
    target = results["plain"]["evals"][-1]["eval_t1"]
    best = max(p["eval_t1"] for p in results["plain"]["evals"])
    report = {
        "benchmark": "curriculum_cpu_arithmetic_mix",
        "configs": {name: [*configs, *extra] for name, (configs, extra, _) in RUNS.items()},
        "model": "examples/arithmetic/model (Qwen3-shaped, 1.64M params, character vocabulary)",
        "vocab_size": json.loads((ROOT / "examples/arithmetic/model/config.json").read_text())["vocab_size"],
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)",
        "commit": tree_commit(args.commit),
        "baseline": "plain",
        "baseline_final_eval_t1": target,
        "baseline_best_eval_t1": best,
        "notes": args.note,
        "eval": "128 held-out problems, half hard (seed 4242), x 4 samples at temperature 1.0",
        "results": results,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    summary = {k: (v["rollouts_to_plain_best_eval"], v["trained_samples"], v["evals"][-1]) for k, v in results.items()}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
