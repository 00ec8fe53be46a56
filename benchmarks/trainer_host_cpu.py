"""The trainer's fixed host cost per micro-batch, on CPU: rows per forward 1 vs 8 at equal tokens (issue 43).

A tiny decoder with Qwen3-0.6B's 28 layers but tiny widths keeps compute small, so what one more micro-batch costs
is what the host does per forward/backward: Python, dispatch, hooks, and the device reads that on a GPU would stall
the stream (``aten::_local_scalar_dense`` is every ``.item()``/``bool()``/``tolist()``; ``nonzero``, ``unique`` and
boolean indexing read a size back). The RL step runs through the trainer's own ``forward_backward`` on the one-rank
path of a GPU run (a working copy over fp32 masters, `prime_models.parallel.mixed_precision`).

    uv run python benchmarks/trainer_host_cpu.py [--steps 5] [--dtype float32] [--compile-layers] [--label NAME]

Adds a record to ``benchmarks/results/trainer_host_cpu.json``: per case the forward/backward's median CPU time
(process time: other processes on a shared host do not count); the host cost of one more micro-batch,
(t[1 row x 8] - t[8 rows x 1]) / 7; the ops per micro-batch that read the device back; and the Python functions
called most per micro-batch (cProfile).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from prime_core.config import load_config
from prime_core.config.trainer import TrainerConfig
from provenance import add_record, tree_commit

ROOT = Path(__file__).resolve().parents[1]
SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::_unique2", "aten::unique_dim", "aten::masked_select")
CONFIG = {
    "model_type": "qwen3", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 28,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
}  # fmt: skip


def components(model_dir: Path, rows_per_forward: int, args: argparse.Namespace):
    """The trainer's setup on CPU with fake data of 8 rows a step, then the GPU run's one-rank bf16 path."""
    from prime_models.parallel.mixed_precision import apply_mixed_precision
    from prime_trainer import common

    argv = ["--model.name", str(model_dir), "--device", "cpu", "--bench", "--seq-len", str(args.row_len),
            "--data.fake.batch-size", "8", "--data.fake.micro-batch-size", str(rows_per_forward),
            "--data.fake.variable-lengths", "true", "--output-dir", str(model_dir / "out")]  # fmt: skip
    if args.compile_layers:
        from prime_models.parallel import compile as compile_module

        compile_module.COMPILE_BACKEND = args.compile_backend
        argv += ["--parallel.compile-layers", "true"]
    c = common.setup(load_config(TrainerConfig, argv), "trainer")
    # The GPU run's path (a working copy over fp32 masters, its hooks and copies), in fp32 by default: CPU kernels in
    # bf16 are slow enough to hide the host's own work.
    apply_mixed_precision(c.model, getattr(torch, args.dtype))
    return c


def run_step(c, step: int, around=contextlib.nullcontext) -> float:
    """One step's forward/backward of every micro-batch (the optimizer step, once a step whatever the micro-batches,
    runs outside the timing); returns its seconds."""
    from prime_trainer.common import optimizer_step
    from prime_trainer.rl.loss import build_objective
    from prime_trainer.rl.train import forward_backward, next_micro_batches

    meta, micro_batches = next_micro_batches(c, None, step, c.config.seed)
    objective = build_objective(c.config.loss)
    with around():
        t0 = time.process_time()  # CPU time: other processes on a shared host do not count
        forward_backward(c, objective, micro_batches, meta.temperature)
        elapsed = time.process_time() - t0
    optimizer_step(c, step)
    return elapsed


def sync_ops(c) -> dict[str, int]:
    """Device read-backs in one step's forward/backward (torch.profiler counts; on CPU they cost nothing, on a GPU
    each waits for the stream), and all aten ops."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    run_step(c, 100, lambda: prof)
    counts = {e.key: e.count for e in prof.key_averages() if e.key in SYNC_OPS}
    # Every aten op the host dispatches (on a GPU about one kernel launch each), nested calls included.
    counts["aten ops"] = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
    return counts


def python_calls(c) -> dict[str, int]:
    """Python function calls in one step's forward/backward, by function (cProfile)."""
    prof = cProfile.Profile()
    run_step(c, 101, lambda: prof)
    stats = pstats.Stats(prof).stats
    return {f"{Path(f).name}:{line}:{name}": calls for (f, line, name), (_, calls, *_rest) in stats.items()}


def case(model_dir: Path, rows_per_forward: int, args: argparse.Namespace) -> dict:
    c = components(model_dir, rows_per_forward, args)
    run_step(c, 0)  # warmup (memory plan, lazy inits)
    times = [run_step(c, s) for s in range(1, args.steps + 1)]
    return {"rows_per_forward": rows_per_forward, "micro_batches": 8 // rows_per_forward,
            "step_s_median": statistics.median(times), "step_s": times, "sync_ops": sync_ops(c),
            "python_calls": python_calls(c)}  # fmt: skip


def per_micro_batch(one: dict[str, int], eight: dict[str, int], top: int = 0) -> dict[str, float]:
    """What one more micro-batch adds: (count at 8 micro-batches - count at 1) / 7, largest first."""
    extra = {k: (one.get(k, 0) - eight.get(k, 0)) / 7 for k in one.keys() | eight.keys()}
    ranked = sorted(((k, v) for k, v in extra.items() if v > 0), key=lambda kv: -kv[1])
    return dict(ranked[:top] if top else ranked)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--row-len", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the working copy's dtype")
    p.add_argument("--compile-layers", action="store_true", help="parallel.compile_layers (torch.compile per layer)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend of --compile-layers")
    p.add_argument("--label", default="")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "trainer_host_cpu.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(CONFIG))
        cases = {f"rows{r}": case(model_dir, r, args) for r in (8, 1)}
    one, eight = cases["rows1"], cases["rows8"]
    calls = per_micro_batch(one.pop("python_calls"), eight.pop("python_calls"))
    record = {"benchmark": "trainer_host_cpu", "commit": tree_commit(), "host": platform.node(),
              "python": sys.version.split()[0], "torch": torch.__version__, "label": args.label,
              "model": "Qwen3 shape, 28 layers, hidden 64, vocab 512 (random init)", "row_len": args.row_len, "dtype": args.dtype,
              "compile_layers": args.compile_backend if args.compile_layers else False,
              "host_s_per_micro_batch": (one["step_s_median"] - eight["step_s_median"]) / 7,
              "sync_ops_per_micro_batch": per_micro_batch(one["sync_ops"], eight["sync_ops"]),
              "python_calls_per_micro_batch": sum(calls.values()), "top_python_calls_per_micro_batch": dict(list(calls.items())[:20]),
              "cases": cases}  # fmt: skip
    add_record(args.out, args.label, record)
    print(json.dumps({k: v for k, v in record.items() if k != "cases"}, indent=1))
    for name, c in cases.items():
        print(name, f"{c['step_s_median'] * 1e3:.1f} ms", c["sync_ops"])


if __name__ == "__main__":
    main()
