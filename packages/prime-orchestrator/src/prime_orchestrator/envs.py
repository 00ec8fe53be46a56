"""Environments through verifiers' own machinery: env configs, task streams, rollouts and their samples.

The orchestrator owns each taskset (as verifiers' env-server clients do: servers never load data) and dispatches
one task per ``run`` request to the environment's env server, with verifiers' train client config: the renderer
renders every turn and calls our token-in ``/inference/v1/generate``, so the trace holds each turn's exact token
ids with the sampled tokens' log-probs. Each trainable trace branch becomes a trained sequence of the rollout's
``RolloutResult`` without re-tokenizing (``prime_orchestrator.traces``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from prime_core.config.liveness import RecoveryConfig
from prime_core.config.orchestrator import ClientConfig, EnvConfig, SamplingConfig
from prime_core.io import one_line
from prime_core.schemas.rollout import MIN_WEIGHT_STEP, ROLLOUT_TAG, EnvServerSpec, RolloutResult

from prime_orchestrator.env_config import env_config_data, resolve
from prime_orchestrator.env_limits import memory_limit
from prime_orchestrator.env_server import EnvServer, EnvServerCrashed
from prime_orchestrator.judges import JudgeEndpoint
from prime_orchestrator.metric_keys import MetricKeyCap
from prime_orchestrator.rendering import resolve_renderer
from prime_orchestrator.traces import to_result

logger = logging.getLogger("prime.orchestrator.env")

# The train client reads the inference API key from the environment (verifiers never stores credentials in configs).
API_KEY_VAR = "PRIME_INFERENCE_API_KEY"


def server_spec(
    env: EnvConfig, name: str | None = None, judge: JudgeEndpoint | None = None, recovery: RecoveryConfig | None = None
) -> EnvServerSpec:
    """How ``env``'s server is started; ``recovery`` (the run's) sets its hang probe and its processes' memory."""
    recovery = recovery or RecoveryConfig()
    return EnvServerSpec(
        name=name or env.resolved_name,
        env_config=env_config_data(env, judge),
        num_workers=env.num_workers,
        elastic=env.elastic,
        probe_timeout_s=recovery.probe_timeout_s,
        max_memory_bytes=memory_limit(recovery.env_memory_gb),
        max_answer_bytes=int(recovery.max_answer_mb * 1e6),
    )


class TasksetError(ValueError):
    """An environment's taskset could not give a task (it failed to build, is empty, ended early, or a task's data is
    not JSON): bad input of the run, one line naming the environment and the task."""


RETAINED_TASKS = 4096
"""An infinite taskset's most recently asked tasks that stay in memory, for a rollout asking again (a retry, a group
dispatched again): every drawn task was kept, so memory grew with the run. An older one is drawn again from a fresh
pass over the taskset (deterministic, as a resume's draws are)."""


class TaskStream:
    """The taskset's tasks by index: a finite taskset cycles, an infinite one is drawn as far as the run needs."""

    def __init__(self, env_config: dict[str, Any], name: str | None = None):
        from verifiers.v1.utils.loaders import taskset_class

        config = resolve(env_config).taskset
        self.name = name or config.id
        try:
            self.taskset = taskset_class(config.id)(config)
            self.bounded = self.taskset.bounded
            self._iter = iter(self.taskset)
            self._tasks: list[Any] = list(self._iter) if self.bounded else []
        except Exception as e:  # the taskset's own code reading its data: whatever it raises names a bad input
            raise TasksetError(f"env {self.name}: its taskset {config.id!r} failed to load ({_reason(e)})") from None
        if self.bounded and not self._tasks:
            raise TasksetError(f"env {self.name}: taskset {config.id!r} has no tasks")
        self._recent: OrderedDict[int, Any] = OrderedDict()
        """An infinite taskset's tasks by index: at most ``RETAINED_TASKS``, the least recently asked dropped."""
        self._drawn = 0
        """How many tasks the infinite taskset's iterator gave."""

    def __len__(self) -> int:
        return len(self._tasks) if self.bounded else self._drawn

    def task_data(self, index: int) -> dict[str, Any]:
        if self.bounded:
            task = self._tasks[index % len(self._tasks)]
        elif (task := self._recent.get(index)) is not None:
            self._recent.move_to_end(index)
        else:
            task = self._redraw(index) if index < self._drawn else self._draw_to(index)
            self._recent[index] = task
            while len(self._recent) > RETAINED_TASKS:
                self._recent.popitem(last=False)
        try:
            return task.data.model_dump(mode="json")
        except Exception as e:
            raise TasksetError(f"env {self.name}: task {index}'s data is not JSON ({_reason(e)})") from None

    def _draw_to(self, index: int) -> Any:
        """Draw the infinite taskset's tasks up to ``index``; keeps the last ``RETAINED_TASKS`` of them."""
        while True:
            task = self._next(self._iter, self._drawn, index)
            self._drawn += 1
            if self._drawn > index:
                return task
            if index - self._drawn < RETAINED_TASKS:
                self._recent[self._drawn - 1] = task

    def _redraw(self, index: int) -> Any:
        """Task ``index``, dropped from memory: a fresh pass over the taskset up to it."""
        logger.info("env %s: drawing task %d again (%d tasks are kept)", self.name, index, RETAINED_TASKS)
        tasks = iter(self.taskset)
        for i in range(index):
            self._next(tasks, i, index)
        return self._next(tasks, index, index)

    def _next(self, tasks: Any, position: int, index: int) -> Any:
        try:
            return next(tasks)
        except StopIteration:
            # Raised inside a coroutine, StopIteration would surface as an unrelated RuntimeError.
            raise TasksetError(
                f"env {self.name}: the infinite taskset ended after {position} tasks (task {index} asked)"
            ) from None
        except Exception as e:
            raise TasksetError(f"env {self.name}: task {position} failed to load ({_reason(e)})") from None


