"""One `ModelSpec` per family, keyed by HF `model_type`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from prime_models.models.llama import converting_llama
from prime_models.models.llama.modeling_llama import LlamaForCausalLM
from prime_models.models.qwen3 import converting_qwen3
from prime_models.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM
from prime_models.models.qwen3_moe import converting_qwen3_moe
from prime_models.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM
from prime_models.models.qwen3_vl import converting_qwen3_vl
from prime_models.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration
from prime_models.models.transformer import CausalLM, TransformerArgs
from prime_models.parallel.parallelize import parallelize_transformer


@dataclass(frozen=True)
class ModelSpec:
    """Everything prime needs to build, convert and parallelize one family.

    Attributes:
        model_type: HF `model_type` in config.json.
        hf_config_class_name: class in `transformers` for the config (imported lazily; see `config_class`).
        hf_architecture: `architectures[0]` written to config.json so transformers opens the saved dir.
        model_cls: our single-device model class.
        from_hf: full HF state dict -> our state dict.
        to_hf: one of our (name, tensor) -> HF (name, tensor) pairs; streaming so FSDP can gather one param at a time.
        parallelize_fn: applies activation checkpointing and FSDP2 (see `prime_models.parallel`).
    """

    model_type: str
    hf_config_class_name: str
    hf_architecture: str
    model_cls: type[CausalLM]
    from_hf: Callable[[dict[str, torch.Tensor], TransformerArgs], dict[str, torch.Tensor]]
    to_hf: Callable[[str, torch.Tensor, TransformerArgs], Iterator[tuple[str, torch.Tensor]]]
    parallelize_fn: Callable[..., CausalLM]

    @property
    def config_class(self) -> type:
        import transformers

        return getattr(transformers, self.hf_config_class_name)


_REGISTRY: dict[str, ModelSpec] = {}


def register_model_spec(spec: ModelSpec) -> None:
    if spec.model_type in _REGISTRY:
        raise ValueError(f"model_type {spec.model_type!r} is already registered")
    _REGISTRY[spec.model_type] = spec


def known_model_types() -> list[str]:
    return sorted(_REGISTRY)


def get_model_spec(model_type: str) -> ModelSpec:
    if model_type not in _REGISTRY:
        raise ValueError(f"unknown model_type {model_type!r}; known model types: {', '.join(known_model_types())}")
    return _REGISTRY[model_type]


def spec_for_model(model: Any) -> ModelSpec:
    return get_model_spec(type(model).model_type)


register_model_spec(
    ModelSpec(
        "llama",
        "LlamaConfig",
        "LlamaForCausalLM",
        LlamaForCausalLM,
        converting_llama.from_hf,
        converting_llama.to_hf,
        parallelize_transformer,
    )
)
register_model_spec(
    ModelSpec(
        "qwen3",
        "Qwen3Config",
        "Qwen3ForCausalLM",
        Qwen3ForCausalLM,
        converting_qwen3.from_hf,
        converting_qwen3.to_hf,
        parallelize_transformer,
    )
)
register_model_spec(
    ModelSpec(
        "qwen3_moe",
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        Qwen3MoeForCausalLM,
        converting_qwen3_moe.from_hf,
        converting_qwen3_moe.to_hf,
        parallelize_transformer,
    )
)
# The ViT stays in the root FSDP group (gathered with the embeddings), so ranks whose micro-batch has no image
# issue the same collectives as ranks that run it.
register_model_spec(
    ModelSpec(
        "qwen3_vl",
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        Qwen3VLForConditionalGeneration,
        converting_qwen3_vl.from_hf,
        converting_qwen3_vl.to_hf,
        parallelize_transformer,
    )
)
