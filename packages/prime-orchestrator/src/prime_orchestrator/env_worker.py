"""An env worker: a subprocess that runs one environment's rollouts.

``python -m prime_orchestrator.env_worker '<spec json>'``. It loads the verifiers Taskset named by the
spec, then serves requests read as JSON lines on stdin (``{"id", "example", "sampling", "seed"}``) and
answers each with one JSON line on its private result pipe (the original stdout; library prints go to
stderr). Many rollouts run concurrently on one asyncio loop.

A rollout: render the task's messages, generate a turn (token-in ``/inference/v1/generate`` keeping the
sampled ids and log-probs, or OpenAI chat for evals), ask the task for the environment's answer
(``Task.env_response(messages, info)``, multi-turn tasks only), repeat until the task is done or
``max_turns``; then score with the task's ``@vf.reward`` / ``@vf.metric`` methods.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
import traceback
from typing import Any


class RolloutTrace:
    """The parts of ``vf.Trace`` that tasks read when scoring an episode driven by this worker."""

    def __init__(self, messages: list[dict[str, Any]], info: dict[str, Any], num_turns: int):
        self.messages = messages
        self.info = info
        self.num_turns = num_turns
        self.root_reply = None

    @property
    def last_reply(self) -> str:
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                return (m.get("content") or "").strip()
        return ""


def load_tasks(env_id: str, env_args: dict[str, Any]) -> list[Any]:
    import verifiers.v1 as vf
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import taskset_class

    cls = taskset_class(env_id)
    config_type = concrete_type(cls, vf.TasksetConfig) or vf.TasksetConfig
    taskset = cls(config_type(id=env_id, **env_args))
    if not taskset.bounded:
        raise ValueError(f"taskset {env_id!r} is infinite; give it a finite size (e.g. num_examples)")
    return list(taskset)


def initial_messages(task: Any) -> list[dict[str, Any]]:
    data = task.data
    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        for m in data.prompt or []:
            messages.append(m if isinstance(m, dict) else m.model_dump(exclude_none=True))
    return messages


def text_of(content: Any) -> str:
    """A message's text (content parts: the text parts joined, images as ``<image>``)."""
    if not isinstance(content, list):
        return content or ""
    return "".join(
        p.get("text") or "" if p.get("type") == "text" else "<image>" for p in content if isinstance(p, dict)
    )


async def score(task: Any, trace: RolloutTrace) -> tuple[float, dict[str, float]]:
    from verifiers.v1.utils.decorators import invoke_all

    available = {"task": task.data, "trace": trace}
    rewards = task.hooks("reward")
    metrics = task.hooks("metric")
    reward_values = await invoke_all(rewards, available)
    metric_values = await invoke_all(metrics, available)
    out: dict[str, float] = {}
    total = 0.0
    for fn, value in zip(rewards, reward_values, strict=True):
        items = value.items() if isinstance(value, dict) else [(fn.__name__, value)]
        for k, v in items:
            out[f"reward/{k}"] = float(v)
            total += getattr(fn, "_vf_weight", 1.0) * float(v)
    for fn, value in zip(metrics, metric_values, strict=True):
        items = value.items() if isinstance(value, dict) else [(fn.__name__, value)]
        out.update({f"metric/{k}": float(v) for k, v in items})
    return total, out


