"""How much of a code-RL rollout its reward takes (issue: the reward path adds at most 5% to rollout time).

The code environment (``code-tasks``) runs through the orchestrator as in training: verifiers' env server, its
train client, our torch-engine server. A scripted engine answers every task with its reference solution in a
```python block, so every rollout runs its hidden tests in the sandbox pool and scores 1.0 (a model that fails to
write code would skip the sandbox and make the reward path look free). The tiny model's generation stands in for
the real one: the scripted reply costs one teacher-forced forward, far less than sampling it, so the share
reported here is an upper bound of what a real run sees. Reports ``rollout/scoring_share`` (verifiers' scoring
span over the rollout's wall time), the scoring seconds per rollout, and what the reward path adds to a step's
rollout time against a baseline run whose replies hold no code (the reward returns 0 without running anything).

    uv run python benchmarks/code_reward_path.py            # -> benchmarks/results/code_reward_path_<host>.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

from provenance import tree_commit

ROOT = Path(__file__).resolve().parents[1]


def _script(tasks: list[dict], with_code: bool):
    """Each task's reference in a ```python block, or (the baseline) the same text with neither fence nor ``def``, so
    the reward finds no code and runs nothing."""
    answers = {
        t["prompt"]: f"Here it is.\n```python\n{t['reference']}```"
        if with_code
        else f"Here it is.\n{t['reference'].replace('def ', 'fun ')}"
        for t in tasks
    }

    def script(prompt: str) -> str | None:
        return next((answer for task_prompt, answer in answers.items() if task_prompt in prompt), None)

    return script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=64, help="rollouts per step")
    parser.add_argument("--rollouts-per-example", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-concurrent", type=int, default=32, help="rollouts in flight")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from code_tasks import generate_tasks
    from prime_core.config.orchestrator import OrchestratorConfig
    from prime_core.monitor import read_metrics
    from prime_orchestrator.orchestrator import Orchestrator

    sys.path.insert(0, str(ROOT))  # the test fixtures' tiny model and scripted engine
    from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
    from tests.fixtures.scripted import ScriptedServer

    num_examples = args.batch_size // args.rollouts_per_example * args.steps
    tasks = generate_tasks(num_examples, seed=0, num_tests=5)

    def phase(tmp: Path, model: Path, with_code: bool) -> list[dict]:
        server = ScriptedServer(model, _script(tasks, with_code))
        run_dir = tmp / ("run_code" if with_code else "run_baseline")
        try:
            config = {
                "model": {"name": str(model)},
                "output_dir": str(run_dir),
                "seq_len": 2048,
                "max_steps": args.steps,
                "async_level": args.steps,  # no trainer: every step samples with weights 0
                "batch_size": args.batch_size,
                "rollouts_per_example": args.rollouts_per_example,
                "client": {"base_url": server.url, "max_concurrent": args.max_concurrent},
                "env": [{"id": "code-tasks", "args": {"num_examples": num_examples, "seed": 0, "num_tests": 5}}],
                "sampling": {"max_tokens": 512, "temperature": 1.0},
                "filters": {"zero_advantage_groups": False},
                "weights_timeout": 120,
            }
            asyncio.run(Orchestrator(OrchestratorConfig.model_validate(config)).run())
        finally:
            server.stop()
        steps = [r.values for r in read_metrics(run_dir / "metrics.jsonl", "orchestrator")]
        return steps[1:] or steps  # step 0 includes the sandbox pool's and env server's start

    def mean(steps: list[dict], key: str) -> float:
        return sum(m[key] for m in steps) / len(steps)

    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        corpus = [t["prompt"] + t["reference"] for t in tasks]
        model = save_tiny_model(Path(tmp) / "model", build_tool_tokenizer(corpus, vocab_size=2000))
        baseline = phase(Path(tmp), model, with_code=False)
        measured = phase(Path(tmp), model, with_code=True)
    share = mean(measured, "rollout/scoring_share")
    latency = mean(measured, "rollout/latency_mean")
    step_code, step_base = mean(measured, "time/rollouts"), mean(baseline, "time/rollouts")
    record = {
        "benchmark": "code_reward_path",
        "device": f"cpu: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_avg_1m_at_end": os.getloadavg()[0],
        "commit": tree_commit(os.environ.get("PRIME_COMMIT")),
        "vocab_size": 2000,
        "batch_size": args.batch_size,
        "rollouts_per_example": args.rollouts_per_example,
        "max_concurrent": args.max_concurrent,
        "steps_measured": len(measured),
        "reward_mean": mean(measured, "reward/mean"),
        "baseline_reward_mean": mean(baseline, "reward/mean"),
        "step_rollout_time_s": step_code,
        "baseline_step_rollout_time_s": step_base,
        "reward_path_adds": step_code / step_base - 1,
        "rollout_latency_mean_s": latency,
        "scoring_share_of_rollout_wall": share,
        "scoring_s_per_rollout": share * latency,
        "target_reward_path_adds_le": 0.05,
    }
    out = args.out or ROOT / "benchmarks" / "results" / f"code_reward_path_{platform.node() or 'host'}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
