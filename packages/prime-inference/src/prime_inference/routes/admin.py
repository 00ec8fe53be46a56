"""Admin routes of an RL inference server, on either engine: health, weight updates (every weight transport, see
`prime_inference.weights`), pause/resume and LoRA adapters. They answer at the root, except vLLM's adapter routes,
which keep vLLM's ``/v1/`` paths."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Request
from prime_core.schemas.adapters import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from prime_core.schemas.health import HealthResponse
from prime_core.schemas.rollout import RolloutVersionsRequest
from prime_core.schemas.weights import WeightUpdateRequest

from prime_inference import adapters, weights
from prime_inference.protocol import RequestError
from prime_inference.routes.common import parse_body, state

router = APIRouter()


def _refuse_if_frozen(request: Request) -> None:
    """A frozen server (a distillation teacher) keeps the weights it started with."""
    if state(request).config.server.frozen:
        raise RequestError("this server is frozen (server.frozen): its weights never change", status_code=403)


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    s = state(request)
    info = s.engine.info
    # `model` is the served name; `model_name` the config's model.name, which requests may also carry.
    answer = HealthResponse(
        engine=info.engine, model=info.model, model_name=s.config.model.name, weight_step=info.weight_step,
        weight_dir=info.weight_dir, paused=info.paused, max_model_len=info.max_model_len, adapters=info.adapters,
        run_id=os.environ.get("PRIME_RUN_ID"), running=info.running, waiting=info.waiting, engine_steps=info.steps,
        kv_cache_usage=info.kv_cache_usage, preemptions=info.preemptions,
        **info.extra,
    )  # fmt: skip
    return answer.model_dump(mode="json")


@router.post("/update_weights")
async def update_weights(request: Request) -> dict[str, Any]:
    """Serve what a trainer-announced ``weight_dir`` holds, by the transport its manifest names."""
    _refuse_if_frozen(request)
    s = state(request)
    req = await parse_body(request, WeightUpdateRequest)
    try:
        return await weights.update_weights(s.engine, req, s.config.server.weight_roots)
    finally:
        s.weight_gate.changed()


@router.post("/rollout_versions")
async def rollout_versions(request: Request) -> dict[str, Any]:
    """The weight steps that sampled the tokens of tagged rollouts (`prime_inference.versions`); may abort them."""
    req = await parse_body(request, RolloutVersionsRequest)
    return state(request).versions.query(req).model_dump(mode="json")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> dict[str, Any]:
    """vLLM's route; loading an existing name replaces that adapter."""
    _refuse_if_frozen(request)
    s = state(request)
    req = await parse_body(request, LoadLoRAAdapterRequest)
    if req.lora_name in (s.model_name, s.config.model.name):
        raise RequestError("lora_name must differ from the base model's name", param="lora_name")
    path = adapters.check_adapter_dir(req.lora_path, s.config.server.weight_roots)
    await weights.verify_files(path, req.step, "lora_path")
    try:
        await s.engine.load_adapter(req.lora_name, str(path), req.step)
    except RequestError:
        raise
    except weights.LOAD_ERRORS as e:
        raise RequestError(f"failed to load LoRA adapter {req.lora_name!r} from {path}: {e}", param="lora_path") from e
    return {"status": "ok", "lora_name": req.lora_name, "lora_path": str(path), "weight_step": req.step}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> dict[str, Any]:
    req = await parse_body(request, UnloadLoRAAdapterRequest)
    await state(request).engine.unload_adapter(req.lora_name)
    return {"status": "ok", "lora_name": req.lora_name}


@router.post("/reload_weights")
async def reload_weights(request: Request) -> dict[str, Any]:
    _refuse_if_frozen(request)
    s = state(request)
    try:
        await s.engine.reload_weights()
    finally:
        s.weight_gate.changed()
    return {"status": "ok", "weight_step": s.engine.info.weight_step}


@router.post("/pause")
async def pause(request: Request) -> dict[str, str]:
    await state(request).engine.pause()
    return {"status": "paused"}


@router.post("/resume")
async def resume(request: Request) -> dict[str, str]:
    await state(request).engine.resume()
    return {"status": "resumed"}
