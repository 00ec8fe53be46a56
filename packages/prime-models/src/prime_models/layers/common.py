"""Norm, rotary embedding and gated MLP.

Shape legend: B batch, S sequence, H hidden, N heads, D head dim, I intermediate.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from prime_models.kernels import cuda_compiled

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(name: str):
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; known: {sorted(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


@cuda_compiled
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalize in fp32 and cast back before scaling, exactly as HF does, so bf16 numerics match.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


_DYNAMIC_ROPE = {"dynamic", "longrope"}


def rope_inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling factor for the config's RoPE type."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if rope_type == "default":
        # Computed on the CPU, then moved to the default device: a meta `arange` (a model built on the meta device)
        # runs a Python kernel whose first call imports dynamo and sympy, seconds of every process's start-up.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim
        return (1.0 / (theta**exponents)).to(torch.get_default_device()), 1.0
    if rope_type in _DYNAMIC_ROPE:
        raise ValueError(f"rope_type {rope_type!r} rescales with sequence length and is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unknown rope_type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) `[B, S, D]` for given position ids; the table is a non-persistent buffer."""

    def __init__(self, hf_config: Any, head_dim: int):
        super().__init__()
        self.hf_config = hf_config
        self.head_dim = head_dim
        inv_freq, self.scaling = rope_inv_freq(hf_config, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def reset_parameters(self) -> None:
        # Buffers built on the meta device must be recomputed after `to_empty`.
        inv_freq, self.scaling = rope_inv_freq(self.hf_config, self.head_dim)
        self.inv_freq = inv_freq.to(self.inv_freq.device)

    @torch.no_grad()
    def forward(self, position_ids_BS: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids_BS[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


@cuda_compiled
def apply_rotary(x_BSND: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor) -> torch.Tensor:
    cos, sin = cos_BSD.unsqueeze(2), sin_BSD.unsqueeze(2)
    return x_BSND * cos + _rotate_half(x_BSND) * sin


class MLP(nn.Module):
    """SwiGLU feed-forward: down(act(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = activation(act)
        self.act_name = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gated_act(self.gate_proj(x), self.up_proj(x), self.act_name))


@cuda_compiled
def gated_act(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    return activation(act)(gate) * up