def episode_verdict(env_config: dict[str, Any]) -> Callable[[Any], bool]:
    """The env's own ``Env.complete``: whether a finished episode is a valid result (verifiers' default: its ``ok``
    stamp; an env whose ``run()`` tolerates a failed participant accepts more). vf-eval keeps what it accepts; so do
    we (scored and trained, not failed). Only an env that overrides it is built here, once per run: its constructor
    loads its taskset and harnesses."""
    from verifiers.v1.env import Env
    from verifiers.v1.utils.loaders import environment_class

    config = resolve(env_config)
    cls = environment_class(config.taskset.id, config.id)
    if cls.complete is Env.complete:
        return lambda episode: bool(episode.ok)
    return cls(config).complete


def _reason(e: BaseException) -> str:
    # Lines of only rules (nltk's LookupError frames its message in rows of '*') would stand in for the cause.
    text = "\n".join(line.strip() for line in str(e).splitlines() if any(c.isalnum() for c in line))
    return one_line(f"{type(e).__name__}: {text}")[:300]


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
        self.complete: Callable[[Any], bool] | None = None
        self.num_failed = 0
        self.num_retries = 0
        self.metric_keys = MetricKeyCap()
        """The env's metric names logged so far (``metric_keys``): this runner's, over its server's restarts."""

    @property
    def num_examples(self) -> int:
        return len(self.tasks) if self.tasks is not None and self.tasks.bounded else 0

    async def start(self) -> None:
        self.tasks = await asyncio.to_thread(TaskStream, self.spec.env_config, self.name)
        self.complete = await asyncio.to_thread(episode_verdict, self.spec.env_config)
        await self.server.start()

    async def rollout(self, example: int, *, client: Any, model: str, sampling: dict[str, Any]) -> RolloutResult:
        """One rollout; a crashed server is restarted and the rollout re-run; a rollout that raises or times out
        comes back failed (reward 0, no tokens) instead of raising."""
        from verifiers.v1.types import SamplingConfig as VfSampling

        task_data = self.tasks.task_data(example)
        t0 = time.perf_counter()
        for attempt in range(self.max_retries + 1):
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for hands back the attempt's outcome when the
                # cancel meets its end, so a crash at that moment was retried and the cancelled rollout ran on.
                async with asyncio.timeout(self.env.rollout_timeout):
                    episode = await self.server.run(
                        client=client, model=model, sampling=VfSampling(**sampling), task_data=task_data
                    )
                return to_result(episode, self.name, example, time.perf_counter() - t0, self.complete)
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
        error = one_line(error)
        logger.warning("rollout of %s example %d failed: %s", self.name, example, error)
        return RolloutResult(env=self.name, example=example, failed=True, error=error)

    async def close(self) -> None:
        await self.server.close()


def request_seed(seed: int, step: int, index: int) -> int:
    """Per-request sampling seed from (run seed, step, sample index): a resumed run samples the same."""
    digest = hashlib.sha256(f"{seed}:{step}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def sampling_args(
    sampling: SamplingConfig,
    *,
    seed: int,
    max_tokens: int | None = None,
    tag: str | None = None,
    oldest_weights: int | None = None,
) -> dict[str, Any]:
    """Verifiers' sampling fields of a rollout; ``tag`` names the rollout in its requests (the inference server's
    version ledger, `prime_orchestrator.versions`) and ``oldest_weights`` the weight step its requests wait for at
    the server (``dispatch_ahead``): fields the train client passes through in ``extra_args``."""
    args: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": max_tokens or sampling.max_tokens,
        "seed": seed,
    }
    extra = {ROLLOUT_TAG: tag, MIN_WEIGHT_STEP: oldest_weights}
    if extra := {k: v for k, v in extra.items() if v is not None}:
        args["extra_args"] = extra
    return args
