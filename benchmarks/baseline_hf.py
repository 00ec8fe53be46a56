"""Baseline for the GPU trainer benchmarks: a Hugging Face transformers step under FSDP2 on the same inputs.

    python benchmarks/baseline_hf.py --model benchmarks/models/qwen3-0.6b --seq-len 16384 [--liger] [--ac] --out r.json

Random-init `AutoModelForCausalLM.from_config` (SDPA attention), fp32 master weights, FSDP2 `fully_shard` per decoder
layer and at the root with bf16 compute / fp32 gradient reduction (as the anchors were measured), AdamW (fused on
CUDA, like the trainer), grad-norm clipping at 1.0. One row of `--seq-len` random tokens (one sample, as the trainer's
fake data), `--steps` steps of which the first is warmup. `--liger` computes the loss with liger-kernel's fused
linear cross-entropy on the final hidden states (no `[tokens, vocab]` logits); `--ac` turns on HF's full activation
checkpointing (non-reentrant). Writes tokens/s, MFU (prime_models.flops_per_token) and peak memory as JSON.
`--device cpu` runs the same on CPU over gloo, fp32, for smoke tests of the benchmark's plumbing (no liger there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def liger_flce():
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss()
    except Exception:  # liger's transformers integration may not import against this transformers version
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        return lambda w, h, y: LigerFusedLinearCrossEntropyFunction.apply(h, w, y)[0]


class LossModel(nn.Module):
    """Wraps the HF model so the whole loss runs inside the FSDP root's forward (tied head gathered there)."""

    def __init__(self, hf_model: nn.Module, liger: bool):
        super().__init__()
        self.hf = hf_model
        self.flce = liger_flce() if liger else None

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.flce is None:
            return self.hf(input_ids=input_ids, labels=labels, use_cache=False).loss
        hidden = self.hf.model(input_ids=input_ids, use_cache=False).last_hidden_state
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        return self.flce(self.hf.lm_head.weight, h, labels[:, 1:].reshape(-1))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--liger", action="store_true")
    ap.add_argument("--ac", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages/prime-models/src"))
    from prime_models import flops_per_token

    on_cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.model)
    with device:
        hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    if args.ac:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = LossModel(hf, args.liger)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if on_cuda else torch.float32, reduce_dtype=torch.float32)
    layers = hf.model.layers
    for i, layer in enumerate(layers):
        fully_shard(layer, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01, fused=on_cuda or None)

    gen = torch.Generator().manual_seed(args.seed)
    times, peaks = [], []
    status = "ok"
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (1, args.seq_len), generator=gen).to(device)
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        sync()
        t0 = time.perf_counter()
        try:
            loss = model(ids, ids)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            float(loss)
        except torch.OutOfMemoryError:
            status = "oom"
            peaks.append(torch.cuda.max_memory_allocated(device) / 2**30)
            break
        sync()
        times.append(time.perf_counter() - t0)
        peaks.append(torch.cuda.max_memory_allocated(device) / 2**30 if on_cuda else 0.0)
        print(
            f"step {step}: {times[-1]:.3f}s {args.seq_len / times[-1]:.0f} tok/s peak {peaks[-1]:.2f} GiB", flush=True
        )

    measured = times[1:] if len(times) > 1 else times
    tps = args.seq_len / statistics.fmean(measured) if measured and status == "ok" else None
    fpt = flops_per_token(args.model, args.seq_len)
    result = {
        "benchmark": "baseline_hf" + ("_liger" if args.liger else "") + ("_ac" if args.ac else ""),
        "status": status,
        "seq_len": args.seq_len,
        "device": torch.cuda.get_device_name(device) if on_cuda else "cpu",
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "liger": args.liger,
        "activation_checkpointing": args.ac,
        "tokens_per_s": tps,
        "mfu": 100.0 * fpt * tps / 989e12 if tps and on_cuda else None,
        "step_time_s": statistics.fmean(measured) if measured and status == "ok" else None,
        "peak_memory_gib": max(peaks) if peaks else None,
        "steps_measured": len(measured),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
