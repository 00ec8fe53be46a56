"""Resource growth of a long RL run: fds, threads, children and RSS of every process, and disk, per step.

    uv run python benchmarks/soak.py --config examples/code/rl.toml --max-steps 200 [--stop-after-s S] [-- rl flags]
    uv run python benchmarks/soak.py --analyze outputs/soak_<name>_samples.jsonl [--name NAME]

Starts `rl` with the given config and flags, and every --every seconds samples, for the launcher and each of its
descendants, /proc/<pid>/{fd,task,status} (VmRSS), plus the sizes and file counts of the output directory, /tmp and
/dev/shm, keyed by the trainer's last logged step. At the end it fits a line per (process, quantity) on the first
and the second half of the steps and writes benchmarks/results/soak_<name>_<host>.json: the per-step slopes early
and late (samples go to outputs/soak_<name>_samples.jsonl as they are taken; --analyze fits them again, e.g. after
the sampler was stopped). A quantity whose late slope is not ~0 grows with the step count: a leak for a run of
thousands of steps. /tmp and /dev/shm are counted whole: on a shared machine other jobs' files count too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

from provenance import tree_commit

ROOT = Path(__file__).resolve().parents[1]


def children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            out += [int(c) for c in text.split()]
    except OSError:
        pass
    return out


def descendants(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        todo += children(p)
    return seen


def proc_sample(pid: int) -> dict | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    rss_kb = int(fields.get("VmRSS", "0 kB").split()[0])
    state = fields.get("State", "?").split()[0]
    return {
        "cmd": " ".join(c.decode(errors="replace") for c in cmd[:5])[:300],
        "fds": fds,
        "threads": threads,
        "rss_mb": rss_kb / 1024,
        "children": len(children(pid)),
        "zombie": state == "Z",
    }


def role(cmd: str) -> str:
    """A process's part in the run, from its command line (processes of one part are summed)."""
    parts = [
        ("/trainer ", "trainer"),
        ("/orchestrator ", "orchestrator"),
        ("/inference ", "inference"),
        ("/rl ", "rl"),
        ("forkserver", "env_workers"),  # the forkserver and the env workers it forks
        ("resource_tracker", "resource_tracker"),
        ("-I -S", "sandbox_zygotes"),
        ("PRIME_LAUNCH_TAG", "reaper"),
    ]
    for needle, name in parts:
        if needle in cmd:
            return name
    return "other"


def tree_size(path: Path) -> tuple[int, int]:
    total, count = 0, 0
    for root, _dirs, files in os.walk(path, onerror=lambda e: None):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
                count += 1
            except OSError:
                pass
    return total, count


def last_step(metrics: Path) -> int:
    step = -1
    try:
        with metrics.open() as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("process", "").startswith("trainer") and isinstance(rec.get("step"), int):
                    step = max(step, rec["step"])
    except OSError:
        pass
    return step


def slope(points: list[tuple[float, float]]) -> float | None:
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    var = sum((p[0] - mx) ** 2 for p in points)
    return None if var == 0 else sum((p[0] - mx) * (p[1] - my) for p in points) / var


