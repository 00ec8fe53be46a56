"""FSDP2 RL and SFT trainers for prime."""

__version__ = "0.1.0"
