"""Benchmark-only: FA4's sm90 backward configuration replaced in a whole trainer job, so a configuration that
`benchmarks/fa4_tiles.py` found faster for one kernel call can be measured in the trainer's step.

With this directory first on PYTHONPATH and ``PRIME_BENCH_FA4_BWD`` set to a JSON object of `BwdConfig` fields to
change (a row's ``change`` in the sweep's record), every process of the job answers FA4's sm90 backward table with
it. Without the variable nothing is imported. ``PRIME_BENCH_FA4_LONG_ROW_TOKENS`` moves the trainer's own switch to
long-row backward tiles (`prime_models.layers.flash_attn4.LONG_ROW_TOKENS`), to measure the step without them.
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

_LONG_ROW = os.environ.get("PRIME_BENCH_FA4_LONG_ROW_TOKENS")
if _LONG_ROW:  # the trainer's own long-row backward tiles from another row length (a huge one: never)
    from prime_models.layers import flash_attn4 as _ours

    _ours.LONG_ROW_TOKENS = int(_LONG_ROW)
