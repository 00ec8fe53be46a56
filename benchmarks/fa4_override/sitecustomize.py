"""Benchmark-only: FA4's sm90 backward configuration replaced in a whole trainer job, so a configuration that
`benchmarks/fa4_tiles.py` found faster for one kernel call can be measured in the trainer's step.

With this directory first on PYTHONPATH and ``PRIME_BENCH_FA4_BWD`` set to a JSON object of `BwdConfig` fields to
change (a row's ``change`` in the sweep's record), every process of the job answers FA4's sm90 backward table with
it. Without the variable nothing is imported.
"""

import json
import os

_CHANGE = os.environ.get("PRIME_BENCH_FA4_BWD")
if _CHANGE:
    import dataclasses

    from flash_attn.cute import interface as _fa4

    _own = _fa4._tile_size_bwd_sm90

    def _replaced(head_dim, head_dim_v, causal, local, sparse_block_size_q=None):
        cfg = _own(head_dim, head_dim_v, causal, local, sparse_block_size_q=sparse_block_size_q)
        if head_dim == 128 and head_dim_v == 128 and causal:
            return dataclasses.replace(cfg, **json.loads(_CHANGE))
        return cfg

    _fa4._tile_size_bwd_sm90 = _replaced
