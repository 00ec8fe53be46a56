"""Continuous rollouts on a modelled engine and trainer: which ``max_off_policy_steps`` (K) and ``async_level`` (A)
keep the long-tail loop at its bound (issue 42), before a GPU lease is spent on them.

    uv run python benchmarks/continuous_sim.py [--arms k2_a1 k2_a2 k4_a3] [--out benchmarks/results]

The scheduler is the real one (`prime_orchestrator.continuous.Continuous`: dispatch, oldest-first formation,
last-chance waits, the staleness sweep); the rest is a model fitted to the 2 x H200 record
(`results/rl_longtail_gpu_2gpu.json`):

- the engine decodes every running rollout one token per step, a step of ``a + c x running`` ms (vLLM's decode is
  memory-bound at these batch sizes, so a step grows with the rollouts in it), up to ``--max-seqs`` running; a rollout
  is admitted when the orchestrator's concurrency limit (fixed, ``--concurrency``) gives it a slot, and its first
  token is sampled on the weights served then;
- response lengths are the long-tail environment's own draw (benchmarks/envs/longtail_text) from each rollout's seed;
- the trainer takes batch n once it is formed, trains for ``--trainer-s`` and serves weights n + 1 at once (in-flight
  updates: running rollouts go on with them).

Time runs ``--speed`` times faster than simulated (the scheduler's own Python work is then simulated time too, so
keep the speed moderate). Per arm over the steps after ``--warmup``: the mean step, the rollout tok/s, the most
rollouts in flight, the stale drops, and the model's bound max(trainer step, mean-length batch alone). Writes
``<out>/continuous_sim.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "benchmarks" / "envs")]

from prime_core.config.orchestrator import OrchestratorConfig  # noqa: E402
from prime_core.schemas.rollout import PolicyVersions, RolloutResult  # noqa: E402
from prime_orchestrator.batch import Rollout  # noqa: E402
from prime_orchestrator.concurrency import ConcurrencyLimiter  # noqa: E402
from prime_orchestrator.continuous import Continuous  # noqa: E402
from provenance import tree_commit  # noqa: E402


class Policy:
    """The served weights: ``version``, listeners told of each new one, and a wait for a version."""

    def __init__(self) -> None:
        self.version = 0
        self.listeners: list = []
        self.served = asyncio.Event()

    def serve(self, version: int) -> None:
        self.version = version
        for listener in self.listeners:
            listener()
        self.served.set()

    async def wait_for(self, version: int, timeout: float) -> float:
        start = time.perf_counter()
        async with asyncio.timeout(timeout):
            while self.version < version:
                self.served.clear()
                await self.served.wait()
        return time.perf_counter() - start


class Engine:
    """Running rollouts advance one token per decode step of ``a + c x running`` ms (simulated); the first token of a
    rollout is sampled on the weights served when it was admitted."""

    def __init__(self, args: argparse.Namespace, policy: Policy):
        self.a, self.c = args.step_ms / 1000, args.per_seq_ms / 1000
        self.max_seqs, self.speed = args.max_seqs, args.speed
        self.policy = policy
        self.running: dict[str, list] = {}  # tag -> [tokens left, future]
        self.waiting: deque[tuple[str, int, asyncio.Future]] = deque()
        self.wake = asyncio.Event()
        self.first: dict[str, int] = {}  # tag -> the weights its first token was sampled on (the version record)

    def step_s(self) -> float:
        return self.a + self.c * len(self.running)

    async def generate(self, tag: str, tokens: int) -> PolicyVersions:
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((tag, tokens, future))
        self.wake.set()
        try:
            first = await future
        finally:
            self.running.pop(tag, None)  # cancelled (the staleness sweep): the server aborts it
        return PolicyVersions(first=first, last=self.policy.version)

    async def run(self) -> None:
        last = time.perf_counter()
        while True:
            now = time.perf_counter()
            if self.running:
                steps = (now - last) * self.speed / self.step_s()
                for tag, entry in list(self.running.items()):
                    entry[0] -= steps
                    if entry[0] <= 1e-9 and not entry[1].done():
                        entry[1].set_result(self.first[tag])
                        del self.running[tag]
            last = now
            while self.waiting and len(self.running) < self.max_seqs:
                tag, tokens, future = self.waiting.popleft()
                if not future.done():
                    self.running[tag] = [float(tokens), future]
                    self.first[tag] = self.policy.version
            self.wake.clear()
            timeout = min(e[0] for e in self.running.values()) * self.step_s() / self.speed if self.running else None
            with contextlib.suppress(TimeoutError):  # the next rollout ends (asyncio.timeout: no cancel swallowed)
                async with asyncio.timeout(timeout):
                    await self.wake.wait()


class Ledger:
    """The servers' version records (`POST /rollout_versions`) as the engine keeps them."""

    def __init__(self, engine: Engine):
        self.engine = engine

    async def peek(self, flights):
        first = self.engine.first
        return {f.tag: PolicyVersions(first=first[f.tag], last=first[f.tag]) for f in flights if f.tag in first}

    async def abort(self, flights):
        for f in flights:
            self.engine.running.pop(f.tag, None)


