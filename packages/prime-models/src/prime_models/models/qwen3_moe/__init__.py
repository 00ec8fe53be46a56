from prime_models.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM

__all__ = ["Qwen3MoeForCausalLM"]
