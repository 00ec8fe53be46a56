"""Numerics converters applied to a model from outside: FP8 training (`float8`, kernels in `float8_ops`)."""

from prime_models.quantization.float8 import apply_fp8, convert_to_fp8

__all__ = ["apply_fp8", "convert_to_fp8"]
