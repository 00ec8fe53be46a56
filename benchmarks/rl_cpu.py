"""Wall time of the reverse-text RL example on this machine, for each async level.

    uv run python benchmarks/rl_cpu.py --async-levels 0 1 [--max-steps 20]

Runs `rl @ examples/reverse_text/rl.toml` once per async level (fresh output dir each), then writes
benchmarks/results/rl_cpu_async_<host>.json with the wall time, the per-step times and the reward summary.
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


def summarize(metrics: Path) -> dict:
    rewards, kls, step_times = {}, [], []
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        values = record["values"]
        if record["process"] == "orchestrator" and values.get("reward/mean") is not None:
            rewards[record["step"]] = values["reward/mean"]
        if record["process"] == "trainer":
            if values.get("mismatch_kl/mean") is not None:
                kls.append(values["mismatch_kl/mean"])
            if values.get("time/step") is not None:
                step_times.append(values["time/step"])
    ordered = [rewards[s] for s in sorted(rewards)]
    return {
        "reward_first3": sum(ordered[:3]) / max(len(ordered[:3]), 1),
        "reward_last3": sum(ordered[-3:]) / max(len(ordered[-3:]), 1),
        "max_mismatch_kl": max(kls, default=None),
        "trainer_step_time_mean_s": sum(step_times) / max(len(step_times), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--async-levels", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--config", default="examples/reverse_text/rl.toml")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rl = Path(sys.executable).with_name("rl")
    results = []
    for level in args.async_levels:
        out_dir = ROOT / "outputs" / f"bench-rl-async{level}"
        cmd = [str(rl), "@", args.config, "--async-level", str(level), "--output-dir", str(out_dir), "--overwrite"]
        cmd += ["--console", "quiet"]
        if args.max_steps:
            cmd += ["--max-steps", str(args.max_steps)]
        print("$", " ".join(cmd), flush=True)
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True)
        wall = time.perf_counter() - start
        entry = {"async_level": level, "wall_time_s": round(wall, 1), **summarize(out_dir / "metrics.jsonl")}
        print(json.dumps(entry), flush=True)
        results.append(entry)
    report = {
        "benchmark": "rl_cpu_reverse_text",
        "config": args.config,
        "model": "examples/reverse_text/model (Qwen3-shaped, 1.6M params)",
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "commit": tree_commit(os.environ.get("PRIME_COMMIT")),
        "results": results,
    }
    out = args.out or ROOT / "benchmarks" / "results" / f"rl_cpu_async_{platform.node() or 'host'}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
