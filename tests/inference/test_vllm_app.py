"""The vLLM engine's app before it serves:
prime's config becomes ``vllm serve``'s namespace, parser flags included, through vLLM's own parser."""

from __future__ import annotations

import importlib.util

import pytest
from prime_core.config.inference import InferenceConfig

# vLLM's parser infers the device while parsing, so even these need a GPU host.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm extra not installed"),
]


def test_vllm_server_args_take_vllms_parser_flags(model_dir):
    from prime_inference.engines.vllm_engine import engine_args
    from prime_inference.vllm_app import serve_args

    config = InferenceConfig.model_validate(
        {"model": {"name": str(model_dir)}, "enable_auto_tool_choice": True, "tool_call_parser": "hermes",
         "reasoning_parser": "qwen3", "vllm": {"extra_args": ["--chat-template-content-format", "string"]}}
    )  # fmt: skip
    args = serve_args(config)
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes" and args.reasoning_parser == "qwen3"
    assert args.chat_template_content_format == "string"
    # The engine takes its own fields from the same argv, server flags and all.
    assert engine_args(config).worker_extension_cls == "prime_inference.vllm_plugin.PrimeWorkerExtension"


def test_vllm_app_is_a_shell_until_the_engine_starts(model_dir):
    from prime_inference.server import build_app

    config = InferenceConfig.model_validate({"model": {"name": str(model_dir)}, "engine": "vllm"})
    app = build_app(config, lambda: (_ for _ in ()).throw(AssertionError("no engine before startup")))
    paths = {getattr(r, "path", "") for r in app.routes}
    # prime's own routes (health, token-in, admin) are declared on the shell; vLLM's OpenAI routes exist only once
    # the lifespan has built vLLM's app for the started engine and mounted it.
    assert app.title == "prime inference (vLLM)"
    assert {"/health", "/update_weights"} <= paths and "/v1/chat/completions" not in paths
