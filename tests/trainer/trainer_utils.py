"""Helpers of the trainer tests: tiny model config, generated rollouts, CLI runs."""

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
from prime_core.run_dir import RunDir
from prime_core.schemas.microbatch import MicroBatch, RolloutBatchMeta, write_microbatches

TINY_QWEN3 = {
    "model_type": "qwen3",
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "intermediate_size": 64,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def make_step_batches(step: int, num_micro_batches: int, rows: int, seq_len: int, vocab: int) -> list[MicroBatch]:
    """Packed micro-batches of random samples (prompt, then a completion with an advantage and inference log-probs)."""
    rng = np.random.default_rng([7, step])
    out, sample = [], 0
    for _ in range(num_micro_batches):
        mb = MicroBatch.empty(rows, seq_len)
        for r in range(rows):
            pos = 0
            while seq_len - pos >= 4:
                length = int(rng.integers(4, seq_len // 2 + 1))
                length = min(length, seq_len - pos)
                span = slice(pos, pos + length)
                prompt = int(rng.integers(1, length - 1))
                mb.input_ids[r, span] = rng.integers(0, vocab, length)
                mb.position_ids[r, span] = np.arange(length)
                mb.sample_ids[r, span] = sample
                comp = slice(pos + prompt, pos + length)
                mb.loss_mask[r, comp] = True
                mb.advantages[r, comp] = rng.standard_normal()
                mb.inference_logprobs[r, comp] = -np.log(vocab) + 0.3 * rng.standard_normal(comp.stop - comp.start)
                pos += length
                sample += 1
        out.append(mb)
    return out


def write_rollouts(
    output_dir: Path,
    steps: int,
    num_ranks: int,
    micro_batches_per_step: int = 4,
    seq_len: int = 32,
    vocab: int = 96,
    batches_of: Callable[[int], list[MicroBatch]] | None = None,
) -> None:
    """The same global batches split across ``num_ranks`` trainer ranks (rank r gets micro-batches r, r+R, ...).
    ``batches_of(step)`` replaces the generated batches of each step."""
    run_dir = RunDir(output_dir)
    for step in range(steps):
        if batches_of is not None:
            batches = batches_of(step)
        else:
            batches = make_step_batches(step, micro_batches_per_step, 2, seq_len, vocab)
        total = sum(mb.num_loss_tokens for mb in batches)
        for rank in range(num_ranks):
            mine = batches[rank::num_ranks]
            meta = RolloutBatchMeta(
                step=step,
                rank=rank,
                num_micro_batches=len(mine),
                seq_len=seq_len,
                temperature=0.8,
                global_loss_tokens=total,
            )
            write_microbatches(run_dir.rollout_file(step, rank), meta, mine)


def run_cli(args: list[str], *, nproc: int = 1, module: str = "prime_trainer.entrypoints.trainer", timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nproc == 1:
        cmd = [sys.executable, "-m", module, *args]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(_free_port()),
            "-m",
            module,
            *args,
        ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_trainer_metrics(output_dir: Path, process: str = "trainer") -> dict[int, dict]:
    from prime_core.monitor import read_metrics

    return {r.step: r.values for r in read_metrics(Path(output_dir) / "metrics.jsonl", process)}


def load_weights(path: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Rewrites earlier assistant turns (like Qwen3 stripping past reasoning): breaks the prefix property.
STRIPPING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}...{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_char_tokenizer(path: Path, chat_template: str = CHAT_TEMPLATE) -> Path:
    """A character-level fast tokenizer (printable ASCII + newline + chat specials) saved as an HF directory."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    chars = ["\n"] + [chr(i) for i in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = chat_template
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    return path


def write_reverse_dataset(path: Path, n: int, seed: int = 0) -> Path:
    """Prompt-completion rows: a short lowercase word and its reversal."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        word = "".join(chr(ord("a") + int(c)) for c in rng.integers(0, 6, int(rng.integers(3, 7))))
        lines.append(json.dumps({"prompt": word, "completion": word[::-1]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def train_two_steps_and_fail(model_dir: Path, out: Path) -> str:
    """`trainer` on the rollouts written to ``out`` for two steps, expected to stop in one line at step 1: that
    line (the process exited 1, printed no traceback and published no weights for step 1)."""
    cmd = [sys.executable, "-m", "prime_trainer.entrypoints.trainer", "--model.name", str(model_dir),
           "--output-dir", str(out), "--max-steps", "2", "--seq-len", "32", "--async-level", "1",
           "--log.level", "warning"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not RunDir(out).weight_step(2).exists()  # step 0 trained, step 1 never did
    return proc.stderr.strip().splitlines()[-1]
