"""Build the trainer's model (prime_models family + its parallelize function) and run the log-prob forward.

Shape legend: R rows of a micro-batch, S sequence length.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from prime_core.config import ConfigError
from prime_core.config.shared import Fp8Config, LoRAConfig, ModelConfig
from prime_core.config.trainer import ModelInitConfig, ParallelConfig
from prime_core.io import UnreadableFile, read_json
from prime_models import get_model_spec, load_model
from prime_models.layers.attention import RowPacking, use_row_packing
from prime_models.loading import ModelTooLarge, resolve_attn
from prime_models.parallel.context_parallel import ContextParallel
from torch import nn
from torch.distributed.fsdp import FSDPModule

from prime_trainer.parallel import TrainerLayout, parallel_dims, validate_cuda_graphs, validate_model
from prime_trainer.world import World

logger = logging.getLogger("prime.trainer")


@dataclass
class ModelSource:
    """Where the model came from: its HF config (as a dict) and the directory to copy tokenizer files from."""

    hf_config: dict
    tokenizer: str
    random_init: bool
    """True when the weights are randomly initialized (no checkpoint on disk holds them)."""
    model_dir: str = ""
    """Local directory of the model (its config.json; a hub id is resolved to its snapshot)."""

    @property
    def vocab_size(self) -> int:
        """The language model's vocabulary (vision-language configs nest it under ``text_config``)."""
        return int(self.hf_config.get("vocab_size") or self.hf_config["text_config"]["vocab_size"])


def resolve_source(name: str, init: ModelInitConfig) -> tuple[object, ModelSource]:
    """What to pass to ``load_model`` (a dir for real weights, a config dict for random init) and the source."""
    path = Path(name).expanduser()
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]))
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"model {name!r}: no config.json in {path}")
    hf_config = read_json(config_file, "a model config")
    if not isinstance(hf_config, dict):
        raise UnreadableFile(f"{config_file}: not a model config (a JSON object)")
    hf_config = {**hf_config, **init.config_overrides}
    tokenizer = init.tokenizer or str(path)
    has_weights = any(path.glob("*.safetensors"))
    if init.config_overrides and has_weights and not init.random:
        raise ConfigError("init.config_overrides change the architecture: use them with init.random")
    random_init = init.random or not has_weights
    if not init.random and not has_weights:
        logger.warning("model %s has no safetensors weights: initializing randomly", name)
    return (hf_config if random_init else path), ModelSource(hf_config, tokenizer, random_init, str(path))


