"""The RL loop with heavy-tailed response lengths (issue 42, item 4): today's loop at its best hand-tuned concurrency
against continuous rollouts (in-flight weight updates, a staleness bound, adaptive concurrency), in one call.

    CUDA_VISIBLE_DEVICES=0 python benchmarks/rl_longtail_gpu.py --out $OUT [--sweep 256 512] [--max-steps 10]
        [--arms fixed_512 continuous_k2]   # a subset; arms of earlier calls with the same settings are kept
    uv run python benchmarks/rl_longtail_gpu.py --smoke     # CPU: tiny model, torch engine, 5 steps per arm

Model and tokenizer as benchmarks/rl_gpu.py makes them: a random-init Qwen3-0.6B shape with a locally built tokenizer
of Qwen3's 151,936 tokens (``--vocab``). The environment is synthetic (benchmarks/envs/longtail_text): each rollout
asks for an exact length (``max_tokens`` with ``ignore_eos``), with probability ``--tail-fraction`` ``--tail-factor``
times ``--median-tokens``, otherwise uniform around the median. Each arm is one `rl` run (fresh output directory):

- ``fixed_<N>`` and ``fixed_<N>_async<A>`` for N in ``--sweep``: today's loop at async_level 1 and A, weight updates
  that drain running requests (``inference.weight_update = "drain"``), ``client.concurrency = "fixed"``,
  ``max_concurrent`` N. The best of them by rollout tok/s is "today's best";
- ``mean_length``: every response at the distribution's mean length, N = batch size, async_level 0 (each step's batch
  generated alone); its rollout time per step is the reference "rollout time of the mean-length batch";
- ``continuous_k<K>[_async<A>]`` for K in 1, 2: ``orchestrator.max_off_policy_steps = K`` at async_level 1 (groups are
  dispatched at most one batch ahead, so with K = 2 every group has a step of slack before the bound cuts it), or at
  async_level A with the suffix (``continuous_k2_async2``: up to three batches of groups in flight, larger decode
  batches; its fair peer is ``fixed_<N>_async2``; ``continuous_k4_async3`` is what benchmarks/continuous_sim.py
  finds the long tail needs),
- any arm with ``_cg<N>`` appended: vLLM captures CUDA graphs up to N rollouts a decode step, e.g.
  ``continuous_k4_async3_cg512`` (vLLM's own default; prime's ``inference.vllm.max_cudagraph_capture_size`` follows
  ``max_num_seqs``, 1,024, the ceiling adaptive concurrency grows to);
  ``inference.weight_update = "in_flight"``, adaptive concurrency (no ``max_concurrent`` in the config).

Weights reach inference by NCCL where trainer and vLLM get a GPU each (two or more GPUs visible; ``--weights``), else
by `rl`'s own choice (CUDA IPC on one shared GPU).

Per arm, over the steady steps (from ``--warmup``, 2, on): rollout tok/s (completion tokens the trainer consumed over
the wall time of the steady steps), step time median (wall time between trainer steps), trainer step time, rollout
time per step, mismatch KL, stale drops, the concurrency limit; and one row per step (``steps_table``). The verdict
compares each continuous arm with the best fixed arm and says whether that one ran in the same call. Writes
``<out>/rl_longtail_gpu.json`` (``rl_longtail_smoke.json`` with --smoke), keeping arms of earlier calls with the same
settings that this call did not run (``--arms`` splits the arms over calls), and each run's logs beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
ENVS = ROOT / "benchmarks" / "envs"

from prime_core.monitor import read_metrics  # noqa: E402
from provenance import tree_commit  # noqa: E402
from rl_gpu import run_level  # noqa: E402

GPU = {"steps": 10, "batch": 512, "group": 8, "median": 128, "seq_len": 2048, "workers": 8, "sweep": [512]}
SMOKE = {"steps": 5, "batch": 16, "group": 4, "median": 4, "seq_len": 256, "workers": 1, "sweep": [8]}
CONTINUOUS = (1, 2)
"""max_off_policy_steps of the continuous arms."""
STEP_KEYS = {
    "trainer": ("time/step", "mismatch_kl/mean"),
    "orchestrator": ("completion_len/mean", "time/rollouts", "concurrency/limit", "concurrency/staleness_cap",
                     "concurrency/peak_in_flight", "concurrency/staleness_safe", "off_policy/dropped",
                     "off_policy/in_flight", "off_policy/in_queue", "off_policy/max", "engine/kv_cache_usage",
                     "groups/running", "groups/queued"),
}  # fmt: skip
"""What each row of ``steps_table`` holds, by process (absent where the run did not log it)."""


def config_text(args: argparse.Namespace, arm: str, model_dir: Path) -> str:
    """The arm's `rl` config (TOML)."""
    tail = args.median_tokens * args.tail_factor
    env_args = (f"{{ median_tokens = {args.median_tokens}, tail_fraction = {args.tail_fraction}, tail_factor = "
                f"{args.tail_factor}, mean_only = {str(arm.startswith('mean_length')).lower()} }}")  # fmt: skip
    client = 'concurrency = "adaptive"'
    if not arm.startswith("continuous"):
        n = args.batch_size if arm.startswith("mean_length") else fixed_concurrency(arm)
        client = f'concurrency = "fixed"\nmax_concurrent = {n}'
    lines = [
        f"max_steps = {args.max_steps}", f"seq_len = {args.seq_len}", f"async_level = {async_level(arm)}", "seed = 0",
        f'[model]\nname = "{model_dir}"',
        '[trainer]\ndevice = "cpu"' if args.smoke else "",
        "[trainer.optim]\nlr = 1e-5", '[trainer.loss]\ntype = "grpo"',
        f"[orchestrator]\nbatch_size = {args.batch_size}\nrollouts_per_example = {args.group}"
        + ("" if args.smoke else "\nmicro_batch_rows = 8"),
        f"[orchestrator.client]\n{client}",
        f"[orchestrator.sampling]\ntemperature = 1.0\nmax_tokens = {tail}",
        f'[[orchestrator.env]]\nid = "longtail-text"\nnum_workers = {args.workers}\nargs = {env_args}',
        '[inference]\nengine = "torch"' if args.smoke else '[inference]\nengine = "vllm"',
        f'[inference.vllm]\nextra_args = ["--max-cudagraph-capture-size", "{graphs}"]' if (graphs := arm_part(arm, "cg"))
        else "",
        f'[trainer.weights.broadcast]\ntype = "{args.weights}"' if args.weights != "default" else "",
    ]  # fmt: skip
    return "\n".join(line for line in lines if line) + "\n"


