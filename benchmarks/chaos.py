"""Randomized fault injection into a tiny `rl` run (reverse-text on CPU, no evals, two env workers).

    uv run python benchmarks/chaos.py --trials 40 [--seed S] [--name NAME]

Each trial starts `rl` (``--max-steps`` steps, batch 16, a checkpoint every step), waits a uniformly random time
within the length of an undisturbed run, and injects one fault into one randomly chosen part of it: SIGKILL,
SIGSTOP or SIGTERM of the inference server, the orchestrator, the trainer or an env worker; deleting or corrupting
the newest file one process hands another (rollouts, weights, progress); or, from the start, a small tmpfs as the
output directory (a full disk). It records how the run ended (exit code, the one line on stderr), the time from the
fault to the end against the documented bound (docs/liveness.md), tracebacks on rl's output, a hang (bound + margin
passed: the run is killed), whether metrics.jsonl and the checkpoints are consistent, and whether ``--resume``
then finishes every step with each trainer step logged once (a resume refused because the newest checkpoint's weights
changed after the trainer wrote them runs the ``prime-launch rewind`` its line names, then resumes again). Trials go to
benchmarks/results/chaos_<name>_trials.jsonl as they end, the summary to benchmarks/results/chaos_<name>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from provenance import tree_commit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.e2e.test_reverse_text import RL, _alive, _process_tree, rl_cmd  # noqa: E402

SLACK_S = 10.0
SHORT = ("--orchestrator.batch-size", "16", "--ckpt.interval", "1", "--liveness.slack-s", str(SLACK_S))
PROCS = ("inference", "orchestrator", "trainer", "env_worker")
FILES = ("rollouts", "weights", "progress")
# Documented bounds (docs/liveness.md) from the fault to rl's exit, on a loaded 2-core host.
BOUND_S = {"SIGKILL": 10.0, "SIGTERM": 10.0 + 5.0, "SIGSTOP": SLACK_S + 10.0}
HANG_MARGIN_S = 60.0
STARTUP_S = 60.0  # liveness.startup_s: a process stopped before its first heartbeat is named after it
RESULTS = ROOT / "benchmarks" / "results"


def pick_fault(rng: random.Random, weights: tuple[float, float, float] = (12, 6, 1)) -> tuple[str, str]:
    kind = rng.choices(["signal", "file", "disk"], weights=weights)[0]
    if kind == "signal":
        return rng.choice(["SIGKILL", "SIGSTOP", "SIGTERM"]), rng.choice(PROCS)
    if kind == "file":
        return rng.choice(["delete", "corrupt"]), rng.choice(FILES)
    return "disk_full", "output_dir"


def find_target(tree: dict[int, list[str]], target: str) -> int | None:
    if target == "env_worker":
        forked = {pid for pid, cmd in tree.items() if any("multiprocessing.forkserver" in c for c in cmd)}
        spawned = [pid for pid, cmd in tree.items() if any("spawn_main" in c for c in cmd)]
        for pid in sorted(spawned):
            try:
                ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if ppid in forked:
                return pid
        return None
    found = [pid for pid, cmd in tree.items() if any(Path(c).name == target for c in cmd[:2]) and "@" in cmd]
    return min(found) if found else None


def newest(out: Path, what: str) -> Path | None:
    base = out / what
    if not base.is_dir():
        return None
    if what == "progress":
        files = [p for p in base.glob("*.json") if p.is_file()]
    elif what == "rollouts":
        files = [p for p in base.glob("step_*/*") if p.is_file()]
    else:
        files = [p for p in base.glob("step_*/*.safetensors") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_mtime, default=None)


def tamper(path: Path, action: str) -> str:
    if action == "delete":
        path.unlink(missing_ok=True)
        return f"deleted {path}"
    size = path.stat().st_size
    with open(path, "r+b") as f:  # a deliberate in-place write: the corruption a bad disk or a stray writer makes
        f.seek(size // 2)
        f.write(os.urandom(min(64, max(1, size - size // 2))))
    return f"corrupted 64 bytes at {size // 2} of {path} ({size} bytes)"


def inject(proc: subprocess.Popen, out: Path, fault: str, target: str, deadline: float) -> tuple[str, float] | None:
    """Apply the fault once its target exists; returns (what was done, monotonic time) or None if the run ended."""
    while proc.poll() is None and time.monotonic() < deadline:
        if fault.startswith("SIG"):
            pid = find_target(_process_tree(proc.pid), target)
            if pid is not None:
                os.kill(pid, getattr(signal, fault))
                return f"{fault} pid {pid}", time.monotonic()
        else:
            path = newest(out, target)
            if path is not None:
                try:
                    return tamper(path, fault), time.monotonic()
                except OSError:
                    pass
        time.sleep(0.1)
    return None


def metrics_state(out: Path) -> dict:
    path = out / "metrics.jsonl"
    if not path.exists():
        return {"trainer_steps": [], "bad_lines": 0}
    steps, bad = [], 0
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if record.get("process") == "trainer" and record.get("values", {}).get("loss/mean") is not None:
            steps.append(record["step"])
    return {"trainer_steps": steps, "bad_lines": bad}


def ckpt_state(out: Path) -> dict:
    base = out / "checkpoints"
    stable = sorted(int(p.parent.name[5:]) for p in base.glob("step_*/STABLE")) if base.is_dir() else []
    weights = sorted(int(p.parent.name[5:]) for p in (out / "weights").glob("step_*/STABLE"))
    return {"checkpoints": stable, "weights": weights}


def run_until(proc: subprocess.Popen, limit: float) -> tuple[str, str, bool]:
    try:
        stdout, stderr = proc.communicate(timeout=limit)
        return stdout, stderr, False
    except subprocess.TimeoutExpired:
        for pid in _process_tree(proc.pid):
            if _alive(pid):
                os.kill(pid, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)  # SIGINT is ignored by a job a non-interactive shell put in the background
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        return stdout, stderr, True


def leftovers(tree: dict[int, list[str]]) -> list[str]:
    time.sleep(0.5)
    left = [" ".join(tree[pid])[:120] for pid in tree if _alive(pid)]
    for pid in tree:
        if _alive(pid):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
    return left


def last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1][:400] if lines else ""


def trial(n: int, rng: random.Random, base: Path, config: Path, args) -> dict:
    fault, target = pick_fault(rng, tuple(args.weights))
    out = base / f"trial_{n}"
    out.mkdir(parents=True)
    mounted = False
    if fault == "disk_full":
        size = rng.randint(25, 90)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}m", "tmpfs", str(out)], check=True)
        mounted, target = True, f"output_dir tmpfs {size} MB"
    moment = rng.uniform(1.0, args.run_s)
    rec = {"trial": n, "fault": fault, "target": target, "moment_s": round(moment, 1)}
    cmd = rl_cmd(out, "--max-steps", str(args.max_steps), *SHORT, config=config)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tree: dict[int, list[str]] = {}
    try:
        if fault != "disk_full":
            while time.monotonic() - start < moment and proc.poll() is None:
                tree.update(_process_tree(proc.pid))
                time.sleep(0.2)
            tree.update(_process_tree(proc.pid))
            done = inject(proc, out, fault, target, start + args.run_s * 2)
            rec["injected"] = done[0] if done else None
            rec["moment_s"] = round((done[1] if done else time.monotonic()) - start, 1)
        at = time.monotonic()
        limit = BOUND_S.get(fault, 0) + HANG_MARGIN_S if fault.startswith("SIG") and target != "env_worker" else 900
        stdout, stderr, hung = run_until(proc, limit)
        tree.update(_process_tree(proc.pid)) if proc.poll() is None else None
    finally:
        if proc.poll() is None:
            proc.kill()
    rec.update(took_s=round(time.monotonic() - at, 1), exit=proc.returncode, hang=hung,
               line=last_line(stderr), traceback="Traceback" in stdout + stderr,
               bound_s=BOUND_S.get(fault) if target in PROCS[:3] else None)  # fmt: skip
    rec["within_bound"] = rec["bound_s"] is None or rec["took_s"] <= rec["bound_s"]
    rec["stderr_lines"] = len([x for x in stderr.splitlines() if x.strip()])
    rec["left"] = leftovers(tree)
    rec["after"] = {**metrics_state(out), **ckpt_state(out)}
    if mounted:
        subprocess.run(["mount", "-o", "remount,size=600m", str(out)], check=False)
    if proc.returncode != 0:
        rec["resume"] = resume(out, config, args)
    if mounted:
        subprocess.run(["umount", "-l", str(out)], check=False)
    return rec


def resume(out: Path, config: Path, args) -> dict:
    cmd = rl_cmd(out, "--max-steps", str(args.max_steps), *SHORT, "--resume", config=config)
    start = time.monotonic()
    code, stdout, stderr = run_resume(cmd)
    # A checkpoint whose weights changed after the trainer wrote them is refused, naming the rewind to the one before:
    # do what the line says, once, and resume again.
    rewound = re.search(r"`(prime-launch rewind [^`]+)`", last_line(stderr) or "") if code == 2 else None
    if rewound:
        subprocess.run([str(RL.parent / "prime-launch"), *rewound.group(1).split()[1:]], cwd=ROOT, timeout=120)
        code, stdout, stderr = run_resume(cmd)
    steps = metrics_state(out)["trainer_steps"]
    return {"exit": code, "took_s": round(time.monotonic() - start, 1), "line": last_line(stderr),
            "rewound": rewound.group(1) if rewound else None,
            "from": next((x.strip() for x in stdout.splitlines() if "resuming from" in x), None),
            "traceback": "Traceback" in stdout + stderr, "trainer_steps": steps,
            "each_step_once": sorted(steps) == list(range(args.max_steps)),
            "final_weights": (out / "weights" / f"step_{args.max_steps}" / "STABLE").exists()}  # fmt: skip


def run_resume(cmd: list[str]) -> tuple[int | str, str, str]:
    try:
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        return result.returncode, result.stdout, result.stderr
    except subprocess.TimeoutExpired as e:
        return "hang", str(e.stdout or ""), str(e.stderr or "")


def classify(rec: dict) -> str:
    if rec.get("injected") is None and rec["fault"] != "disk_full":
        return "not injected (run ended first)" if rec["exit"] == 0 else "run failed before the fault"
    if rec["hang"]:
        return "HANG"
    if rec["traceback"] or (rec["exit"] not in (0, None) and rec["stderr_lines"] != 1):
        return "UNNAMED/TRACEBACK"
    if rec["left"]:
        return "PROCESSES LEFT"
    res = rec.get("resume")
    if res and not rec["after"]["checkpoints"] and res["exit"] == 2 and "no checkpoint" in res["line"]:
        return "named, nothing to resume (refused in one line)"
    if res and res["exit"] == 2 and "the run is finished" in res["line"] and res["each_step_once"]:
        return "named at exit after the last step (resume: finished)"
    if res and not (res["exit"] == 0 and res["each_step_once"] and res["final_weights"]):
        return "BAD RESUME"
    if "since it started" in rec["line"] and rec["took_s"] <= STARTUP_S + SLACK_S:
        return "named at startup_s (stopped before its first heartbeat), resumed"
    if not rec["within_bound"]:
        return "named, past bound"
    return "finished" if rec["exit"] == 0 else "named, resumed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--name", default="cpu")
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--run-s", type=float, default=90.0, help="length of an undisturbed run (the moment's range)")
    parser.add_argument("--base", default="/tmp/chaos")
    parser.add_argument("--stop-at", type=float, default=None, help="unix time after which no trial starts")
    parser.add_argument("--weights", type=float, nargs=3, default=[12, 6, 1], help="odds of signal, file, disk faults")
    parser.add_argument("--analyze", default=None, help="a trials .jsonl to classify and summarize again")
    args = parser.parse_args()
    if args.analyze:
        trials = [json.loads(x) for x in Path(args.analyze).read_text().splitlines() if x.strip()]
        for rec in trials:
            rec["outcome"] = classify(rec)
        return summarize(trials, args, trials[0]["seed"] if trials else None)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng, base = random.Random(seed), Path(args.base) / str(seed)
    base.mkdir(parents=True)
    from tests.faults.test_rl_faults import with_env_workers

    config = with_env_workers(base, 2)
    trials_path = RESULTS / f"chaos_{args.name}_trials.jsonl"
    trials = []
    for n in range(args.trials):
        if args.stop_at and time.time() > args.stop_at:
            break
        rec = trial(n, rng, base, config, args)
        rec["outcome"] = classify(rec)
        trials.append(rec)
        print(json.dumps(rec), flush=True)
        with open(trials_path, "a") as f:
            f.write(json.dumps({"seed": seed, **rec}) + "\n")
    summarize(trials, args, seed)


def summarize(trials: list[dict], args, seed: int | None) -> None:
    counts: dict[str, int] = {}
    for rec in trials:
        counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
    summary = {"commit": tree_commit(), "host": platform.node(), "cpus": os.cpu_count(), "seed": seed,
               "max_steps": args.max_steps, "slack_s": SLACK_S, "trials": len(trials), "outcomes": counts,
               "table": [{k: rec.get(k) for k in ("trial", "fault", "target", "moment_s", "exit", "took_s", "bound_s",
                                                  "outcome", "line")} for rec in trials]}  # fmt: skip
    (RESULTS / f"chaos_{args.name}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