def analyze(samples: list[dict]) -> dict:
    """Per (role, quantity): the first and last value and the per-step slopes over the first and second half."""
    # Series per (role, quantity): a role's processes summed, so a leak of child processes shows as well.
    series: dict[str, list[tuple[float, float]]] = {}
    # Samples taken while the processes stop (fewer of them than before) are the run's end, not its steady state.
    samples = list(samples)
    while len(samples) > 1 and len(samples[-1]["procs"]) < len(samples[-2]["procs"]):
        samples.pop()
    for s in samples:
        if s["step"] < 1:
            continue
        agg: dict[str, float] = {"nprocs": len(s["procs"]), "zombies": sum(p["zombie"] for p in s["procs"].values())}
        for p in s["procs"].values():
            for q in ("fds", "threads", "rss_mb", "children"):
                agg[f"{role(p['cmd'])}.{q}"] = agg.get(f"{role(p['cmd'])}.{q}", 0) + p[q]
            agg[f"{role(p['cmd'])}.count"] = agg.get(f"{role(p['cmd'])}.count", 0) + 1
        agg.update({f"disk.{k}": v for k, v in s["disk"].items()})
        for k, v in agg.items():
            series.setdefault(k, []).append((s["step"], v))
    slopes = {}
    for k, pts in sorted(series.items()):
        mid = (pts[0][0] + pts[-1][0]) / 2
        early = [p for p in pts if p[0] <= mid]
        late = [p for p in pts if p[0] > mid]
        slopes[k] = {
            "first": pts[0][1],
            "last": pts[-1][1],
            "slope_early_per_step": slope(early),
            "slope_late_per_step": slope(late),
        }
    return slopes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="examples/code/rl.toml")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--every", type=float, default=5.0)
    parser.add_argument("--name", default=None)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "outputs" / "soak")
    parser.add_argument("--stop-after-s", type=float, default=None, help="SIGTERM the run after this long")
    parser.add_argument("--analyze", type=Path, default=None, help="print the slopes of a samples file and exit")
    parser.add_argument("extra", nargs="*")
    args = parser.parse_args()
    if args.analyze is not None:
        samples = [json.loads(line) for line in args.analyze.read_text().splitlines() if line.strip()]
        print(json.dumps(analyze(samples), indent=1))
        if args.name:  # the result file of a run the sampler did not see end (stopped by hand)
            write_result(args.name, f"(samples {args.analyze})", None, samples)
        return
    name = args.name or Path(args.config).parent.name
    rl = Path(sys.executable).with_name("rl")
    cmd = [str(rl), "@", args.config, "--output-dir", str(args.out_dir), "--overwrite", "--console", "quiet"]
    cmd += ["--max-steps", str(args.max_steps), *args.extra]
    tmp_before = {p.name for p in Path("/tmp").iterdir()}
    shm_before = {p.name for p in Path("/dev/shm").iterdir()}
    proc = subprocess.Popen(cmd, cwd=ROOT)
    samples = []
    raw = ROOT / "outputs" / f"soak_{name}_samples.jsonl"
    raw.unlink(missing_ok=True)
    start = time.time()
    while proc.poll() is None:
        time.sleep(args.every)
        if args.stop_after_s is not None and time.time() - start > args.stop_after_s:
            proc.send_signal(signal.SIGTERM)  # a background job ignores SIGINT
            proc.wait()
            break
        step = last_step(args.out_dir / "metrics.jsonl")
        procs = {}
        for pid in descendants(proc.pid):
            s = proc_sample(pid)
            if s is not None:
                s["role"] = role(s["cmd"])
                procs[str(pid)] = s
        out_bytes, out_files = tree_size(args.out_dir)
        new_tmp = [Path("/tmp") / n for n in os.listdir("/tmp") if n not in tmp_before]
        new_shm = [Path("/dev/shm") / n for n in os.listdir("/dev/shm") if n not in shm_before]
        disk = {"out_mb": out_bytes / 2**20, "out_files": out_files, "tmp_new": len(new_tmp), "shm_new": len(new_shm)}
        disk["shm_new_mb"] = (
            sum(tree_size(p)[0] if p.is_dir() else p.lstat().st_size for p in new_shm if p.exists()) / 2**20
        )
        samples.append({"t": time.time(), "step": step, "procs": procs, "disk": disk})
        with raw.open("a") as f:
            f.write(json.dumps(samples[-1]) + "\n")
        top = {s["role"]: (s["fds"], s["threads"], round(s["rss_mb"])) for s in procs.values()}
        print(f"step {step} nprocs {len(procs)} {disk} {top}", flush=True)
    rc = proc.returncode
    write_result(name, " ".join(cmd[1:]), rc, samples)


def write_result(name: str, command: str, rc: int | None, samples: list[dict]) -> None:
    result = {
        "commit": tree_commit(),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()} {os.cpu_count()} cpus",
        "command": command,
        "rc": rc,
        "steps": max((s["step"] for s in samples), default=-1),
        "slopes": analyze(samples),
    }
    out = ROOT / "benchmarks" / "results" / f"soak_{name}_{platform.node()}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
