"""Admin routes of an RL inference server, on either engine: health, weight updates (files, broadcast, vLLM's
NCCL weight transfer), pause/resume and LoRA adapters. They answer at the root, except vLLM's adapter routes,
which keep vLLM's ``/v1/`` paths."""

from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter, Request
from prime_core.schemas.adapters import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, is_adapter_dir
from prime_core.schemas.health import HealthResponse
from prime_core.schemas.weights import WeightUpdateRequest

from prime_inference import adapters
from prime_inference.broadcast import BroadcastError
from prime_inference.protocol import RequestError
from prime_inference.routes.common import parse_body, read_json, state
from prime_inference.serving import ServerState
from prime_inference.weights import check_weight_dir

router = APIRouter()
LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError)


@router.get("/health")
async def health(request: Request) -> dict[str, Any]:
    s = state(request)
    info = s.engine.info
    # `model` is the served name; `model_name` the config's model.name, which requests may also carry.
    answer = HealthResponse(
        engine=info.engine, model=info.model, model_name=s.config.model.name, weight_step=info.weight_step,
        weight_dir=info.weight_dir, paused=info.paused, max_model_len=info.max_model_len, adapters=info.adapters,
        run_id=os.environ.get("PRIME_RUN_ID"), running=info.running, waiting=info.waiting, engine_steps=info.steps,
        **info.extra,
    )  # fmt: skip
    return answer.model_dump(mode="json")


@router.post("/update_weights")
async def update_weights(request: Request) -> dict[str, Any]:
    s = state(request)
    req = await parse_body(request, WeightUpdateRequest)
    weight_path = adapters.confined_dir(req.weight_dir, s.config.server.weight_roots, "weight_dir")
    if req.step is not None and req.step < 0:
        raise RequestError("step must be >= 0", param="step")
    if is_adapter_dir(weight_path):
        # A trainer-published adapter replaces the adapter it names.
        info = adapters.published_adapter(weight_path, req.weight_dir)
        step = info.step if req.step is None else req.step
        await _load_adapter(s, info.name, weight_path, step, "weight_dir")
        return {"status": "ok", "lora_name": info.name, "weight_step": step, "weight_dir": str(weight_path)}
    path, manifest = check_weight_dir(req.weight_dir, s.config.server.weight_roots, req.source)
    try:
        if manifest is not None:
            await s.engine.receive_weights(manifest, req.step)
        else:
            await s.engine.update_weights(str(path), req.step)
    except RequestError:
        raise
    except BroadcastError as e:
        raise RequestError(f"weight broadcast for {req.weight_dir} failed: {e}", status_code=504) from e
    except LOAD_ERRORS as e:
        raise RequestError(f"failed to load weights from {req.weight_dir}: {e}", param="weight_dir") from e
    return {"status": "ok", "weight_step": s.engine.info.weight_step, "weight_dir": str(path)}


async def _load_adapter(s: ServerState, name: str, path: Any, step: int | None, param: str) -> None:
    try:
        await s.engine.load_adapter(name, str(path), step)
    except RequestError:
        raise
    except LOAD_ERRORS as e:
        raise RequestError(f"failed to load LoRA adapter {name!r} from {path}: {e}", param=param) from e


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request) -> dict[str, Any]:
    """vLLM's route; loading an existing name replaces that adapter."""
    s = state(request)
    req = await parse_body(request, LoadLoRAAdapterRequest)
    if req.lora_name in (s.model_name, s.config.model.name):
        raise RequestError("lora_name must differ from the base model's name", param="lora_name")
    path = adapters.check_adapter_dir(req.lora_path, s.config.server.weight_roots)
    await _load_adapter(s, req.lora_name, path, req.step, "lora_path")
    return {"status": "ok", "lora_name": req.lora_name, "lora_path": str(path), "weight_step": req.step}


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> dict[str, Any]:
    req = await parse_body(request, UnloadLoRAAdapterRequest)
    await state(request).engine.unload_adapter(req.lora_name)
    return {"status": "ok", "lora_name": req.lora_name}


@router.post("/reload_weights")
async def reload_weights(request: Request) -> dict[str, Any]:
    engine = state(request).engine
    await engine.reload_weights()
    return {"status": "ok", "weight_step": engine.info.weight_step}


@router.post("/weight_transfer/{op}")
async def weight_transfer(op: str, request: Request) -> dict[str, Any]:
    return await state(request).engine.weight_transfer(op, await read_json(request) if await request.body() else {})


@router.post("/pause")
async def pause(request: Request) -> dict[str, str]:
    await state(request).engine.pause()
    return {"status": "paused"}


@router.post("/resume")
async def resume(request: Request) -> dict[str, str]:
    await state(request).engine.resume()
    return {"status": "resumed"}