ARM = re.compile(r"(fixed_(?P<n>\d+)|continuous_k(?P<k>\d+)|mean_length)(_async(?P<async>\d+))?(_cg(?P<cg>\d+))?")
"""An arm's name: the loop (``fixed_<max_concurrent>``, ``continuous_k<max_off_policy_steps>``, ``mean_length``), then
optionally ``_async<A>`` and ``_cg<N>`` (vLLM captures CUDA graphs up to N rollouts a step)."""


def arm_part(arm: str, part: str) -> int | None:
    """One number of an arm's name (``n``, ``k``, ``async``, ``cg``); None where the name has none."""
    match = ARM.fullmatch(arm)
    if match is None:
        raise ValueError(f"unknown arm {arm!r}: fixed_N, continuous_kK or mean_length, then _asyncA and _cgN")
    value = match.group(part)
    return int(value) if value is not None else None


def async_level(arm: str) -> int:
    """The reference batch is generated alone (async 0): its step's rollouts neither queue behind the previous step's
    nor overlap a weight update, so ``time/rollouts`` is the batch's own generation time."""
    level = arm_part(arm, "async")
    return level if level is not None else 0 if arm.startswith("mean_length") else 1


def arm_flags(arm: str, fields: dict[str, bool]) -> list[str]:
    """CLI flags of issue 42's loop settings: continuous mode always passes them (a config without them fails the
    arm, which says so); today's loop names drain only where the field exists (drain is all there was before)."""
    if arm.startswith("continuous_k"):
        k = arm_part(arm, "k")
        return ["--orchestrator.max-off-policy-steps", str(k), "--inference.weight-update", "in_flight"]
    return ["--inference.weight-update", "drain"] if fields["weight_update"] else []


def fixed_concurrency(arm: str) -> int:
    return arm_part(arm, "n")


def loop_fields() -> dict[str, bool]:
    from prime_core.config.inference import InferenceConfig
    from prime_core.config.orchestrator import OrchestratorConfig

    return {
        "max_off_policy_steps": "max_off_policy_steps" in OrchestratorConfig.model_fields,
        "weight_update": "weight_update" in InferenceConfig.model_fields,
    }


