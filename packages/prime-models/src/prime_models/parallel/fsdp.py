"""FSDP2 (`fully_shard`) applied per decoder layer, then to the root."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy


def default_mp_policy(device_type: str) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction on GPU; plain fp32 on CPU (CPU bf16 matmuls are slow and lossy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def apply_fsdp(
    model: nn.Module,
    layers: nn.ModuleList,
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    # Imported here: torch.distributed.fsdp pulls in DTensor and sympy, too heavy for `import prime_models`.
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs = dict(mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for i, layer in enumerate(layers):
        # The last layer's params are needed again right away in backward, so keeping them gathered saves a collective.
        fully_shard(layer, **{**kwargs, "reshard_after_forward": reshard_after_forward and i < len(layers) - 1})
    fully_shard(model, **kwargs)
    return model
