from prime_models.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLForConditionalGeneration

__all__ = ["Qwen3VLForConditionalGeneration"]
