"""Qwen3-MoE <-> HF state dict.

HF checkpoints store one matrix per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`); we keep HF's in-memory fused
layout (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`). Checkpoints already in the fused
layout are accepted unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from prime_models.models.common_converting import dense_from_hf, dense_to_hf

_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def from_hf(hf_state: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in hf_state.items():
        m = _EXPERT_KEY.match(name)
        if m is None:
            state[name] = tensor
            continue
        prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
        per_expert.setdefault(prefix, {}).setdefault(proj, {})[expert] = tensor
    for prefix, projs in per_expert.items():
        stacked = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            experts = projs.get(proj, {})
            if sorted(experts) != list(range(args.num_experts)):
                raise ValueError(f"{prefix}: expected {args.num_experts} experts for {proj}, found {sorted(experts)}")
            stacked[proj] = torch.stack([experts[e] for e in range(args.num_experts)])
        state[f"{prefix}.gate_up_proj"] = torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1)
        state[f"{prefix}.down_proj"] = stacked["down_proj"]
    return dense_from_hf(state, tie_word_embeddings=args.tie_word_embeddings)


def to_hf(name: str, tensor: torch.Tensor, args) -> Iterator[tuple[str, torch.Tensor]]:
    if name.endswith("mlp.experts.gate_up_proj"):
        prefix = name[: -len(".gate_up_proj")]
        gate, up = tensor.split(args.moe_intermediate_size, dim=1)
        for e in range(tensor.shape[0]):
            yield f"{prefix}.{e}.gate_proj.weight", gate[e].contiguous()
            yield f"{prefix}.{e}.up_proj.weight", up[e].contiguous()
    elif name.endswith("mlp.experts.down_proj"):
        prefix = name[: -len(".down_proj")]
        for e in range(tensor.shape[0]):
            yield f"{prefix}.{e}.down_proj.weight", tensor[e].contiguous()
    else:
        yield from dense_to_hf(name, tensor, tie_word_embeddings=args.tie_word_embeddings)
