"""TRL's GRPOTrainer on the reverse-text example: the yardstick for `rl @ examples/reverse_text/rl.toml`.

Same model (examples/reverse_text/model), same prompts (the reverse-text taskset's generator, seed 0, in order),
same reward (LCS ratio, plus the same exact-match bonus when the example's config sets one), same group size,
temperature, completion budget, learning rate and number of samples as our run. TRL is not a dependency of the
workspace: run this in its own virtual environment, then score the result with our `eval` (the same measurement
as for our run):

    python -m venv /tmp/trl && /tmp/trl/bin/pip install torch trl
    /tmp/trl/bin/python benchmarks/trl_reverse_text.py --output-dir outputs/trl-reverse-text
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "environments" / "reverse-text" / "src"))

from reverse_text.data import SYSTEM_PROMPT, generate_examples, lcs_ratio, parse_answer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "examples/reverse_text/model"))
    p.add_argument("--output-dir", type=Path, default=ROOT / "outputs/trl-reverse-text")
    p.add_argument("--steps", type=int, default=80, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=128, help="completions per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--exact-bonus", type=float, default=0.0, help="reward added for an exact answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    num_prompts = args.steps * args.batch_size // args.group_size
    rows = [
        {
            "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": ex["prompt"]}],
            "answer": ex["answer"],
        }
        for ex in generate_examples(num_prompts, seed=0)
    ]

    def reward(completions, answer, **_):
        out = []
        for c, a in zip(completions, answer, strict=True):
            text = c[-1]["content"] if isinstance(c, list) else c
            bonus = args.exact_bonus if parse_answer(text) == a else 0.0
            out.append(lcs_ratio(text, a) + bonus)
        return out

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=str(args.output_dir),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.group_size,
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        shuffle_dataset=False,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows), processing_class=tok
    )
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    final = args.output_dir / "final"
    trainer.save_model(str(final))
    tok.save_pretrained(str(final))
    log = [h for h in trainer.state.log_history if "reward" in h]
    summary = {
        "wall_s": round(wall, 1),
        "samples": args.steps * args.batch_size,
        "reward_first3": sum(h["reward"] for h in log[:3]) / max(1, len(log[:3])),
        "reward_last3": sum(h["reward"] for h in log[-3:]) / max(1, len(log[-3:])),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    (args.output_dir / "summary.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
