"""A pool of env worker subprocesses for one environment, with crash recovery.

Each worker is ``python -m prime_orchestrator.env_worker`` talking JSON lines over pipes. Requests go to
the alive worker with the fewest in flight. When a worker dies (EOF on its pipe), every rollout it held
fails with ``WorkerCrashed``; ``run`` restarts the worker and retries the rollout (up to ``max_retries``),
so a crash costs time, never a rollout.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import sys
from typing import Any

logger = logging.getLogger("prime.orchestrator.env")

_ids = itertools.count()


class WorkerCrashed(RuntimeError):
    pass


class RolloutFailed(RuntimeError):
    pass


class EnvWorkerProcess:
    def __init__(self, name: str, index: int, spec: dict[str, Any]):
        self.name = name
        self.index = index
        self.spec = spec
        self.proc: asyncio.subprocess.Process | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self.alive = False
        self.num_examples = 0
        self._reader: asyncio.Task | None = None
        self._ready: asyncio.Future | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    async def start(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "prime_orchestrator.env_worker",
            json.dumps(self.spec),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=2**26,
        )
        self._reader = asyncio.create_task(self._read())
        try:
            self.num_examples = await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except Exception as e:
            await self.kill()
            raise RuntimeError(f"env worker {self.name}[{self.index}] failed to start: {e}") from e
        self.alive = True

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            msg = json.loads(line)
            if msg.get("ready"):
                self._ready.set_result(msg["num_examples"])
                continue
            fut = self.pending.pop(msg["id"], None)
            if fut is None or fut.done():
                continue
            if msg["ok"]:
                fut.set_result(msg["result"])
            else:
                fut.set_exception(RolloutFailed(f"{self.name}: {msg['error']}\n{msg.get('trace', '')}"))
        self.alive = False
        code = await self.proc.wait()
        err = WorkerCrashed(f"env worker {self.name}[{self.index}] (pid {self.proc.pid}) exited with code {code}")
        if not self._ready.done():
            self._ready.set_exception(err)
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(err)
        self.pending.clear()

    async def submit(self, request: dict[str, Any]) -> dict[str, Any]:
        if not self.alive or self.proc is None or self.proc.stdin is None:
            raise WorkerCrashed(f"env worker {self.name}[{self.index}] is down")
        rid = next(_ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[rid] = fut
        try:
            self.proc.stdin.write((json.dumps({**request, "id": rid}) + "\n").encode())
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as e:
            self.pending.pop(rid, None)
            raise WorkerCrashed(f"env worker {self.name}[{self.index}] pipe closed") from e
        return await fut

    async def kill(self) -> None:
        self.alive = False
        if self.proc and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        if self._reader:
            await asyncio.gather(self._reader, return_exceptions=True)


class EnvPool:
    """``num_workers`` workers of one environment."""

    def __init__(
        self, name: str, spec: dict[str, Any], num_workers: int, *, max_retries: int = 3, start_timeout: float = 300.0
    ):
        self.name = name
        self.spec = spec
        self.max_retries = max_retries
        self.start_timeout = start_timeout
        self.workers = [EnvWorkerProcess(name, i, spec) for i in range(num_workers)]
        self.num_restarts = 0
        self.num_retries = 0
        self._restart_locks = [asyncio.Lock() for _ in range(num_workers)]

    @property
    def num_examples(self) -> int:
        return self.workers[0].num_examples

    async def start(self) -> None:
        await asyncio.gather(*(w.start(self.start_timeout) for w in self.workers))

    async def _ensure_alive(self, i: int) -> None:
        async with self._restart_locks[i]:
            w = self.workers[i]
            if w.alive:
                return
            logger.warning("env worker %s[%d] is down; restarting it", self.name, i)
            await w.kill()
            new = EnvWorkerProcess(self.name, i, self.spec)
            await new.start(self.start_timeout)
            self.workers[i] = new
            self.num_restarts += 1

    async def run(self, request: dict[str, Any]) -> dict[str, Any]:
        """One rollout; retried on a crashed worker or a failed rollout."""
        for attempt in range(self.max_retries + 1):
            alive = [i for i, w in enumerate(self.workers) if w.alive]
            if not alive:
                await self._ensure_alive(0)
                alive = [0]
            i = min(alive, key=lambda k: len(self.workers[k].pending))
            try:
                return await self.workers[i].submit(request)
            except WorkerCrashed as e:
                self.num_retries += 1
                logger.warning("%s; retrying rollout (attempt %d)", e, attempt + 1)
                await self._ensure_alive(i)
                last: Exception = e
            except RolloutFailed as e:
                self.num_retries += 1
                logger.warning("rollout failed in %s (attempt %d): %s", self.name, attempt + 1, str(e).splitlines()[0])
                last = e
        raise RuntimeError(f"rollout in environment {self.name} failed {self.max_retries + 1} times: {last}")

    async def close(self) -> None:
        for w in self.workers:
            if w.proc and w.proc.stdin and not w.proc.stdin.is_closing():
                w.proc.stdin.close()
        await asyncio.gather(*(w.kill() for w in self.workers), return_exceptions=True)


def worker_spec(
    *, env_id: str, env_args: dict, model: str, model_dir: str, client: Any, mode: str, max_turns: int
) -> dict[str, Any]:
    return {
        "env_id": env_id,
        "env_args": env_args,
        "model": model,
        "model_dir": model_dir,
        "base_urls": list(client.base_urls),
        "api_key": client.resolved_api_key(),
        "generate_path": client.generate_path,
        "timeout": client.timeout,
        "retries": client.max_retries,
        "mode": mode,
        "max_turns": max_turns,
    }
