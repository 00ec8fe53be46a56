"""The vLLM engine's HTTP app: vLLM's own OpenAI server (its chat, completions, tokenize, models routes, tool-call
and reasoning parsers, structured outputs and sampling parameters, chosen by vLLM's flags), extended with prime's
token-in generate and admin routers, the way prime-rl extends vLLM's app. Every vllm import lives here and in
`prime_inference.engines.vllm_engine`.

vLLM's ``build_app`` needs the engine's supported tasks and model config, which exist only once the engine is up,
so the app served is prime's own: it declares the token-in and admin routes, and its lifespan starts the engine,
builds vLLM's app for it, initialises vLLM's state (``init_app_state``) and mounts it under every other path. So
``/health``, ``/inference/v1/generate``, ``/v1/load_lora_adapter``, ``/pause`` and ``/resume`` are prime's (one engine,
one set of adapters and weight steps), and the rollout route does not pass through vLLM's middleware (CORS, scaling,
Prometheus instrumentation) on every request.
"""

from __future__ import annotations

import logging
from argparse import Namespace
from collections.abc import Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from prime_core.config.inference import InferenceConfig

from prime_inference.app_common import EngineFactory, add_common, start_engine
from prime_inference.routes import admin, generate
from prime_inference.serving import FastJSONResponse

logger = logging.getLogger(__name__)


def serve_args(config: InferenceConfig) -> Namespace:
    """``vllm serve``'s namespace for this config, parsed and checked by vLLM's own parser."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from prime_inference.engines.vllm_engine import vllm_cli_args

    args = make_arg_parser(FlexibleArgumentParser(prog="inference")).parse_args(vllm_cli_args(config))
    validate_parsed_serve_args(args)
    return args


class EngineAdapters(Mapping):
    """vLLM's ``OpenAIServingModels.lora_requests`` as a view of the engine's adapters, so that an adapter loaded
    through prime's ``/v1/load_lora_adapter`` or ``/update_weights`` is a valid ``model`` on vLLM's routes."""

    def __init__(self, engine: Any):
        self.engine = engine

    def __getitem__(self, name: str) -> Any:
        return self.engine.lora_requests()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.engine.lora_requests())

    def __len__(self) -> int:
        return len(self.engine.lora_requests())


async def _vllm_app(args: Namespace, shell: FastAPI) -> FastAPI:
    from vllm.entrypoints.openai import api_server

    engine = shell.state.prime.engine
    # With several engines (vllm.engines), vLLM's own routes run on the first (prime_inference.engines.vllm_replicas).
    llm = getattr(engine.llm, "primary", engine.llm)
    # The engine's own copy, which vLLM completed while building it (the reasoning parser lands there).
    args.structured_outputs_config = llm.vllm_config.structured_outputs_config
    tasks = await llm.get_supported_tasks()
    app = api_server.build_app(args, tasks, llm.model_config)
    await api_server.init_app_state(llm, app.state, args, tasks)
    app.state.openai_serving_models.lora_requests = EngineAdapters(engine)
    # vLLM's engine-error handler stops the HTTP server through this when the engine has died (`vllm serve` sets it).
    app.state.server = getattr(shell.state, "server", None)
    return app


def build_vllm_app(config: InferenceConfig, engine_factory: EngineFactory) -> FastAPI:
    from prime_inference.engines import load_tokenizer
    from prime_inference.tool_calling import resolve_tool_calling

    # vLLM's chat server takes its tool-call parser as a flag, so `auto` is resolved before the engine loads.
    config, _ = resolve_tool_calling(config, load_tokenizer(config), "vllm")
    args = serve_args(config)  # a bad flag fails here, before the engine loads

    @asynccontextmanager
    async def lifespan(shell: FastAPI):
        shell.state.prime = await start_engine(config, engine_factory)
        try:
            app = await _vllm_app(args, shell)
            shell.mount("/", app)
            async with app.router.lifespan_context(app):
                yield
        finally:
            await shell.state.prime.engine.shutdown()

    shell = FastAPI(title="prime inference (vLLM)", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                    default_response_class=FastJSONResponse)  # fmt: skip
    for router in (generate.router, admin.router):
        shell.include_router(router)
    add_common(shell, config)
    return shell