def build_model(
    name: str,
    dtype: str,
    init: ModelInitConfig,
    parallel: ParallelConfig,
    world: World,
    seed: int,
    *,
    lora: LoRAConfig | None = None,
    adapters: Sequence[str] = (),
    fp8: Fp8Config | None = None,
    layout: TrainerLayout | None = None,
    seq_len: int | None = None,
) -> tuple[nn.Module, ModelSource]:
    """Load (or randomly init) the model on this rank's device and apply AC + FSDP2 through the family's spec.

    With ``lora``, the adapters (default: one named ``lora.adapter_name``) are injected and the base frozen before
    parallelizing, so FSDP shards base and adapters alike and only adapters get gradients. With ``fp8`` (a recipe other
    than ``none``), the parallelize function first swaps the decoder's linears for FP8 ones (`prime_models.quantization.float8`).
    ``layout`` (`prime_trainer.parallel.build_layout`) adds expert and context parallelism; without it the world is
    one FSDP/HSDP data-parallel group (``parallel.dp_shard``). ``seq_len`` is checked against the CP split.
    """
    target, source = resolve_source(name, init)
    if layout is None:
        layout = TrainerLayout(parallel_dims(world, parallel, ModelConfig(name=name)), None)
    dims = layout.dims
    validate_model(dims, source.hf_config, seq_len)
    validate_cuda_graphs(parallel, world, source.hf_config)
    torch_dtype = {"auto": torch.float32, "float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ConfigError(f"model.dtype={dtype!r} is not supported for training (use auto, float32 or bfloat16)")
    # CUDA graphs need SDPA (flash-attn's cu_seqlens vary per micro-batch): "auto" picks it for them.
    attn = "sdpa" if parallel.cuda_graphs and init.attn == "auto" else init.attn
    try:
        attn = resolve_attn(attn, world.device, row_len=seq_len // dims.cp if seq_len else None)
    except ValueError as e:  # a kernel that is not installed, or needs a GPU
        raise ConfigError(f"init.attn: {e}") from None
    try:
        model = load_model(target, dtype=torch_dtype, device=world.device, attn=attn, seed=seed)
    except ModelTooLarge as e:  # its config names no file when the weights are random (a dict is loaded)
        raise ConfigError(f"model.name {name}: {e}") from None
    if lora is not None:
        from prime_models.lora import LoRASpec, apply_lora

        apply_lora(model, LoRASpec.from_config(lora), list(adapters) or [lora.adapter_name], seed=seed)
    if init.freeze_vision:
        if not hasattr(model, "freeze_vision"):
            raise ConfigError(f"init.freeze_vision: {name} ({source.hf_config['model_type']}) has no vision tower")
        model.freeze_vision()
    return _parallelize(model, source, parallel, layout, fp8), source


def _parallelize(
    model: nn.Module,
    source: ModelSource,
    parallel: ParallelConfig,
    layout: TrainerLayout,
    fp8: Fp8Config | None,
) -> nn.Module:
    """The family's parallelize function: FP8, EP, CP, AC, then FSDP2 over several ranks or, on one GPU, bf16 compute
    on a working copy of the fp32 masters (`prime_models.parallel.mixed_precision`), optionally replayed from CUDA
    graphs (``parallel.cuda_graphs``). ``parallel.ac = "auto"`` leaves
    checkpointing to the first step (`prime_trainer.memory`), when a micro-batch's size is known."""
    spec = get_model_spec(source.hf_config["model_type"])
    return spec.parallelize_fn(
        model,
        layout.dims,
        ac="none" if parallel.ac == "auto" else parallel.ac,
        ac_every=parallel.ac_every,
        ac_keep_attention=parallel.ac_keep_attention,
        ac_mlp_chunks=parallel.ac_mlp_chunks,
        ac_offload_attention=parallel.ac_offload_attention,
        cpu_offload=parallel.cpu_offload,
        reshard_after_forward=parallel.reshard_after_forward,
        fp8=fp8,
        mesh=layout.mesh,
        dispatcher=layout.ep_dispatcher,
        one_rank_fsdp=parallel.fsdp_one_rank,
        compile_layers=parallel.compile_layers,
        cuda_graphs=parallel.cuda_graphs,
    )


def loss_scale(model: nn.Module, world: World) -> float:
    """Factor undoing FSDP's gradient averaging over data-parallel ranks.

    Losses are already divided by the global token (or sample) count, so rank gradients must be summed. FSDP averages
    them; scaling the loss by the world size instead of ``set_gradient_divide_factor(1)`` also works on gloo, which
    lacks the PREMUL_SUM reduction that the divide factor needs.
    """
    return float(world.world_size) if isinstance(model, FSDPModule) else 1.0


def token_logprobs(
    model: nn.Module,
    input_ids_RS: torch.Tensor,
    position_ids_RS: torch.Tensor,
    *,
    temperature: float,
    chunk_size: int,
    entropy_grad: bool,
    return_entropy: bool = True,
    multimodal: dict[str, torch.Tensor] | None = None,
    context_parallel: ContextParallel | None = None,
    packing: RowPacking | None = None,
    head_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every token given its prefix, and the entropy of the distribution that predicted it.

    Position t holds the values for token t, predicted from position t - 1; position 0 holds 0 (never a loss token).
    ``multimodal`` holds a vision-language model's image inputs (``pixel_values``, ``image_grid_thw``,
    ``mrope_position_ids``), passed through to its forward. With ``context_parallel`` every rank of the CP group passes
    the same full rows, runs the model on its share of each row and gets the full rows' values back (differentiable).
    ``packing``: where the rows' samples start, computed on the host (`TensorMicroBatch.packing`), so that attention
    reads nothing back from the device. ``head_positions`` (`TensorMicroBatch.head_positions`): only these flat
    positions go through the LM head; every loss token's value is among them, other tokens may hold 0. Ignored under
    context parallelism.
    """
    targets_RS = torch.roll(input_ids_RS, shifts=-1, dims=1)
    kwargs = dict(temperature=temperature, chunk_size=chunk_size, return_entropy=return_entropy)
    if context_parallel is None:
        with use_row_packing(packing):
            lp_RS, ent_RS = model(input_ids_RS, position_ids_RS, targets=targets_RS, head_positions=head_positions,
                                  **kwargs, **(multimodal or {}))  # fmt: skip
    else:
        if multimodal:
            raise ValueError("model.cp > 1 does not support image inputs (vision-language rows)")
        shard = context_parallel.shard(position_ids_RS)
        with shard:
            lp, ent = model(
                shard.split(input_ids_RS), shard.split(position_ids_RS), targets=shard.split(targets_RS), **kwargs
            )
        lp_RS = shard.gather(lp)
        # Gathering a detached entropy keeps its all-gather out of the backward.
        ent_RS = None if ent is None else shard.gather(ent if entropy_grad else ent.detach())
    zero = lp_RS.new_zeros(lp_RS.shape[0], 1)
    lp_RS = torch.cat([zero, lp_RS[:, :-1]], dim=1)
    if ent_RS is None:
        return lp_RS, None
    if not entropy_grad:
        ent_RS = ent_RS.detach()
    return lp_RS, torch.cat([zero, ent_RS[:, :-1]], dim=1)
