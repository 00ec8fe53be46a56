"""Dense, MoE and VLM model families with HF conversion, fused log-prob head and FSDP2 parallelize functions."""

__version__ = "0.1.0"
