from prime_models.models.llama.modeling_llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
