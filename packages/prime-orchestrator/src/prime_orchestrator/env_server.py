"""One environment's verifiers env server, run in its own subprocess and restarted when it dies.

The server is verifiers' own (``verifiers.v1.serve.serve_env``): a single ``EnvServer`` for one worker, else its
ROUTER broker over a worker pool (static, or elastic: it grows with the load). Each rollout is one ``run`` request
through verifiers' ``EnvClient``; the episode streams back as a typed trace. When the server process dies, every
rollout it held fails with ``EnvServerCrashed`` and the server is started again on a fresh address; the caller
re-runs those rollouts there, so a crash costs time, never a rollout, and no rollout is counted twice (the dead
server's answers can no longer arrive). A worker of a pool that dies is handled as a crash of the whole server
(verifiers' broker would keep routing to it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from prime_core.schemas.rollout import EnvServerSpec

from prime_orchestrator.answer_cap import UNSENDABLE, take_dropped
from prime_orchestrator.env_limits import cap_memory, memory_limit
from prime_orchestrator.env_watch import HangWatch
from prime_orchestrator.mp_temp import own_temp_dir
from prime_orchestrator.proc_tree import MARK_VAR, kill_left, kill_marked, snapshot
from prime_orchestrator.server_cgroup import forget, join, kill_members, own_cgroup

logger = logging.getLogger("prime.orchestrator.env")


class EnvServerCrashed(RuntimeError):
    pass


class EnvServerFailed(RuntimeError):
    """The env server exited while it started (its Env's ``start`` raised: a setting it needs is missing, a server
    it starts does not come up); the message is one line naming the cause."""


# Runtimes this project adds to verifiers' closed runtime union; importing the module registers the type.
PROJECT_RUNTIMES = {"sandbox_pool": "prime_orchestrator.sandbox.verifiers_runtime"}


def register_project_runtimes(data: Any) -> None:
    """Import the project runtimes a verifiers config (JSON data) names, before verifiers validates it."""
    if isinstance(data, dict):
        runtime = data.get("runtime")
        if isinstance(runtime, dict) and runtime.get("type") in PROJECT_RUNTIMES:
            importlib.import_module(PROJECT_RUNTIMES[runtime["type"]])
        for value in data.values():
            register_project_runtimes(value)
    elif isinstance(data, list):
        for value in data:
            register_project_runtimes(value)


def prepare_env_process(env_config: dict[str, Any], max_answer_bytes: int | None = None, name: str = "") -> None:
    """Run in the env server and in every worker verifiers spawns for it (its ``log_setup`` hook): logging, the
    project runtimes the config names, the pooled HTTP transport for the engine calls, and the stack dump that names
    where a blocked event loop is stuck, the process settings that cut a rollout's CPU (``worker_tuning``), and the
    bound on an answer's parts (``answer_cap``)."""
    from prime_orchestrator.answer_cap import install as cap_answers
    from prime_orchestrator.http_pool import pool_engine_clients
    from prime_orchestrator.stacks import register_stack_dump
    from prime_orchestrator.worker_tuning import memoise_factory_signatures

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(ClientGone())
    sys.unraisablehook = _quiet_interrupts
    register_project_runtimes(env_config)
    pool_engine_clients()
    register_stack_dump()
    memoise_factory_signatures()
    if max_answer_bytes is not None:
        cap_answers(max_answer_bytes, name)


# zmq's errnos for a ROUTER's peer that went away, and for a socket closed under a send.
_GONE = ("Host unreachable", "Socket operation on non-socket")


