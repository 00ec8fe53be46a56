"""Environments through verifiers' own machinery: env configs, task streams, rollouts and their samples.

The orchestrator owns each taskset (as verifiers' env-server clients do: servers never load data) and dispatches
one task per ``run`` request to the environment's env server, with verifiers' train client config: the renderer
renders every turn and calls our token-in ``/inference/v1/generate``, so the trace holds each turn's exact token
ids with the sampled tokens' log-probs. Each trainable trace branch becomes a trained sequence of the rollout's
``RolloutResult`` without re-tokenizing.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import logging
import os
import time
from typing import Any

from prime_core.config.orchestrator import ClientConfig, EnvConfig, SamplingConfig
from prime_core.schemas.rollout import EnvServerSpec, RolloutResult, TrainedSequence

from prime_orchestrator.env_server import PROJECT_RUNTIMES, EnvServer, EnvServerCrashed
from prime_orchestrator.rendering import resolve_renderer

logger = logging.getLogger("prime.orchestrator.env")

# The train client reads the inference API key from the environment (verifiers never stores credentials in configs).
API_KEY_VAR = "PRIME_INFERENCE_API_KEY"
# verifiers' null chat loop, in-process for tool-less turns (prime_chat); verifiers would default to bash.
DEFAULT_HARNESS = "prime-chat"


def env_config_data(env: EnvConfig) -> dict[str, Any]:
    """The verifiers EnvConfig (as JSON data) of one environment: the harness, runtime and turn limit apply to every
    agent seat unless ``env_args`` sets them for that seat."""
    if module := PROJECT_RUNTIMES.get(env.runtime):
        importlib.import_module(module)
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import resolve_env_config

    data: dict[str, Any] = {**env.env_args, "id": env.env_id, "taskset": {"id": env.id, **env.args}}
    seat: dict[str, Any] = {"runtime": {"type": env.runtime, **env.runtime_args}, "max_turns": env.max_turns}
    harness = env.harness
    if harness == "auto":
        from verifiers.v1.utils.loaders import default_harness_id

        harness = None if default_harness_id(env.id) == env.id else DEFAULT_HARNESS
    if harness is not None:
        seat["harness"] = {"id": harness, **env.harness_args}
    for role in agent_config_fields(resolve_env_config(data)):
        data[role] = {**seat, **env.env_args.get(role, {})}
    return resolve_env_config(data).model_dump(mode="json")


def server_spec(env: EnvConfig, name: str | None = None) -> EnvServerSpec:
    return EnvServerSpec(
        name=name or env.resolved_name,
        env_config=env_config_data(env),
        num_workers=env.num_workers,
        elastic=env.elastic,
    )


class TaskStream:
    """The taskset's tasks by index: a finite taskset cycles, an infinite one is drawn as far as the run needs."""

    def __init__(self, env_config: dict[str, Any]):
        from verifiers.v1.utils.loaders import resolve_env_config, taskset_class

        config = resolve_env_config(env_config).taskset
        self.taskset = taskset_class(config.id)(config)
        self.bounded = self.taskset.bounded
        self._iter = iter(self.taskset)
        self._tasks: list[Any] = list(self._iter) if self.bounded else []
        if self.bounded and not self._tasks:
            raise ValueError(f"taskset {config.id!r} has no tasks")

    def __len__(self) -> int:
        return len(self._tasks)

    def task_data(self, index: int) -> dict[str, Any]:
        if self.bounded:
            return self._tasks[index % len(self._tasks)].data.model_dump(mode="json")
        while len(self._tasks) <= index:
            self._tasks.append(next(self._iter))
        return self._tasks[index].data.model_dump(mode="json")


def train_client(client: ClientConfig, model_dir: str, base_url: str) -> Any:
    """Verifiers' train client config: ``renderers`` renders, our server generates from token ids."""
    from verifiers.v1.configs.client import TrainClientConfig

    key = client.resolved_api_key()
    if key:
        os.environ[API_KEY_VAR] = key
    return TrainClientConfig(
        base_url=base_url + "/v1",
        api_key_var=API_KEY_VAR,
        renderer=resolve_renderer(client.renderer, model_dir, client.renderer_args),
        renderer_model_name=model_dir,
        timeout={"read": client.timeout},
    )


