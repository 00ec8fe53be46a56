"""Inference and trainer on the same GPUs: vLLM's share of the memory, the check that the trainer fits in the rest,
and how weights travel (through GPU memory on one GPU, by files over several: an NCCL group cannot hold two ranks on
one GPU, so the trainer cannot broadcast to vLLM).

Pure arithmetic on the facts ``prime_launch.host`` gathered (the GPU's memory, the model's size and config).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

from prime_core.config.inference import InferenceConfig
from prime_core.config.rl import DevicesConfig
from prime_core.config.trainer import TrainerConfig

GIB = 1024**3


def config_params(config: Mapping[str, Any]) -> int:
    """Parameters of a decoder (dense or MoE; a vision-language model's tower roughly) from its HF config; norms and
    biases, well under 1%, are left out."""
    text = config.get("text_config") or config
    h, heads = text["hidden_size"], text["num_attention_heads"]
    kv, d = text.get("num_key_value_heads") or heads, text.get("head_dim") or h // heads
    experts = text.get("num_experts") or text.get("n_routed_experts") or 0
    if experts:
        mlp = experts * 3 * h * (text.get("moe_intermediate_size") or text["intermediate_size"]) + experts * h
    else:
        mlp = 3 * h * text["intermediate_size"]
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    total = text["num_hidden_layers"] * (2 * h * heads * d + 2 * h * kv * d + mlp) + text["vocab_size"] * h * (
        1 if tied else 2
    )
    vision = config.get("vision_config") or {}
    if vision.get("hidden_size"):
        vh = vision["hidden_size"]
        total += vision.get("depth", 0) * (4 * vh * vh + 2 * vh * vision.get("intermediate_size", 4 * vh))
    return total


def activation_bytes(config: Mapping[str, Any], trainer: TrainerConfig, tokens: int) -> int:
    """bf16 activations one forward keeps for its backward, over ``tokens`` tokens (a micro-batch's rows on one rank).

    Without checkpointing a decoder layer keeps about 2 x (12 h + 5 i) bytes per token (the inputs of its norms,
    projections, attention and MLP matmuls; h hidden, i the MLP's intermediate width, an MoE's routed width). For the
    Qwen3-0.6B shape that is 1.55 MB a token; one H100 measured 1.44 (a micro-batch of 8 rows of 2048 tokens peaked at
    34.5 GiB, one row at 13.9: benchmarks/results/trainer_gpu_rl2k_*).
    Full checkpointing keeps each layer's input and recomputes one layer at a time; ``selective`` with ``ac_every = k``
    recomputes every k-th layer (``k = 0`` is counted as none). ``auto`` (the default) is counted as full: the trainer
    then checkpoints as much as its share needs (`prime_trainer.memory`), full checkpointing at most."""
    text = config.get("text_config") or config
    h, layers = text["hidden_size"], text["num_hidden_layers"]
    width = text.get("intermediate_size") or 0
    if text.get("num_experts") or text.get("n_routed_experts"):
        width = (text.get("moe_intermediate_size") or width) * (text.get("num_experts_per_tok") or 1)
    per_layer = 2 * (12 * h + 5 * width)
    ac = trainer.parallel.ac
    if ac in ("full", "auto"):
        per_token = layers * 2 * h + per_layer
    elif ac == "selective" and trainer.parallel.ac_every:
        full = layers // trainer.parallel.ac_every
        per_token = (layers - full) * per_layer + full * 2 * h
    else:
        per_token = layers * per_layer
    return tokens * per_token


def trainer_bytes_per_param(trainer: TrainerConfig) -> int:
    """GPU bytes per parameter the trainer keeps: the bf16 copy it computes with, its master weights (fp32 unless
    ``model.dtype = bfloat16``) and, for trained weights, a gradient and Adam's two moments in the master dtype.
    LoRA trains adapters only (their states are in the margin); CPU offload keeps all but the bf16 copy on the host."""
    master = 2 if trainer.model.dtype in ("bfloat16", "float16") else 4
    states = master if trainer.model.lora is not None else 4 * master
    return 2 + (0 if trainer.parallel.cpu_offload else states)


@dataclass
class Shares:
    """How one shared GPU's memory is split (bytes; ``total`` None when unknown)."""

    inference_fraction: float
    trainer_fraction: float
    total: int | None
    num_params: int | None
    trainer_need: int | None
    """The trainer's estimated peak on one of its GPUs (states sharded over its ranks, a micro-batch's activations,
    plus the margin)."""
    activations: int = 0
    """The part of ``trainer_need`` that is a micro-batch's activations."""

    def describe(self, role: str) -> str:
        """For the plan: the role's share of the GPU's memory (and, for the trainer, its estimated need)."""
        fraction = self.inference_fraction if role == "inference" else self.trainer_fraction
        text = f"shared, {'vLLM ' if role == 'inference' else ''}{fraction:g} of its memory"
        details = [f"{fraction * self.total / GIB:.1f} of {self.total / GIB:.1f} GiB"] if self.total else []
        if role == "trainer" and self.trainer_need is not None:
            details.append(f"needs ~{self.trainer_need / GIB:.1f} GiB")
        return f"{text} ({'; '.join(details)})" if details else text


def _millions(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"


def gpu_memory_of(gpus: list[int], memory: Mapping[int, int]) -> int | None:
    """Memory of the smallest of ``gpus`` (bytes by ``nvidia-smi`` index); None when unknown. ``nvidia-smi`` numbers
    GPUs in PCI order, CUDA_VISIBLE_DEVICES in CUDA's: ids it does not list fall back to the smallest GPU."""
    if not memory:
        return None
    return min(memory[g] for g in gpus) if all(g in memory for g in gpus) else min(memory.values())


def check_fit(
    devices: DevicesConfig,
    trainer: TrainerConfig,
    num_trainer_ranks: int,
    gpus: list[int],
    gpu_memory: Mapping[int, int],
    num_params: int | None,
    config: Mapping[str, Any] | None,
    micro_batch_tokens: int,
) -> Shares:
    """The memory split of a shared GPU; ``ValueError`` when the trainer's estimate exceeds its share or vLLM's
    share cannot hold the bf16 weights. ``gpu_memory``: bytes by GPU index; ``num_params`` and ``config``: the
    trainer's model (None: unknown); ``micro_batch_tokens``: tokens of one micro-batch (rows x row length)."""
    inference_fraction = devices.inference_memory_fraction
    trainer_fraction = devices.trainer_memory_fraction or round(1.0 - inference_fraction, 6)
    gib = devices.gpu_memory_gib
    total = int(gib * GIB) if gib is not None else gpu_memory_of(gpus, gpu_memory)
    shares = Shares(inference_fraction, trainer_fraction, total, num_params, None)
    if num_params is None:
        return shares
    shards = num_trainer_ranks if trainer.parallel.dp_shard == -1 else trainer.parallel.dp_shard
    per_param = trainer_bytes_per_param(trainer)
    margin = devices.trainer_memory_margin_gib * GIB
    with suppress(KeyError, TypeError):
        # Context parallelism splits every row over cp ranks.
        tokens = micro_batch_tokens // trainer.model.cp
        shares.activations = activation_bytes(config, trainer, tokens) if config else 0
    shares.trainer_need = int(num_params * per_param / shards + shares.activations + margin)
    if total is None:
        return shares
    budget = trainer_fraction * total
    more = "lower devices.inference_memory_fraction"
    if devices.trainer_memory_fraction is not None:
        more = "raise devices.trainer_memory_fraction (lowering devices.inference_memory_fraction to match)"
    if shares.trainer_need > budget:
        raise ValueError(
            f"the trainer does not fit beside vLLM on GPU {gpus[0]}: it needs ~{shares.trainer_need / GIB:.1f} GiB "
            f"({_millions(num_params)} parameters x {per_param} bytes{f' / {shards} ranks' if shards > 1 else ''} + "
            f"{shares.activations / GIB:.1f} GiB of activations for {micro_batch_tokens} tokens a micro-batch + "
            f"devices.trainer_memory_margin_gib {devices.trainer_memory_margin_gib:g}) but gets {budget / GIB:.1f} GiB "
            f"of {total / GIB:.1f} GiB (devices.trainer_memory_fraction {trainer_fraction:g}, "
            f"devices.inference_memory_fraction {inference_fraction:g}); {more}, lower orchestrator.micro_batch_rows "
            "or set trainer.parallel.ac, train a smaller model or a LoRA (model.lora), or give each role its own GPU "
            "(devices.colocate = false)"
        )
    if num_params * 2 > inference_fraction * total:
        raise ValueError(
            f"vLLM's share of GPU {gpus[0]} (devices.inference_memory_fraction {inference_fraction:g} = "
            f"{inference_fraction * total / GIB:.1f} GiB) cannot hold the model's bf16 weights "
            f"({num_params * 2 / GIB:.1f} GiB); raise it or give each role its own GPU (devices.colocate = false)"
        )
    return shares


def sharing_notes(
    shares: Shares, trainer: TrainerConfig, inference: InferenceConfig, utilization_given: bool
) -> list[str]:
    """What a colocated plan changes in the configs, and what it could not check. ``utilization_given``: the user set
    ``inference.vllm.gpu_memory_utilization``."""
    notes = []
    given = inference.vllm.gpu_memory_utilization
    if utilization_given and given != shares.inference_fraction:
        notes.append(
            f"inference: gpu_memory_utilization {shares.inference_fraction:g} instead of {given:g} "
            "(devices.inference_memory_fraction, as the GPU is shared)"
        )
    if inference.engine == "torch":
        notes.append(
            "inference: the torch engine takes no memory fraction (its KV cache holds max_batch_size x max_model_len tokens)"
        )
    if shares.total is None:
        notes.append("trainer memory not checked: nvidia-smi cannot tell the GPU's memory (set devices.gpu_memory_gib)")
    elif shares.num_params is None:
        notes.append(f"trainer memory not checked: no weights or config.json of {trainer.model.name!r} here to size it")
    return notes


def shared_gpu_transport(configured: str, user_set: bool, one_gpu: bool, multi_run: bool) -> tuple[str, str | None]:
    """The weight transport of a colocated run (``trainer.weights.broadcast.type``) and a note saying why, when it is
    not the configured one. ``one_gpu``: the trainer's only rank and the server's only worker share one GPU;
    ``multi_run``: several LoRA runs (``runs``) publish adapters side by side, which a one-time transport does not serve
    (also set for a LoRA run on vLLM, which does not take adapters over CUDA IPC yet).

    On one GPU the weights go through its memory (``cuda_ipc``): the default there, and what an ``nccl`` setting
    becomes; a user's ``filesystem`` or ``cuda_ipc`` stays. Elsewhere ``nccl`` becomes files. (An NCCL group cannot
    hold two ranks on one GPU.)"""
    if one_gpu and not multi_run and (configured == "nccl" or not user_set):
        why = "an NCCL broadcast cannot hold trainer and vLLM on one GPU" if configured == "nccl" else "they share it"
        return "cuda_ipc", f"weights: through the GPU's memory (CUDA IPC handles, no files), as {why}"
    if configured == "nccl":
        return (
            "filesystem",
            "weights: by files (weights/step_N), as an NCCL broadcast cannot hold trainer and vLLM on one GPU",
        )
    return configured, None
