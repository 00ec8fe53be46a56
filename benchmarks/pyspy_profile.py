"""Where a benchmark's host time goes: py-spy samples of a process tree while a piece of work runs, summarized.

Used by the GPU benchmarks (the host has no perf); py-spy is a wheel (``pip install py-spy``) and needs ptrace.
"""

from __future__ import annotations

import collections
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def profile_during(pid: int, seconds: float, out_dir: Path, work: Callable[[], dict], name: str = "profile") -> dict:
    """Sample ``pid`` and its children (non-blocking, 100 Hz) for ``seconds`` while ``work()`` runs; the raw
    collapsed stacks go to ``out_dir/<name>.txt``, the summary (and ``work()``'s result) is returned."""
    raw = out_dir / f"{name}.txt"
    cmd = ["py-spy", "record", "--pid", str(pid), "--subprocesses", "--nonblocking", "--format", "raw",
           "--rate", "100", "--duration", str(int(seconds)), "--output", str(raw)]  # fmt: skip
    try:
        spy = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except FileNotFoundError:
        return {"error": "py-spy is not installed (pip install py-spy)"}
    time.sleep(1.0)  # attached before the work starts
    result = work()
    log = spy.communicate(timeout=seconds + 120)[0]
    if spy.returncode != 0 or not raw.exists():
        return {"error": f"py-spy rc={spy.returncode}: {log[-2000:]}", "work": result}
    return {"work": result, "seconds": seconds, "raw_file": raw.name, "processes": summarize(raw)}


def summarize(raw: Path, top: int = 40) -> dict:
    """Per process: samples, and the frames with the most own (leaf) and total samples (line numbers dropped).
    py-spy counts a thread only while it runs or spins: a process's samples over 100 x seconds is its busy share."""
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    total: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    samples: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        procs = [f for f in frames if f.startswith("process ")]  # a child's stack sits under its parent's frame
        proc = procs[-1][:120] if procs else "main"
        frames = [f.split(":")[0] + ")" if "(" in f else f for f in frames if not f.startswith(("process ", "thread "))]
        samples[proc] += int(count)
        if frames:
            own[proc][frames[-1]] += int(count)
        for f in set(frames):
            total[proc][f] += int(count)
    return {
        p: {"samples": n, "own": own[p].most_common(top), "total": total[p].most_common(top)}
        for p, n in samples.most_common()
    }
