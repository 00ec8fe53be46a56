"""Local `rl` launcher and SLURM launching for prime."""

__version__ = "0.1.0"
