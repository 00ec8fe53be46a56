"""Every example's `rl_gpu.toml`, a few steps on this host's GPUs, with a model of the real shape (issue 24).

    python benchmarks/examples_gpu.py --gpus 1 [--examples tool_use code ...] [--max-steps 5] --out DIR

The configs name hub models; this host has no hub access, so each run overrides `--model.name` with a random-init
model of the config's shape whose tokenizer has Qwen3's full vocabulary (151,936 tokens) and its special tokens (so the
`qwen3` renderer, tool-call parsing and the vocabulary-sized log-softmax are what a real run pays): Qwen3-0.6B, and
for color_shapes Qwen3-VL-2B (`benchmarks/models/qwen3-vl-2b/config.json`, with Qwen3-VL's image preprocessing).
The tokenizer is a byte-level BPE trained on a few lines of text, padded with unreachable filler tokens to the
vocabulary size: any text encodes, and the LM head samples over all 151,936 ids. `--gpus 1` hides every GPU but the first (inference and
trainer colocate, docs/scaling.md#one-gpu). Writes <out>/examples_gpu_<n>gpu.json: per example the step wall times
(from metrics.jsonl, as benchmarks/rl_gpu.py reads them), trainer and rollout times, rewards and the exit code.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

EXAMPLES = ["reverse_text", "arithmetic", "guess_number", "tool_use", "code", "color_shapes"]
VISION_EXAMPLES = {"color_shapes"}
VL_SHAPE = ROOT / "benchmarks" / "models" / "qwen3-vl-2b" / "config.json"
VISION_TOKENS = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                 "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}  # fmt: skip


def full_vocab_tokenizer(vocab_size: int = 151936):
    """A byte-level BPE with Qwen3's special tokens, padded with filler tokens to exactly ``vocab_size``."""
    from prime_models.tiny import QWEN_VL_CHAT_TEMPLATE, QWEN_VL_SPECIAL_TOKENS, byte_bpe_tokenizer
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["reverse", "the", "text", "answer", "what", "is", "guess", "number", "def", "return", "tool", "result"]
    corpus = [" ".join(rng.choice(words) + str(rng.randint(0, 9999)) for _ in range(12)) for _ in range(2000)]
    small = byte_bpe_tokenizer(corpus, QWEN_VL_SPECIAL_TOKENS, chat_template=QWEN_VL_CHAT_TEMPLATE, vocab_size=2000)
    data = json.loads(small.backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for i in range(vocab_size - len(vocab)):  # no merge produces them: reachable only by sampling
        vocab[f"<fill{i}>"] = len(vocab)
    tok = Tokenizer.from_str(json.dumps(data))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN_VL_CHAT_TEMPLATE
    )


def vl_model_config(tokenizer) -> object:
    """Qwen3-VL-2B's shape with this tokenizer's vocabulary size and special ids."""
    from transformers import Qwen3VLConfig

    shape = json.loads(VL_SHAPE.read_text())
    text = {**shape["text_config"], "vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": tokenizer.eos_token_id}  # fmt: skip
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_TOKENS.items()}
    config = Qwen3VLConfig(text_config=text, vision_config=shape["vision_config"],
                           tie_word_embeddings=shape["tie_word_embeddings"], **ids)  # fmt: skip
    config.eos_token_id = tokenizer.eos_token_id
    return config


def save_vl_model(path: Path, tokenizer_dir: Path) -> dict:
    """A random-init bf16 Qwen3-VL-2B-shaped model, the tokenizer, and Qwen3-VL-2B-Instruct's image and video
    preprocessing (16-pixel patches, merge 2, images of 256x256 to 4096x4096 pixels), as vLLM's processor reads it."""
    import torch
    from prime_core.vision import ImageProcessor
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = vl_model_config(tokenizer)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    images = ImageProcessor(patch_size=16, merge_size=2, min_pixels=256 * 256, max_pixels=4096 * 4096).to_dict()
    (path / "preprocessor_config.json").write_text(json.dumps({**images, "processor_class": "Qwen3VLProcessor"}))
    video = {**images, "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
             "fps": 2, "min_frames": 4, "max_frames": 768, "do_sample_frames": True}  # fmt: skip
    del video["image_processor_type"]
    (path / "video_preprocessor_config.json").write_text(json.dumps(video))
    params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    return {"params": params, "vocab_size": len(tokenizer)}


def run_example(name: str, model_dir: Path, work: Path, args: argparse.Namespace) -> dict:
    from rl_gpu import summarize

    run = work / name
    rl = os.environ.get("PRIME_LAUNCH_BIN_DIR", str(Path(sys.executable).parent)) + "/rl"
    cmd = [rl, "@", str(ROOT / "examples" / name / "rl_gpu.toml"), "--model.name", str(model_dir),
           "--max-steps", str(args.max_steps), "--output-dir", str(run), "--overwrite", "--console", "logs",
           "--inference.server.port", str(random.randint(20000, 40000)), *args.extra]  # fmt: skip
    env = dict(os.environ)
    if args.gpus == 1:
        env["CUDA_VISIBLE_DEVICES"] = "0"
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    try:
        code = subprocess.run(cmd, cwd=ROOT, env=env, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    entry = {"example": name, "returncode": code, "wall_time_s": round(time.perf_counter() - start, 1)}
    if (run / "metrics.jsonl").is_file():
        entry.update(summarize(run / "metrics.jsonl"))
    for log in ("inference", "orchestrator", "trainer"):
        path = run / "logs" / f"{log}.log"
        if code != 0 and path.is_file():
            print(f"--- {name} {log}.log (tail)\n" + "\n".join(path.read_text().splitlines()[-25:]), flush=True)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, choices=[1, 2], default=1)
    parser.add_argument("--examples", nargs="+", default=EXAMPLES, choices=EXAMPLES)
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--timeout", type=float, default=420, help="seconds per example")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more `rl` arguments")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--commit", default=os.environ.get("PRIME_COMMIT"))
    args = parser.parse_args()

    import torch
    from weight_update_gpu import save_model

    work = Path(os.environ.get("PRIME_EXAMPLES_GPU_DIR", "/tmp/prime-examples-gpu"))
    tokenizer_dir, model_dir, vl_model_dir = work / "tokenizer", work / "model", work / "vl-model"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        full_vocab_tokenizer(args.vocab).save_pretrained(tokenizer_dir)
    models = {}
    if not (model_dir / "config.json").is_file() and set(args.examples) - VISION_EXAMPLES:
        models["Qwen3-0.6B"] = save_model(model_dir, "0.6b", tokenizer_dir=str(tokenizer_dir))
    if not (vl_model_dir / "config.json").is_file() and set(args.examples) & VISION_EXAMPLES:
        models["Qwen3-VL-2B"] = save_vl_model(vl_model_dir, tokenizer_dir)
    out = args.out / f"examples_gpu_{args.gpus}gpu.json"
    report = json.loads(out.read_text()) if out.is_file() else {"results": {}}
    report.update(
        benchmark="examples_rl_gpu", device=torch.cuda.get_device_name(0), gpus=args.gpus, commit=args.commit,
        vocab_size=args.vocab, max_steps=args.max_steps, models={"init": "random", "built": models},
    )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.examples:
        entry = run_example(name, vl_model_dir if name in VISION_EXAMPLES else model_dir, work, args)
        report["results"][name] = entry
        print(json.dumps(entry), flush=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