class EnvRunner:
    """Rollouts of one environment: its task stream, its env server, failure accounting."""

    def __init__(self, env: EnvConfig, spec: EnvServerSpec, *, max_retries: int):
        self.env = env
        self.name = spec.name
        self.spec = spec
        self.server = EnvServer(spec)
        self.max_retries = max_retries
        self.tasks: TaskStream | None = None
        self.num_failed = 0
        self.num_retries = 0

    @property
    def num_examples(self) -> int:
        return len(self.tasks) if self.tasks is not None and self.tasks.bounded else 0

    async def start(self) -> None:
        self.tasks = await asyncio.to_thread(TaskStream, self.spec.env_config)
        await self.server.start()

    async def rollout(self, example: int, *, client: Any, model: str, sampling: dict[str, Any]) -> RolloutResult:
        """One rollout; a crashed server is restarted and the rollout re-run; a rollout that raises or times out
        comes back failed (reward 0, no tokens) instead of raising."""
        from verifiers.v1.types import SamplingConfig as VfSampling

        task_data = self.tasks.task_data(example)
        t0 = time.perf_counter()
        for attempt in range(self.max_retries + 1):
            try:
                episode = await asyncio.wait_for(
                    self.server.run(client=client, model=model, sampling=VfSampling(**sampling), task_data=task_data),
                    self.env.rollout_timeout,
                )
                return to_result(episode, self.name, example, time.perf_counter() - t0)
            except EnvServerCrashed as e:
                self.num_retries += 1
                logger.warning("%s; re-running the rollout (attempt %d)", e, attempt + 2)
                error = str(e)
            except TimeoutError:
                error = f"timed out after {self.env.rollout_timeout:.0f}s"
                break
            except Exception as e:  # a failed request is a failed rollout, never a stuck step
                error = f"{type(e).__name__}: {e}"
                break
        self.num_failed += 1
        logger.warning("rollout of %s example %d failed: %s", self.name, example, error.splitlines()[0])
        return RolloutResult(env=self.name, example=example, failed=True, error=error.splitlines()[0])

    async def close(self) -> None:
        await self.server.close()


def request_seed(seed: int, step: int, index: int) -> int:
    """Per-request sampling seed from (run seed, step, sample index): a resumed run samples the same."""
    digest = hashlib.sha256(f"{seed}:{step}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def sampling_args(sampling: SamplingConfig, *, seed: int, max_tokens: int | None = None) -> dict[str, Any]:
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": max_tokens or sampling.max_tokens,
        "seed": seed,
    }


def _text(content: Any) -> str:
    from verifiers.v1.types import content_text

    return content_text(content) if content is not None else ""


def _message_text(message: Any) -> str:
    text = _text(getattr(message, "content", None))
    calls = getattr(message, "tool_calls", None) or []
    calls_text = "".join(f"\n[tool_call {c.name}({c.arguments})]" for c in calls)
    return f"[{message.role}] {text}{calls_text}"


def _images(messages: list[Any]) -> list[str]:
    """The image URLs of a branch's messages in prompt order (the order of its placeholder runs)."""
    urls = []
    for message in messages:
        content = getattr(message, "content", None)
        for part in content if isinstance(content, list) else []:
            if getattr(part, "type", None) == "image_url":
                urls.append(part.image_url.url)
    return urls


def _sequences(traces: list[Any]) -> list[TrainedSequence]:
    """Every trainable branch that sampled something: verifiers' one training sample per branch."""
    sequences = []
    for trace in traces:
        for branch in trace.branches:
            mask = branch.sampled_mask
            if not branch.trainable or not any(mask):
                continue
            images = _images(branch.messages) if branch.mm_token_type_ids else []
            sequences.append(
                TrainedSequence(token_ids=branch.token_ids, loss_mask=mask, logprobs=branch.logprobs, images=images)
            )
    return sequences


def to_result(episode: Any, env: str, example: int, latency: float) -> RolloutResult:
    """The trained view of an episode: every branch of its trainable traces (agent seats; a simulated user or judge
    trains nothing), with the tokens, mask and log-probs verifiers recorded; the reward is the mean of those traces'.
    A failed episode (it raised, or the env marked it not ok) is failed."""
    done = [t for t in episode.traces if t.branches]
    error = episode.last_error or next((t.last_error for t in episode.traces if t.last_error is not None), None)
    if not done or error is not None:
        message = error.message if error is not None else "the episode produced no trace"
        return RolloutResult(env=env, example=example, failed=True, error=f"{message}".splitlines()[0][:500])
    # An env where no seat trains (an eval of a fixed pair of agents) is scored over all of them, as vf-eval does.
    trainable = [t for t in done if t.agent.trainable]
    scored = trainable or done
    sequences = _sequences(trainable)
    metrics: dict[str, float] = {}
    for trace in scored:
        metrics.update({k: float(v) for k, v in trace.metrics.items() if v is not None})
        metrics.update({f"reward/{k}": float(r.value) for k, r in trace.rewards.items() if r is not None})
    shown = scored[0].branches[-1]
    first = next((i for i, n in enumerate(shown.nodes) if n.sampled), len(shown.nodes))
    head = sequences[0].loss_mask if sequences else []
    return RolloutResult(
        env=env,
        example=example,
        sequences=sequences,
        reward=sum(float(t.reward) for t in scored) / len(scored),
        metrics=metrics,
        num_turns=sum(t.num_turns for t in scored),
        prompt_len=head.index(True) if True in head else len(head),
        completion_len=sum(sum(seq.loss_mask) for seq in sequences),
        truncated=any(t.is_truncated for t in scored),
        latency=latency,
        scoring_s=sum(t.timing.scoring.duration for t in scored),
        prompt="\n".join(_message_text(m) for m in shown.messages[:first]),
        completion="\n".join(_message_text(m) for m in shown.messages[first:]),
    )
