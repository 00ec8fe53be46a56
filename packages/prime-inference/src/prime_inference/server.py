"""The HTTP app: our OpenAI, token-in and admin routers on the torch engine; vLLM's own OpenAI app extended with the
token-in and admin routers on the vLLM engine (`prime_inference.vllm_app`).

Every bad input is answered with a 4xx and an OpenAI-style body ``{"error": {"message", "type", "param", "code"}}``
(`prime_inference.app_common`, shared by both apps).
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from prime_core.config.inference import InferenceConfig

from prime_inference.app_common import EngineFactory, add_common, start_engine
from prime_inference.routes import admin, generate, openai
from prime_inference.serving import FastJSONResponse


def build_app(config: InferenceConfig, engine_factory: EngineFactory) -> FastAPI:
    """The FastAPI app. ``engine_factory`` builds (engine, tokenizer) at startup, inside the server's loop."""
    from prime_inference.engines import select_engine

    if select_engine(config) == "vllm":
        from prime_inference.vllm_app import build_vllm_app

        return build_vllm_app(config, engine_factory)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.prime = await start_engine(config, engine_factory)
        try:
            yield
        finally:
            await app.state.prime.engine.shutdown()

    app = FastAPI(title="prime inference", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
                  default_response_class=FastJSONResponse)  # fmt: skip
    for router in (openai.router, generate.router, admin.router):
        app.include_router(router)
    add_common(app, config)
    return app