class Passthrough:
    async def track(self, step, rollout):
        return await rollout

    async def score(self, step, env, rollouts):
        return rollouts


class SimOrchestrator:
    """What `Continuous` uses of the orchestrator, with rollouts generated by the modelled engine."""

    def __init__(self, args: argparse.Namespace, k: int, a: int):
        from longtail_text import LongtailData, response_tokens

        self.config = OrchestratorConfig.model_validate(
            {"batch_size": args.batch_size, "rollouts_per_example": args.group, "async_level": a,
             "max_off_policy_steps": k, "max_steps": args.steps}
        )  # fmt: skip
        self.start_step = 0
        self.envs = {e.resolved_name: e for e in self.config.env}
        self.cursors = dict.fromkeys(self.envs, 0)
        self.cursor_history: dict[int, dict[str, int]] = {}
        self.policy = Policy()
        self.engine = Engine(args, self.policy)
        self.versions, self.tracker = Ledger(self.engine), Passthrough()
        self.teachers = self.tracker
        self.semaphore = ConcurrencyLimiter(args.concurrency)
        self.data = LongtailData(prompt="", median_tokens=args.median_tokens, tail_fraction=args.tail_fraction,
                                 tail_factor=args.tail_factor, mean_only=False)  # fmt: skip
        self.length = response_tokens

    async def _rollout(self, step, env, example, group, index, flight) -> Rollout:
        tokens = self.length(self.data, flight.seed)
        async with self.semaphore:
            flight.started, flight.tag, flight.url = self.policy.version, f"s{flight.seed}", "engine"
            versions = await self.engine.generate(flight.tag, tokens)
        result = RolloutResult(env=env, example=example, reward=float(index), completion_len=tokens)
        result.versions = flight.versions = versions
        return Rollout(env, example, group, flight.started, result)


async def simulate(args: argparse.Namespace, k: int, a: int) -> dict:
    orch = SimOrchestrator(args, k, a)
    cont = Continuous(orch)
    buffer: asyncio.Queue = asyncio.Queue()
    engine = asyncio.create_task(orch.engine.run())
    loop = asyncio.create_task(cont.rollout_loop(buffer))
    rows = []
    while (formed := await buffer.get()) is not None:
        batch = await formed
        await asyncio.sleep(args.trainer_s / args.speed)
        orch.policy.serve(batch.step + 1)
        tokens = sum(r.result.completion_len for g in batch.groups for r in g)
        stale = max(batch.step - r.result.versions.first for g in batch.groups for r in g)
        rows.append({"step": batch.step, "end": time.perf_counter(), "tokens": tokens,
                     "staleness_max": stale, "dropped": batch.metrics.get("off_policy/dropped", 0)})  # fmt: skip
    await loop
    engine.cancel()
    steady = rows[args.warmup :]
    span = (steady[-1]["end"] - steady[0]["end"]) * args.speed
    steps = len(steady) - 1
    return {
        "arm": f"k{k}_a{a}",
        "max_off_policy_steps": k,
        "async_level": a,
        "step_time_mean_s": span / steps,
        "rollout_tokens_per_s": sum(r["tokens"] for r in steady[1:]) / span,
        "trainer_idle_share": 1 - steps * args.trainer_s / span,
        "staleness_max": max(r["staleness_max"] for r in rows),
        "dropped_groups": sum(r["dropped"] for r in rows),
        "step_times_s": [round((b["end"] - a_["end"]) * args.speed, 2) for a_, b in zip(rows, rows[1:], strict=False)],
    }


