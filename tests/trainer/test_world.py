"""The trainer's process setup (`prime_trainer.world`)."""

from __future__ import annotations

from prime_trainer.world import allocate_in_expandable_segments


def test_capped_cuda_memory_grows_in_expandable_segments_unless_the_user_configured_the_allocator():
    environ: dict[str, str] = {}
    allocate_in_expandable_segments(environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    allocate_in_expandable_segments(mine)
    assert mine == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
