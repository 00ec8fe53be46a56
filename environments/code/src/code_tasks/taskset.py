"""The code verifiers Taskset: write a function; reward = fraction of its hidden unit tests passed in the sandbox."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable

import verifiers.v1 as vf
from prime_core.config.sandbox import SandboxClientConfig, SandboxLimits
from prime_orchestrator.sandbox import ExecResult, TestCase, arun
from pydantic import Field
from verifiers.v1.harnesses.null import NullHarness

from code_tasks.data import extract_code, generate_tasks


class CodeData(vf.TaskData):
    family: str
    """Which family of functions the task comes from."""
    tests: list[dict]
    """Hidden unit tests ``{"expr", "expected"}``; never shown to the model, never sent into the sandbox whole
    (only the expressions go in; values are compared on the host)."""
    wall_s: float = 5.0
    """Wall-clock limit of the solution's run."""
    memory_mb: int = 512
    """Address-space limit of the solution's process."""
    sandbox_urls: list[str] = []
    """Sandbox nodes (empty: ``PRIME_SANDBOX_URLS``, else a local pool)."""
    sandbox_api_key_var: str | None = None
    """Environment variable holding the nodes' bearer token."""


class CodeConfig(vf.TasksetConfig):
    num_examples: int = 10_000
    """Tasks generated."""
    seed: int = 0
    """Generator seed."""
    num_tests: int = Field(default=5, ge=1, le=50)
    """Hidden unit tests per task."""
    families: list[str] | None = None
    """Family keys to draw tasks from (``code_tasks.families``); None: all of them. A small model that learns a
    few families in minutes (examples/code) trains on a subset."""
    sandbox_urls: list[str] = Field(default_factory=list)
    """Sandbox nodes (``http://host:port``) running the tests; empty: ``PRIME_SANDBOX_URLS``, else a local pool
    in the environment's process."""
    sandbox_api_key_var: str | None = None
    """Environment variable holding the sandbox nodes' bearer token."""
    wall_s: float = Field(default=5.0, gt=0, le=600)
    """Wall-clock limit of one solution's run (its tests included)."""
    memory_mb: int = Field(default=512, ge=64)
    """Address-space limit of the solution's process."""


class CodeTask(vf.Task[CodeData]):
    # One sandbox run per trace, shared by the reward and the metrics (bounded: traces finish in order).
    _runs: OrderedDict[str, asyncio.Future[ExecResult]] = OrderedDict()

    def _run(self, trace: vf.Trace) -> asyncio.Future[ExecResult]:
        key = trace.id
        if key not in self._runs:
            cfg = self.data
            client = None
            if cfg.sandbox_urls:
                client = SandboxClientConfig(urls=cfg.sandbox_urls, api_key_var=cfg.sandbox_api_key_var)
            tests = [TestCase.model_validate(t) for t in self.data.tests]
            limits = SandboxLimits(wall_s=cfg.wall_s, cpu_s=cfg.wall_s, memory_mb=cfg.memory_mb)
            code = extract_code(trace.last_reply or "")
            self._runs[key] = asyncio.ensure_future(arun(code, tests=tests, limits=limits, config=client))
            while len(self._runs) > 4096:
                self._runs.popitem(last=False)
        return self._runs[key]

    async def _result(self, trace: vf.Trace) -> ExecResult:
        result = await self._run(trace)
        if result.status == "sandbox_error":  # the sandbox failed, not the code: the rollout fails (and is counted)
            raise RuntimeError(f"sandbox error: {result.reason}")
        return result

    @vf.reward(weight=1.0)
    async def tests_passed(self, trace: vf.Trace) -> float:
        if not extract_code(trace.last_reply or ""):
            return 0.0
        return (await self._result(trace)).pass_fraction

    @vf.metric
    async def runs_clean(self, trace: vf.Trace) -> float:
        """1.0 when the solution ran to the end without an exception or a breached limit."""
        if not extract_code(trace.last_reply or ""):
            return 0.0
        return float((await self._result(trace)).status == "ok")


class CodeTaskset(vf.Taskset[CodeTask, CodeConfig]):
    def load(self) -> Iterable[CodeTask]:
        c = self.config
        for t in generate_tasks(c.num_examples, c.seed, c.num_tests, families=c.families):
            yield CodeTask(
                CodeData(
                    prompt=t["prompt"],
                    system_prompt=t["system_prompt"],
                    family=t["family"],
                    tests=t["tests"],
                    wall_s=c.wall_s,
                    memory_mb=c.memory_mb,
                    sandbox_urls=c.sandbox_urls,
                    sandbox_api_key_var=c.sandbox_api_key_var,
                )
            )


class CodeHarness(NullHarness):
    """The harness code ships: a chat task, played by verifiers' tool-less chat loop (``null``; tools only from the
    task's toolsets) rather than verifiers' default for a taskset without one, the ``bash`` coding agent."""
