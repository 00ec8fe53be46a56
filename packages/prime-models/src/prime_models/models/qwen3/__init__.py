from prime_models.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM

__all__ = ["Qwen3ForCausalLM"]