def bound(args: argparse.Namespace) -> dict:
    """The issue's bound under the model: the mean-length batch generated alone (every rollout running from the start)
    beside the trainer step."""
    mean = round(args.median_tokens * (1 - args.tail_fraction) + args.median_tokens * args.tail_factor
                 * args.tail_fraction)  # fmt: skip
    running = min(args.batch_size, args.max_seqs, args.concurrency)
    alone = mean * (args.step_ms + args.per_seq_ms * running) / 1000 * -(-args.batch_size // running)
    return {"mean_length_batch_s": alone, "trainer_step_s": args.trainer_s, "bound_s": max(alone, args.trainer_s)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", nargs="+", default=["k2_a1", "k2_a2", "k3_a2", "k4_a3", "k6_a4"],
                   help="k<max_off_policy_steps>_a<async_level>")  # fmt: skip
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--warmup", type=int, default=4, help="first steps left out (the pipeline filling)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--median-tokens", type=int, default=128)
    p.add_argument("--tail-fraction", type=float, default=0.1)
    p.add_argument("--tail-factor", type=int, default=8)
    p.add_argument("--step-ms", type=float, default=3.0, help="decode step of one rollout (ms)")
    p.add_argument("--per-seq-ms", type=float, default=0.026, help="added to a decode step per running rollout (ms)")
    p.add_argument("--max-seqs", type=int, default=1024, help="the engine's running rollouts at most")
    p.add_argument("--concurrency", type=int, default=1024, help="the orchestrator's limit (adaptive's ceiling)")
    p.add_argument("--trainer-s", type=float, default=2.1, help="trainer step + hand-over (s)")
    p.add_argument("--speed", type=float, default=10.0, help="simulated seconds per second")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    return p.parse_args()


CALIBRATION = ROOT / "benchmarks" / "results" / "rl_longtail_gpu_2gpu.json"
"""The measured arms the model is checked against (same settings): their mean steps go beside the simulated ones."""


def measured() -> dict:
    if not CALIBRATION.is_file():
        return {}
    record = json.loads(CALIBRATION.read_text())
    return {"record": CALIBRATION.name, "device": record["device"], "gpus": record["gpus"], "commit": record["commit"],
            "step_time_mean_s": {arm: r.get("step_time_mean_s") for arm, r in record["results"].items()},
            "rollout_tokens_per_s": {arm: r.get("rollout_tokens_per_s") for arm, r in record["results"].items()}}  # fmt: skip


def main() -> None:
    args = parse_args()
    record = {"benchmark": "continuous_sim", "device": f"model on a CPU ({platform.processor() or platform.machine()})",
              "commit": tree_commit(None), "vocab_size": None, "model": {**vars(args), "out": None},
              "bound": bound(args), "measured": measured(), "results": {}}  # fmt: skip
    for arm in args.arms:
        k, a = (int(x) for x in arm.removeprefix("k").split("_a"))
        result = asyncio.run(simulate(args, k, a))
        result["over_bound"] = result["step_time_mean_s"] / record["bound"]["bound_s"]
        record["results"][arm] = result
        print(json.dumps({x: result[x] for x in result if x != "step_times_s"}), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "continuous_sim.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(f"bound {record['bound']}; wrote {args.out / 'continuous_sim.json'}")


if __name__ == "__main__":
    main()
