"""FSDP2 (`fully_shard`) applied per decoder layer, then to the root.

Under expert parallelism each MoE layer's experts get an FSDP unit of their own on the expert mesh first (their
weights are already sharded over `ep`), so the layer's unit on the dense mesh leaves them alone.
"""

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
    expert_mesh: DeviceMesh | None = None,
    gradient_divide_factor: float | None = None,
) -> nn.Module:
    """Shard `layers` and then `model` over `mesh`.

    Args:
        expert_mesh: with expert parallelism, the mesh of the ranks holding the same experts; each MoE layer's
            `mlp.experts` is then sharded over it.
        gradient_divide_factor: what the expert units divide their reduced gradients by. Dense gradients are averaged
            over the dense mesh; the experts' mesh is `ep` times smaller, so they must divide by the dense size too
            for expert and dense gradients to carry the same scale.
    """
    # Imported here: torch.distributed.fsdp pulls in DTensor and sympy, too heavy for `import prime_models`.
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kwargs = dict(mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for i, layer in enumerate(layers):
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if expert_mesh is not None and experts is not None:
            reshard = reshard_after_forward and i < len(layers) - 1
            fully_shard(experts, **{**kwargs, "mesh": expert_mesh, "reshard_after_forward": reshard})
            if gradient_divide_factor is not None:
                experts.set_gradient_divide_factor(gradient_divide_factor)
                # Gloo has no pre-multiplied sum: use plain sums and a separate division there. Not on a one-rank shard
                # group, where torch (2.11) would then divide twice.
                shard_group_size = expert_mesh.shape[-1]
                experts.set_force_sum_reduction_for_comms(expert_mesh.device_type == "cpu" and shard_group_size > 1)
        # The last layer's params are needed again right away in backward, so keeping them gathered saves a collective.
        fully_shard(layer, **{**kwargs, "reshard_after_forward": reshard_after_forward and i < len(layers) - 1})
    fully_shard(model, **kwargs)
    return model
