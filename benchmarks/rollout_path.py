"""What the orchestrator's side of a rollout costs (CPU): verifiers' env server, its interception server and train
client, renderers, our token-in route, against an engine that answers at once.

    python benchmarks/rollout_path.py [--workers 1 2 4] [--vocab 151936] [--rollouts 512] [--tokens 128] --out DIR

The RL loop's rollouts ran at ~4.7k tok/s on one H100 (rl_gpu.py, 512 reverse-text rollouts x 128 tokens, 14.7 s
a step) where the same server generates ~30k tok/s (inference_vllm.py). This runs the loop's rollout path with the
generation taken out: an in-process server whose engine returns ``--tokens`` random ids with log-probs instantly,
the orchestrator's reverse-text env with ``--workers`` env-server processes, ``--steps`` steps (async level steps - 1,
so no trainer is needed; ``--concurrency`` rollouts in flight). ``time/rollouts`` of each step is then the orchestrator
side alone. All steps are dispatched at once and the in-flight cap admits rollouts in order, so step k ends about
when its rollouts are done: the first step includes the env workers' start-up, the later ones give the steady rate
(``steady_rollouts_per_s``). Writes <out>/rollout_path.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]


class InstantEngine:
    """The torch engine's info and admin calls; ``generate`` returns random ids at once (no model)."""

    def __init__(self, inner, vocab_size: int):
        self.inner, self.vocab_size, self.rng = inner, vocab_size, random.Random(0)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request):
        from prime_inference.engines.base import EngineOutput

        ids = [self.rng.randrange(self.vocab_size // 2, self.vocab_size) for _ in range(request.params.max_tokens)]
        yield EngineOutput(ids, [-1.0] * len(ids), None, "length", None, self.inner.weight_step)


def model_dir(work: Path, vocab: int) -> Path:
    from tests.fixtures.models import save_tiny_model

    path = work / f"model-{vocab or 'small'}"
    if not (path / "config.json").is_file():
        if vocab:
            from examples_gpu import full_vocab_tokenizer

            tokenizer = full_vocab_tokenizer(vocab)
        else:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(ROOT / "examples" / "reverse_text" / "model")
        save_tiny_model(path, tokenizer)
    return path


def run(model: Path, workers: int, args: argparse.Namespace, out: Path) -> dict:
    from prime_core.config.orchestrator import OrchestratorConfig
    from prime_core.monitor import read_metrics
    from prime_inference.engines import build_engine
    from prime_orchestrator.orchestrator import Orchestrator

    from tests.fixtures.scripted import InProcessServer, torch_server_config

    config = torch_server_config(model)

    def factory():
        inner, tokenizer = build_engine(config)
        return InstantEngine(inner, len(tokenizer)), tokenizer

    shutil.rmtree(out, ignore_errors=True)
    server = InProcessServer(config, factory)
    try:
        orchestrator = {
            "model": {"name": str(model)}, "output_dir": str(out), "seq_len": 2048, "max_steps": args.steps,
            "async_level": args.steps - 1, "batch_size": args.rollouts, "rollouts_per_example": args.group,
            "client": {"base_url": server.url, "max_concurrent": args.concurrency}, "env": [{"id": "reverse-text", "num_workers": workers}],
            "sampling": {"max_tokens": args.tokens, "temperature": 1.0}, "filters": {"zero_advantage_groups": False},
        }  # fmt: skip
        start = time.perf_counter()
        asyncio.run(Orchestrator(OrchestratorConfig.model_validate(orchestrator)).run())
        wall = time.perf_counter() - start
    finally:
        server.stop()
    steps = [r.values for r in read_metrics(out / "metrics.jsonl", "orchestrator")]
    rollouts_s = [s["time/rollouts"] for s in steps]
    # Steps overlap (all dispatched at once), so with few steps the last may end before the first: no steady rate then.
    steady = (rollouts_s[-1] - rollouts_s[0]) / (len(rollouts_s) - 1) if len(rollouts_s) > 1 else None
    steady = steady if steady and steady > 0 else None
    return {"workers": workers, "wall_s": wall, "rollouts_s": rollouts_s,
            "first_step_rollouts_per_s": args.rollouts / rollouts_s[0],
            "steady_rollouts_per_s": args.rollouts / steady if steady else None}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--vocab", type=int, default=151936, help="tokenizer size (0: the reverse-text example's)")
    parser.add_argument("--rollouts", type=int, default=512)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=512, help="client.max_concurrent: rollouts in flight")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--commit", default=os.environ.get("PRIME_COMMIT"))
    args = parser.parse_args()

    from serve_load import host_cpu, tree_commit

    work = Path(os.environ.get("PRIME_ROLLOUT_PATH_DIR", "/tmp/prime-rollout-path"))
    model = model_dir(work, args.vocab)
    commit = tree_commit(args.commit)
    report = {"benchmark": "rollout_path", "host_cpu": host_cpu(), "cpus": os.cpu_count(), "commit": commit,
              "vocab_size": args.vocab or "reverse-text example's", "config": vars(args) | {"out": str(args.out)},
              "results": []}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    for workers in args.workers:
        entry = run(model, workers, args, work / f"run-{workers}")
        print(json.dumps(entry), flush=True)
        report["results"].append(entry)
        (args.out / "rollout_path.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
