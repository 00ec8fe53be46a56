"""Dense, MoE and VLM model families with HF conversion, fused log-prob head and FSDP2 parallelize functions."""

__version__ = "0.1.0"

from prime_models.checkpoint import hf_state_dict, save_hf
from prime_models.flops import ParamCounts, attention_flops_per_token, count_params, flops_per_token
from prime_models.fused_head import fused_logprobs
from prime_models.loading import load_model
from prime_models.models.transformer import CausalLM, TransformerArgs
from prime_models.parallel import ParallelDims, apply_activation_checkpointing, apply_fsdp
from prime_models.registry import ModelSpec, get_model_spec, known_model_types, register_model_spec

__all__ = [
    "CausalLM",
    "ModelSpec",
    "ParallelDims",
    "ParamCounts",
    "TransformerArgs",
    "apply_activation_checkpointing",
    "apply_fsdp",
    "attention_flops_per_token",
    "count_params",
    "flops_per_token",
    "fused_logprobs",
    "get_model_spec",
    "hf_state_dict",
    "known_model_types",
    "load_model",
    "register_model_spec",
    "save_hf",
]
