"""Resident-memory growth per safetensors read, per read path, each in a fresh process.

Writes one file of ``--tensors`` small tensors (float32, bfloat16, float16, int64: a tiny model's set) once, then
reads it ``--loads`` times through one read path, after ``--warmup`` reads. RSS comes from /proc/self/statm after
``gc.collect()`` and ``malloc_trim(0)``, so what glibc merely keeps for reuse is handed back and what stays is held.

    uv run python benchmarks/safetensors_read_mem.py [--tensors 300] [--loads 2000] [--label NAME]

Adds a record to ``benchmarks/results/safetensors_read_mem.json``: per path, bytes of RSS growth per read and per
tensor read, and the median seconds of one read.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from provenance import add_record, tree_commit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "safetensors_read_mem.json"
PATHS = (
    "load_file",
    "safe_open_get_tensor",
    "safe_open_get_slice",
    "load_bytes",
    "numpy_load_bytes",
    "read_safetensors",
)


def rss() -> int:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def write_file(path: Path, n: int, *, numpy: bool = False) -> None:
    """``numpy``: float32 in bfloat16's place (numpy has no bfloat16; the micro-batch reader's numpy path)."""
    import torch
    from safetensors.torch import save_file

    dtypes = (torch.float32, torch.float32 if numpy else torch.bfloat16, torch.float16, torch.int64)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(n):
        dtype = dtypes[i % len(dtypes)]
        t = torch.randn(16, 8 + i % 5, generator=g)
        tensors[f"model.layers.{i // 10}.w{i % 10}.weight"] = (t * 100).to(dtype)
    save_file(tensors, str(path), metadata={"format": "pt"})


def reader(name: str):
    import torch
    from safetensors import safe_open
    from safetensors.numpy import load as np_load
    from safetensors.torch import load, load_file

    def via_open(get):
        def read(p):
            with safe_open(p, framework="pt") as f:
                return {k: get(f, k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)

        return read

    def read_bytes(p, fn):
        with open(p, "rb") as f:
            return fn(f.read())

    if name == "read_safetensors":
        from prime_models.loading import read_safetensors

        return lambda p: read_safetensors(p, torch.device("cpu"))
    return {
        "load_file": lambda p: load_file(p),
        "safe_open_get_tensor": via_open(lambda f, k: f.get_tensor(k)),
        "safe_open_get_slice": via_open(lambda f, k: f.get_slice(k)[:]),
        "load_bytes": lambda p: read_bytes(p, load),
        "numpy_load_bytes": lambda p: read_bytes(p, np_load),
    }[name]


def measure(name: str, path: str, loads: int, warmup: int) -> dict:
    read = reader(name)
    for _ in range(warmup):
        read(path)
    before = rss()
    times = []
    for _ in range(loads):
        start = time.perf_counter()
        state = read(path)
        times.append(time.perf_counter() - start)
        del state
    grown = rss() - before
    return {"rss_growth_bytes": grown, "bytes_per_load": grown / loads, "median_load_s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=300)
    ap.add_argument("--loads", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--label", help="record name (default: the commit)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--file", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.file, args.loads, args.warmup)))
        return
    import safetensors
    import torch

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "model.safetensors"
        write_file(file, args.tensors)
        write_file(Path(tmp) / "numpy.safetensors", args.tensors, numpy=True)
        for name in args.paths.split(","):
            read = Path(tmp) / "numpy.safetensors" if name.startswith("numpy") else file
            cmd = [sys.executable, __file__, "--child", name, "--file", str(read), "--loads", str(args.loads),
                   "--warmup", str(args.warmup)]  # fmt: skip
            out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            out["bytes_per_tensor_read"] = out["bytes_per_load"] / args.tensors
            results[name] = out
            print(f"{name:22s} {out['bytes_per_load']:9.1f} B/load {out['bytes_per_tensor_read']:7.2f} B/tensor "
                  f"{out['median_load_s'] * 1e3:7.3f} ms/load", flush=True)  # fmt: skip
    record = {
        "commit": tree_commit(), "host": platform.node(), "tensors": args.tensors, "loads": args.loads, "warmup": args.warmup,
        "safetensors": safetensors.__version__, "torch": torch.__version__, "python": platform.python_version(),
        "results": results,
    }  # fmt: skip
    add_record(RESULTS, args.label, record)


if __name__ == "__main__":
    main()