def steady(records: dict[int, dict], warmup: int) -> list[int]:
    """Steps after the warm-up (the first ``warmup``: start-up, the first policy updates, the limit's first moves)."""
    return [s for s in sorted(records) if s >= warmup]


def steps_table(trainer: dict[int, dict], orchestrator: dict[int, dict]) -> list[dict]:
    """One row per step: the trainer's time since its previous step and ``STEP_KEYS`` of both processes."""
    rows = []
    for s in sorted(set(trainer) | set(orchestrator)):
        row: dict = {"step": s}
        if s in trainer and s - 1 in trainer:
            row["step_wall_s"] = trainer[s]["time"] - trainer[s - 1]["time"]
        for process, rows_of in (("trainer", trainer), ("orchestrator", orchestrator)):
            row.update({k: rows_of[s][k] for k in STEP_KEYS[process] if k in rows_of.get(s, {})})
        rows.append(row)
    return rows


def longtail_summary(metrics: Path, batch_size: int, warmup: int = 2) -> dict:
    """What the issue's targets need, from one run's metrics.jsonl."""
    trainer: dict[int, dict] = {}
    orchestrator: dict[int, dict] = {}
    for record in read_metrics(metrics):
        target = trainer if record.process == "trainer" else orchestrator
        target[record.step] = {"time": record.time, **record.values}
    steps = steady(trainer, warmup)

    def values(rows: dict[int, dict], key: str, at: list[int] | None = None) -> list[float]:
        return [rows[s][key] for s in (at if at is not None else sorted(rows)) if rows.get(s, {}).get(key) is not None]

    def med(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    tokens = {s: r["completion_len/mean"] * batch_size for s, r in orchestrator.items() if "completion_len/mean" in r}
    wall_tps = None
    if len(steps) >= 2 and all(s in tokens for s in steps[1:]):
        span = trainer[steps[-1]]["time"] - trainer[steps[0]]["time"]
        wall_tps = sum(tokens[s] for s in steps[1:]) / span if span > 0 else None
    kls = values(trainer, "mismatch_kl/mean")
    limits = values(orchestrator, "concurrency/limit", steady(orchestrator, warmup))
    dropped = values(orchestrator, "off_policy/dropped")
    return {
        "warmup_steps": warmup,
        "rollout_tokens_per_s": wall_tps,
        "step_time_median_s": med(
            [trainer[b]["time"] - trainer[a]["time"] for a, b in zip(steps, steps[1:], strict=False)]
        ),
        # wall time per step over the steady span: a loop whose steps alternate short and long (batches that wait
        # on their last long rollouts every other step) has a median that flatters it; the verdict uses this
        "step_time_mean_s": (trainer[steps[-1]]["time"] - trainer[steps[0]]["time"]) / (len(steps) - 1)
        if len(steps) >= 2
        else None,
        "trainer_step_median_s": med(values(trainer, "time/step", steps)),
        "rollout_time_median_s": med(values(orchestrator, "time/rollouts", steady(orchestrator, warmup))),
        "completion_tokens_per_step_mean": statistics.mean(tokens.values()) if tokens else None,
        "mismatch_kl_max": max(kls, default=None),
        "mismatch_kl_mean": statistics.mean(kls) if kls else None,
        "concurrency_limit_mean": statistics.mean(limits) if limits else None,
        "concurrency_limit_max": max(limits, default=None),
        "engine_preemptions": (values(orchestrator, "engine/preemptions") or [None])[-1],
        "engine_kv_cache_usage_mean": med(values(orchestrator, "engine/kv_cache_usage")),
        "off_policy_dropped": sum(dropped) if dropped else (0 if orchestrator else None),
        "off_policy_dropped_steady": sum(values(orchestrator, "off_policy/dropped", steady(orchestrator, warmup))),
        "off_policy_dropped_rollouts": sum(values(orchestrator, "off_policy/in_flight"))
        + sum(values(orchestrator, "off_policy/in_queue")),
        "concurrency_limit_trace": values(orchestrator, "concurrency/limit"),
        "staleness_cap_trace": values(orchestrator, "concurrency/staleness_cap"),
        "steps_table": steps_table(trainer, orchestrator),
    }


def length_stats(args: argparse.Namespace) -> dict:
    """The response lengths the runs ask for (the env's draw from the orchestrator's per-sample seeds)."""
    sys.path.insert(0, str(ENVS))
    from longtail_text import LongtailData, response_tokens
    from prime_orchestrator.envs import request_seed

    data = LongtailData(prompt="", median_tokens=args.median_tokens, tail_fraction=args.tail_fraction,
                        tail_factor=args.tail_factor, mean_only=False)  # fmt: skip
    lengths = sorted(response_tokens(data, request_seed(0, s, i)) for s in range(args.max_steps)
                     for i in range(args.batch_size))  # fmt: skip
    mean_only = response_tokens(data.model_copy(update={"mean_only": True}), 0)
    return {"median": statistics.median(lengths), "mean": statistics.mean(lengths), "max": lengths[-1],
            "p90": lengths[int(0.9 * (len(lengths) - 1))], "tail_share": lengths.count(lengths[-1]) / len(lengths),
            "mean_length_arm": mean_only}  # fmt: skip


def run_arm(args: argparse.Namespace, arm: str, model_dir: Path, work: Path, fields: dict[str, bool]) -> dict:
    if arm.startswith("continuous") and not all(fields.values()):
        missing = [name for name, ok in fields.items() if not ok]
        message = f"skipped: this tree's config has no {' / '.join(missing)} (issue 42 items 1-2 are not merged)"
        if args.smoke:
            print(f"continuous arm {message}", flush=True)
            return {"arm": arm, "skipped": message}
    run = work / arm
    config = work / f"{arm}.toml"
    config.write_text(config_text(args, arm, model_dir))
    rl = os.environ.get("PRIME_LAUNCH_BIN_DIR", str(Path(sys.executable).parent)) + "/rl"
    cmd = [rl, "@", str(config), "--output-dir", str(run), "--overwrite", "--console", "logs",
           *arm_flags(arm, fields), *args.extra]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    entry = {"arm": arm, "call": args.call, **run_level(cmd, run, async_level(arm)), "commit": tree_commit(args.commit)}
    if (run / "metrics.jsonl").is_file() and entry["returncode"] == 0:
        entry.update(longtail_summary(run / "metrics.jsonl", args.batch_size, args.warmup))
    for name in ("inference", "orchestrator", "trainer"):
        log = run / "logs" / f"{name}.log"
        if log.is_file():
            (args.out / f"{args.name}_{arm}_{name}.log").write_text(log.read_text()[-200_000:])
    return entry


def verdict(results: dict[str, dict]) -> dict:
    """The issue's targets from the arms at hand, for each continuous arm against the best fixed arm."""
    fixed = [r for a, r in results.items() if a.startswith("fixed_") and r.get("rollout_tokens_per_s")]
    best = max(fixed, key=lambda r: r["rollout_tokens_per_s"], default=None)
    mean = results.get("mean_length", {})
    out: dict = {"best_fixed_arm": best["arm"] if best else None}
    for arm, new in sorted(results.items()):
        if not arm.startswith("continuous") or new.get("returncode") != 0:
            continue
        v: dict = {"off_policy_dropped": new.get("off_policy_dropped"), "mismatch_kl_max": new.get("mismatch_kl_max")}
        if best and new.get("rollout_tokens_per_s"):
            v["best_fixed_in_same_call"] = best.get("call") == new.get("call")
            v["rollout_tokens_per_s_ratio"] = new["rollout_tokens_per_s"] / best["rollout_tokens_per_s"]
            v["rollout_tokens_per_s_target_met"] = v["rollout_tokens_per_s_ratio"] >= 1.15
        bound = [x for x in (new.get("trainer_step_median_s"), mean.get("rollout_time_median_s")) if x]
        step = new.get("step_time_mean_s") or new.get("step_time_median_s")
        if step and len(bound) == 2:
            v["step_time_bound_s"] = max(bound)
            v["step_time_over_bound"] = step / max(bound)
            v["step_time_target_met"] = v["step_time_over_bound"] <= 1.05
        out[arm] = v
    return out


def setup(args: argparse.Namespace, work: Path) -> tuple[Path, dict]:
    """(model directory, the record's model description)."""
    if args.smoke:
        return ROOT / "examples" / "reverse_text" / "model", {"shape": "reverse-text example (Qwen3-shaped, 1.6M)"}
    from examples_gpu import full_vocab_tokenizer
    from weight_update_gpu import save_model

    model_dir, tokenizer_dir = work / "model", ROOT / "examples" / "reverse_text" / "model"
    if args.vocab:
        tokenizer_dir = work / "tokenizer"
        full_vocab_tokenizer(args.vocab).save_pretrained(tokenizer_dir)
    return model_dir, {"shape": "Qwen3-0.6B", **save_model(model_dir, "0.6b", tokenizer_dir=str(tokenizer_dir))}


def device() -> tuple[str, int]:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0), torch.cuda.device_count()
    return f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores", 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny model, torch engine, 5 steps per arm")
    parser.add_argument("--sweep", type=int, nargs="+", default=None, help="max_concurrent of today's loop")
    parser.add_argument(
        "--arms",
        nargs="+",
        default=None,
        help="run only these (fixed_N, fixed_N_asyncA, mean_length, continuous_kK, continuous_kK_asyncA)",
    )
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the steady-state numbers")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--median-tokens", type=int, default=None)
    parser.add_argument("--tail-fraction", type=float, default=0.1)
    parser.add_argument("--tail-factor", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151936, help="tokenizer size (0: the reverse-text example's)")
    parser.add_argument(
        "--weights",
        choices=("auto", "default", "filesystem", "nccl", "cuda_ipc"),
        default="auto",
        help="weight transport of every arm; auto: nccl where inference and trainer get a GPU each (2+ GPUs), else "
        "`rl`'s own choice (cuda_ipc on one shared GPU, files on a CPU)",
    )
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `rl` arguments, every arm")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results (smoke: the work dir)")
    parser.add_argument("--commit", default=os.environ.get("PRIME_COMMIT"))
    args = parser.parse_args()
    preset = SMOKE if args.smoke else GPU
    args.max_steps = args.max_steps or preset["steps"]
    args.batch_size = args.batch_size or preset["batch"]
    args.median_tokens = args.median_tokens or preset["median"]
    args.sweep = args.sweep or preset["sweep"]
    args.group, args.seq_len, args.workers = preset["group"], preset["seq_len"], preset["workers"]
    args.seq_len = max(args.seq_len, 2 * args.median_tokens * args.tail_factor)
    args.name = "rl_longtail_smoke" if args.smoke else "rl_longtail_gpu"
    args.call = time.strftime("%Y%m%dT%H%M%S")
    return args