class ClientGone(logging.Filter):
    """verifiers logs every answer and trace delta it cannot send, each with a traceback. When the orchestrator stops
    with rollouts still running (a failed step), its client goes first and every one of them fails so: hundreds of
    lines after the one that names why the run stopped. The first is kept, as one line; the rest are dropped."""

    def __init__(self):
        super().__init__()
        self.told = False

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, KeyboardInterrupt):
            # verifiers' SIGTERM raised inside a request's task: asyncio reports the task's "exception was never
            # retrieved" with a traceback as the loop goes. That is the stop the orchestrator asked for.
            return False
        if not record.name.startswith("verifiers.v1.serve") or not record.getMessage().startswith("failed to send"):
            return True
        if not any(gone in f"{record.getMessage()} {error}" for gone in _GONE):
            return True
        if self.told:
            return False
        self.told = True
        note = "the orchestrator's client is gone; later answers that cannot be sent are not logged"
        record.msg, record.args = f"{record.getMessage()} ({error or 'peer gone'}): {note}", ()
        record.exc_info = record.exc_text = None
        return True


def _quiet_interrupts(unraisable: Any) -> None:
    """verifiers' pool ends on SIGTERM by raising KeyboardInterrupt, wherever the process is: inside a finalizer that
    prints as "Exception ignored in ..." with a traceback. That is the stop the orchestrator asked for."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def _ignore_sigint(signum: int, frame: Any) -> None:
    pass


def _serve(
    spec_data: dict[str, Any], address_queue: Any, death_pipe: Any, environ: dict[str, str], cgroup: str | None = None
) -> None:
    """Subprocess entry: serve the env until the parent goes away (in ``cgroup`` first, where there is one)."""
    if cgroup is not None:
        with contextlib.suppress(OSError):  # then only the token finds what it leaves (``server_cgroup``)
            join(cgroup)
    # A terminal's Ctrl-C reaches this process too: the orchestrator stops it (SIGTERM, verifiers' teardown). A handler
    # that does nothing, not SIG_IGN: the programs it starts get SIGINT's default back at exec, as before.
    signal.signal(signal.SIGINT, _ignore_sigint)
    from verifiers.v1.serve.pool import serve_env

    # A forkserver's child has the forkserver's environment, taken when the first server started: the tool servers
    # and programs this server starts get the parent's environment as it is now, as a spawned server's did.
    os.environ.clear()
    os.environ.update(environ)
    # Python reseeds ``random`` in a forked child, numpy does not: every server would draw the forkserver's numbers
    # (an env that shuffles or samples with numpy's global generator repeated itself across servers and restarts).
    if (numpy := sys.modules.get("numpy")) is not None:
        numpy.random.seed()
    spec = EnvServerSpec.model_validate(spec_data)
    cap_memory(spec.max_memory_bytes or memory_limit(None))  # inherited by the workers, tools and programs it starts
    try:
        serve_env(
            max_workers=spec.num_workers,
            address="tcp://127.0.0.1:0",
            address_queue=address_queue,
            death_pipe=death_pipe,
            log_setup=functools.partial(prepare_env_process, spec.env_config, spec.max_answer_bytes, spec.name),
            multiplex=spec.multiplex,
            elastic=spec.elastic,
            config_data=spec.env_config,
        )
    except KeyboardInterrupt:  # verifiers' SIGTERM handler, raising before serve_env took it over: stopped as it began
        pass
    except Exception as e:
        from prime_core.io import one_line

        # verifiers logged the traceback; the parent's one line names the cause (``_failure``)
        address_queue.put((FAILED, one_line(f"{type(e).__name__}: {e}")))
        address_queue.close()
        address_queue.join_thread()
        sys.exit(1)
    exit_after_teardown()


FAILED = "failed"


def _failure(address_queue: Any) -> str:
    """``: <cause>`` when the server process put why it failed on the queue (``_serve``), else nothing."""
    try:
        while True:
            item = address_queue.get(True, 0.5)
            if isinstance(item, tuple) and item[0] == FAILED:
                return f": {item[1]}"
    except (queue.Empty, OSError, EOFError, ValueError):
        return ""


def exit_after_teardown() -> None:
    """End the server once verifiers' own teardown ran (SIGTERM: its event loop's finallys, the env's ``serving``
    context, the pool's workers): the exit handlers run (multiprocessing's, logging's, temporary files'), then the
    process ends without Python's finalization. Tearing down the modules of verifiers, transformers and torch took
    several seconds on 2 cores, and the orchestrator waits for its env servers before it exits (`rl`, for it)."""
    import atexit
    import os

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


PRELOAD = ["prime_orchestrator.forkserver_signals", "verifiers.v1", "transformers.models.auto.tokenization_auto"]
"""What the env servers' forkserver imports once, for every server it forks, instead of each server a spawn started
(restarts included): verifiers (5 s of CPU: anthropic's and openai's types, sympy) and what loading the renderer's
tokenizer imports (3 s: transformers' tokenizer classes import its config classes, which import torch). A module
that is not installed is skipped. ``forkserver_signals`` goes first: a Ctrl-C meanwhile ends the forkserver quietly."""


def server_context() -> Any:
    """The multiprocessing context env servers start from: a forkserver (one per process, started with the first
    server) that imported ``PRELOAD``. A forkserver has no threads, so forking it is safe, where forking this
    process (an event loop, its threads) is not."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    tempdir = own_temp_dir()  # one a SIGKILL left is removed by the next process (prime_orchestrator.mp_temp)
    _check_socket_room(tempdir)
    _remove_temp_dir_on_sigterm()
    return ctx


SOCKET_PATH_MAX = 107
"""Bytes an AF_UNIX socket path may have (108 with its terminating NUL)."""


def _check_socket_room(tempdir: str) -> None:
    """The forkserver listens on ``<tempdir>/listener-<8 characters>``: a TMPDIR too long for that is one line naming
    it, before the first env server starts (it was a traceback, ``OSError: AF_UNIX path too long``)."""
    need = len(os.fsencode(tempdir)) + len("/listener-") + 8
    if need > SOCKET_PATH_MAX:
        raise EnvServerFailed(
            f"TMPDIR is too long for the env servers' forkserver socket: {tempdir}/listener-* has {need} bytes, at "
            f"most {SOCKET_PATH_MAX} fit; set a shorter TMPDIR"
        )


def _remove_temp_dir_on_sigterm() -> None:
    """The forkserver's socket lives in multiprocessing's temporary directory (``$TMPDIR/pymp-*``), which only an exit
    handler removes: every orchestrator (and eval) stopped by SIGTERM left one behind. SIGTERM now removes it, then
    ends the process by SIGTERM as before. Not a normal exit: multiprocessing's exit handler joins the env servers
    without a bound, and Python's finalization takes seconds. A handler someone else installed is kept."""
    with contextlib.suppress(ValueError):  # not the main thread: that thread's process keeps the old behaviour
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: Any) -> None:
    tempdir = mp.current_process()._config.get("tempdir")
    if tempdir:
        shutil.rmtree(tempdir, ignore_errors=True)
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def pool_workers(broker_pid: int) -> set[int]:
    """Live worker processes of a verifiers pool broker: its children started by multiprocessing's spawn."""
    workers = set()
    for task in Path(f"/proc/{broker_pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in children:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if b"spawn_main" in cmdline and state not in ("Z", "X"):
                workers.add(int(pid))
    return workers


class EnvServer:
    """A running env server for one environment and the client that talks to it."""

    def __init__(self, spec: EnvServerSpec):
        self.spec = spec
        self.name = spec.name
        self.num_restarts = 0
        self.num_dropped_fields = 0
        """Trace fields the server dropped past ``spec.max_answer_bytes`` (``answer_cap``), over the run."""
        self.num_unsendable = 0
        """Rollouts whose answer the server could not pack (``answer_cap.UNSENDABLE``), over the run."""
        self._proc: Any = None
        self._pipe: Any = None
        self._client: Any = None
        self._generation = 0
        self._died: asyncio.Event | None = None
        self._watcher: asyncio.Task | None = None
        self._hang_watch: asyncio.Task | None = None
        self.replaced_because = ""
        """Why the hang watch replaced the server last (``env_watch``), for the errors of the rollouts it held."""
        self._restart_lock = asyncio.Lock()
        self._mark = ""
        self._cgroup: str | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        from verifiers.v1.serve.client import EnvClient

        ctx = server_context()
        address_queue = ctx.Queue()
        parent, child = ctx.Pipe()
        self._mark = uuid.uuid4().hex  # in the environment of every program the server starts (``marked``)
        self._cgroup = own_cgroup(self._mark)  # holds every program it starts, whatever their environment
        args = (self.spec.model_dump(), address_queue, child, {**os.environ, MARK_VAR: self._mark}, self._cgroup)
        proc = ctx.Process(target=_serve, args=args, daemon=False)
        proc.start()
        child.close()  # our end closing (even on SIGKILL) makes the server exit
        try:
            address = await self._address(proc, address_queue)
            client = await self._healthy(proc, EnvClient(address), address_queue)
        except BaseException:
            # Cancelled (Ctrl-C) or failed while it starts: nothing else holds it, and multiprocessing's exit joins it.
            # Before, the orchestrator then waited for it to finish starting (about 10 s) and exited while a server
            # still unpickled its arguments (a FileNotFoundError traceback after the orchestrator's last line).
            proc.terminate()
            parent.close()
            raise
        self._proc, self._pipe, self._client = proc, parent, client
        self._generation += 1
        self._died = asyncio.Event()
        self._watcher = asyncio.create_task(self._watch(proc, self._died, pooled=self.spec.num_workers > 1))
        workers = (lambda: pool_workers(proc.pid)) if self.spec.num_workers > 1 else set
        hangs = HangWatch(self.name, proc, client, self.spec.probe_timeout_s, workers, self._note_hang)
        self._hang_watch = asyncio.create_task(hangs.run())
        logger.info(
            "env server %s up at %s (pid %d, %d worker(s))", self.name, address, proc.pid, self.spec.num_workers
        )

    async def _healthy(self, proc: Any, client: Any, address_queue: Any) -> Any:
        """``client`` once the server answers its health check, within ``start_timeout``."""
        deadline = time.monotonic() + self.spec.start_timeout
        while not await client.health(timeout=2.0):
            if not proc.is_alive():
                await client.close()
                why = await asyncio.to_thread(_failure, address_queue)
                raise EnvServerFailed(f"env server {self.name} exited with code {proc.exitcode} while starting{why}")
            if time.monotonic() > deadline:
                await client.close()
                proc.kill()
                raise RuntimeError(f"env server {self.name} did not become healthy (exit code {proc.exitcode})")
        return client

    async def _address(self, proc: Any, address_queue: Any) -> str:
        deadline = time.monotonic() + self.spec.start_timeout
        while True:
            try:
                address = await asyncio.to_thread(address_queue.get, True, 0.5)
            except queue.Empty:
                if not proc.is_alive():
                    why = await asyncio.to_thread(_failure, address_queue) or "; see its log above"
                    raise EnvServerFailed(
                        f"env server {self.name} exited with code {proc.exitcode} while starting{why}"
                    ) from None
                if time.monotonic() > deadline:
                    proc.kill()
                    raise TimeoutError(
                        f"env server {self.name} did not start in {self.spec.start_timeout:.0f}s"
                    ) from None
                continue
            if isinstance(address, tuple):  # it failed before it had an address
                await asyncio.to_thread(proc.join, 5)
                raise EnvServerFailed(f"env server {self.name} exited while starting: {address[1]}")
            return address

    @staticmethod
    async def _watch(proc: Any, died: asyncio.Event, pooled: bool) -> None:
        """Set ``died`` when the server process exits or, for a worker pool, when one of its workers does:
        verifiers' broker neither restarts a dead worker nor fails its requests (they would hang until the rollout
        timeout), so the whole server is restarted, as for a crash of the broker."""
        seen: set[int] = set()
        while proc.is_alive():
            if pooled:
                workers = pool_workers(proc.pid)
                if seen - workers:
                    logger.warning("env server worker(s) %s died; restarting the server", sorted(seen - workers))
                    proc.kill()
                    break
                seen |= workers
            await asyncio.sleep(0.2)
        died.set()

    async def _restart(self, generation: int) -> None:
        async with self._restart_lock:
            if generation != self._generation:
                return  # another rollout already restarted it
            logger.warning("env server %s (pid %s) died (exit code %s); restarting", self.name, self.pid, self._exit())
            await self._stop()
            await self.start()
            self.num_restarts += 1
            self.replaced_because = ""

    def _exit(self) -> int | None:
        return self._proc.exitcode if self._proc is not None else None

    async def run(self, *, client: Any, model: str, sampling: Any, task_data: dict[str, Any]) -> Any:
        """One episode (a verifiers ``WireEpisode``); raises ``EnvServerCrashed`` (after restarting the server)
        when the server died while it ran."""
        generation, died, env_client = self._generation, self._died, self._client
        if died.is_set():
            await self._restart(generation)
            raise EnvServerCrashed(f"env server {self.name} was down")
        run = asyncio.ensure_future(env_client.run(client, model, sampling, task_data))
        death = asyncio.ensure_future(died.wait())
        try:
            await asyncio.wait({run, death}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            run.cancel()  # a cancelled rollout (stale, or the run ends): its episode must not run on in the server
            raise
        finally:
            death.cancel()
        if run.done():
            if (error := run.exception()) is not None and UNSENDABLE in str(error):
                self.num_unsendable += 1
            return self._note_dropped(run.result())
        run.cancel()
        why = f" ({self.replaced_because})" if self.replaced_because else ""
        await asyncio.gather(run, return_exceptions=True)
        await self._restart(generation)
        raise EnvServerCrashed(f"env server {self.name} died during a rollout{why}")

    def _note_dropped(self, episode: Any) -> Any:
        """``episode``, its fields the server dropped past ``max_answer_bytes`` counted (the first logged)."""
        for field, size in take_dropped(episode):
            if not self.num_dropped_fields:
                logger.warning(
                    "env %s: a trace's %s of %.1f MB was dropped (over recovery.max_answer_mb = %g MB); later ones are "
                    "counted in env_servers/%s/dropped_fields", self.name, field, size / 1e6,
                    self.spec.max_answer_bytes / 1e6, self.name,
                )  # fmt: skip
            self.num_dropped_fields += 1
        return episode

    def _note_hang(self, reason: str) -> None:
        self.replaced_because = reason

    async def _stop(self) -> None:
        for task in (self._watcher, self._hang_watch):
            if task is not None:
                task.cancel()
        if self._client is not None:
            try:
                await self._client.close()
            except Exception:  # a client of a dead server may fail to close; nothing is left to release
                logger.debug("closing the env client of %s failed", self.name, exc_info=True)
        proc = self._proc
        # A broker killed before its workers leaves them (and their tool servers) behind: end whatever was there.
        processes = snapshot(proc.pid) if proc is not None else {}
        if self._pipe is not None:
            self._pipe.close()
        if proc is not None and proc.is_alive():
            proc.terminate()
            await asyncio.to_thread(proc.join, 10)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5)
        # Children that die with the server (PR_SET_PDEATHSIG, as arithmetic's scorer) get their signal as it exits.
        if left := await asyncio.to_thread(kill_left, processes, 1.0):
            logger.warning("env server %s left processes %s behind; killed them", self.name, left)
        # Programs it started that left its tree (daemons, adopted by init): in its cgroup, or with its mark.
        strays = await asyncio.to_thread(kill_members, Path(self._cgroup)) if self._cgroup else []
        if self._mark and (marked := await asyncio.to_thread(kill_marked, self._mark)):
            strays += [s for s in marked if s not in strays]
        if strays:
            logger.warning("env server %s left processes outside its tree (daemons): %s; killed them", self.name,
                           ", ".join(strays))  # fmt: skip
        forget(self._mark)  # a fast exit from here on has nothing of it left to kill
        self._cgroup = None
        self._client = self._pipe = None

    async def close(self) -> None:
        await self._stop()