class Worker:
    def __init__(self, spec: dict[str, Any]):
        import httpx

        self.spec = spec
        self.tasks = load_tasks(spec["env_id"], spec.get("env_args", {}))
        self.renderer = None
        if spec.get("mode", "generate") == "generate":
            from prime_orchestrator.renderer import ChatRenderer

            self.renderer = ChatRenderer.from_model_dir(spec["model_dir"])
        key = spec.get("api_key")
        self.http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {key}"} if key else {},
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=64),
        )

    async def rollout(self, req: dict[str, Any]) -> dict[str, Any]:
        from prime_orchestrator import client

        spec = self.spec
        task = self.tasks[req["example"] % len(self.tasks)]
        base_urls = spec["base_urls"]
        base_url = base_urls[hash(req["id"]) % len(base_urls)]
        messages = initial_messages(task)
        info: dict[str, Any] = {}
        sampling = dict(req["sampling"])
        sampling["seed"] = req["seed"]
        ids: list[int] = []
        mask: list[bool] = []
        logprobs: list[float] = []
        images: list[str] = []  # data: URLs of the placeholder runs in `ids`, in order
        prompt_len = 0
        num_turns = 0
        completion_tokens = 0
        finish_reason = None
        latency = 0.0
        if self.renderer is not None:
            ids = self.renderer.render(messages, images) + self.renderer.generation_prompt()
            prompt_len = len(ids)
            mask = [False] * len(ids)
            logprobs = [0.0] * len(ids)
        for turn in range(spec.get("max_turns", 8)):
            t0 = time.perf_counter()
            if self.renderer is not None:
                turn_sampling = {
                    **sampling,
                    "seed": sampling["seed"] + turn,
                    "stop_token_ids": self.renderer.stop_token_ids,
                }
                new_ids, new_lps, finish_reason = await client.generate_tokens(
                    self.http,
                    base_url,
                    spec["generate_path"],
                    model=spec["model"],
                    token_ids=ids,
                    sampling=turn_sampling,
                    timeout=spec["timeout"],
                    retries=spec["retries"],
                    images=images,
                )
                ids += new_ids
                mask += [True] * len(new_ids)
                logprobs += new_lps
                completion_tokens += len(new_ids)
                text = self.renderer.decode(new_ids)
            else:
                chat_sampling = {**sampling, "seed": sampling["seed"] + turn}
                text, n_tok, finish_reason = await client.chat_completion(
                    self.http,
                    base_url,
                    model=spec["model"],
                    messages=messages,
                    sampling=chat_sampling,
                    timeout=spec["timeout"],
                    retries=spec["retries"],
                )
                completion_tokens += n_tok
            latency += time.perf_counter() - t0
            num_turns += 1
            messages.append({"role": "assistant", "content": text})
            env_response = getattr(task, "env_response", None)
            reply = env_response(messages, info) if env_response is not None else None
            if not reply:
                break
            messages.extend(reply)
            if self.renderer is not None:
                env_ids = (
                    self.renderer.close_turn(new_ids)
                    + self.renderer.render(reply, images)
                    + self.renderer.generation_prompt()
                )
                ids += env_ids
                mask += [False] * len(env_ids)
                logprobs += [0.0] * len(env_ids)
        else:
            info.setdefault("stop", "max_turns")
        reward, signals = await score(task, RolloutTrace(messages, info, num_turns))
        return {
            "token_ids": ids,
            "loss_mask": mask,
            "logprobs": logprobs,
            "reward": reward,
            "signals": signals,
            "num_turns": num_turns,
            "prompt_len": prompt_len,
            "completion_len": completion_tokens,
            "truncated": finish_reason == "length",
            "latency": latency,
            "prompt": text_of(messages[1]["content"]) if len(messages) > 1 else "",
            "completion": "\n".join(text_of(m["content"]) for m in messages[2:] if m.get("content")),
            "example": req["example"],
            "images": images,
        }


async def serve(spec: dict[str, Any], out) -> None:
    worker = Worker(spec)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    def emit(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    emit({"ready": True, "num_examples": len(worker.tasks), "pid": os.getpid()})

    async def handle(req: dict[str, Any]) -> None:
        try:
            emit({"id": req["id"], "ok": True, "result": await worker.rollout(req)})
        except Exception as e:
            emit({"id": req["id"], "ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})

    pending: set[asyncio.Task] = set()
    while line := await reader.readline():
        task = asyncio.create_task(handle(json.loads(line)))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)


def main() -> None:
    spec = json.loads(sys.argv[1])
    # Results travel on the original stdout; anything printed by libraries goes to stderr instead.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    asyncio.run(serve(spec, out))


if __name__ == "__main__":
    main()
