"""OpenAI-compatible inference server for prime with a vLLM engine and an embedded PyTorch engine."""

__version__ = "0.1.0"