def main() -> None:
    args = parse_args()
    work = Path(os.environ.get("PRIME_RL_GPU_DIR", "/tmp/prime-rl-longtail")) / ("smoke" if args.smoke else "gpu")
    work.mkdir(parents=True, exist_ok=True)
    args.out = args.out or (work if args.smoke else ROOT / "benchmarks" / "results")
    args.out.mkdir(parents=True, exist_ok=True)
    # The synthetic environment is importable by its id in every process `rl` starts (env servers included).
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ENVS), os.environ.get("PYTHONPATH")) if p)
    arms = args.arms or [*(f"fixed_{n}{a}" for n in args.sweep for a in ("", "_async2")), "mean_length",
                         *(f"continuous_k{k}" for k in CONTINUOUS)]  # fmt: skip
    out = args.out / f"{args.name}.json"
    previous = json.loads(out.read_text()) if out.is_file() else {}
    model_dir, model = setup(args, work)
    name, gpus = device()
    if args.weights == "auto":
        args.weights = "nccl" if gpus >= 2 and not args.smoke else "default"
    fields = loop_fields()
    report = {
        "benchmark": args.name, "device": name, "gpus": gpus, "commit": tree_commit(args.commit),
        "vocab_size": args.vocab if not args.smoke else None, "model": model, "loop_fields": fields,
        "settings": {k: getattr(args, k) for k in ("max_steps", "batch_size", "group", "median_tokens", "tail_fraction",
                                                   "tail_factor", "seq_len", "workers", "warmup", "weights",
                                                   "extra")},
        "lengths": length_stats(args), "results": {},
    }  # fmt: skip
    if previous.get("settings") == report["settings"] and previous.get("device") == name:
        report["results"] = dict(previous.get("results", {}))  # arms an earlier call ran (--arms)
    for arm in arms:
        report["results"][arm] = run_arm(args, arm, model_dir, work, fields)
        report["verdict"] = verdict(report["results"])
        print(json.dumps(report["results"][arm]), flush=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["verdict"], indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
