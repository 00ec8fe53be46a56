"""The process group an expert dispatcher runs over: what the all-to-all (`expert_parallel`) and DeepEP (`deepep`)
dispatchers share."""

from __future__ import annotations

import torch.distributed as dist


class ExpertGroup:
    """An expert-parallel process group holding ``num_experts / ep`` experts on each rank (rank-major layout)."""

    def __init__(self, group: dist.ProcessGroup, num_experts: int):
        self.group = group
        self.num_ranks = dist.get_world_size(group)
        if num_experts % self.num_ranks:
            raise ValueError(f"ep={self.num_ranks} must divide the number of experts ({num_experts})")
        self.num_experts = num_experts
        self.num_local = num_experts // self.num_ranks
