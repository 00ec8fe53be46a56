"""A sandbox pool shared by the sandbox tests, and the host-side checks they use."""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from prime_core.config.sandbox import SandboxClientConfig, SandboxLimits, SandboxPoolConfig
from prime_orchestrator.sandbox import ExecRequest, ExecResult, SandboxClient
from prime_orchestrator.sandbox.pool import NUM_LEASES, SandboxUnavailable


def _session_uids() -> int:
    """The start of this pytest process's uid ranges (an xdist worker's: its run and its name): every base below is
    offset by it, so two sessions on one host (two agents' test runs), and two workers of one run, lend different uids
    and neither counts the other's zygotes and executions as its own leftovers (without ``--dist loadgroup``, the
    workers of ``-n 2`` ran sandbox tests side by side, each with a shared pool on the same uids, and failed each
    other's leftover checks). 400 steps of 5 M keep every uid below 2^31."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID") or str(os.getpid())
    run += "/" + os.environ.get("PYTEST_XDIST_WORKER", "")
    return 5_000_000 * (1 + int(hashlib.sha256(run.encode()).hexdigest(), 16) % 400)


SESSION_UIDS = _session_uids()
UID_BASE = SESSION_UIDS + 310_000  # away from the default range, so a pool of another process is never counted here
MAX_CONCURRENCY = 64
# Generous: every test that loops forever sets its own wall limit; the rest end on their own, even on a loaded host.
FAST = SandboxLimits(wall_s=20, cpu_s=20)


def uid_span(base: int, max_concurrency: int) -> range:
    """Every host uid a pool with this ``uid_base`` lends: its zygotes' own, executions' and workspaces'."""
    return range(base, base + 1 + max_concurrency + NUM_LEASES)


def sandbox_pids(span: range | None = None) -> list[int]:
    """Live host processes running as any uid of the test pool (a leak when no execution runs; the zygotes run as
    the first uid, so the default range leaves them out). Zombies are dead already: an orphan waits there for the
    host's init to reap it."""
    span = span or range(UID_BASE + 1, uid_span(UID_BASE, MAX_CONCURRENCY).stop)
    lo, hi = span.start, span.stop
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid = int(fields.get("Uid", "-1").split()[0])
        if lo <= uid < hi and not fields.get("State", "").strip().startswith(("Z", "X")):
            found.append(int(entry.name))
    return found


def start_client(**pool) -> SandboxClient:
    """A client with a local pool of its own (``pool``: SandboxPoolConfig fields); skips where no sandbox runs."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox pool needs root (user namespaces with a uid range)")
    try:
        return SandboxClient(SandboxClientConfig(pool=SandboxPoolConfig(**pool)))
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox here: {e}")


@contextlib.contextmanager
def own_pool(uid_base: int, max_concurrency: int = 8, **pool):
    """A pool for one test (a fresh zygote, e.g. started with something planted in the host's environment), its uids
    from ``uid_base`` in this session's range (``SESSION_UIDS``); on exit, nothing of it may be left running."""
    uid_base += SESSION_UIDS
    client = start_client(uid_base=uid_base, max_concurrency=max_concurrency, zygotes=1, **pool)
    try:
        yield client
    finally:
        client.close()
        assert_no_sandbox_processes(span=uid_span(uid_base, max_concurrency))


@pytest.fixture(scope="session")
def sandbox():
    client = start_client(uid_base=UID_BASE, max_concurrency=MAX_CONCURRENCY, zygotes=1)
    yield client
    client.close()
    assert_no_sandbox_processes(span=uid_span(UID_BASE, MAX_CONCURRENCY))


def run(sandbox: SandboxClient, code: str = "", **kw) -> ExecResult:
    kw.setdefault("limits", FAST)
    return sandbox.execute_sync(ExecRequest(code=code, **kw))


def assert_serving(sandbox: SandboxClient) -> None:
    """The pool still runs code, and nothing of earlier executions is alive."""
    result = run(sandbox, "print(6 * 7)")
    assert (result.status, result.stdout) == ("ok", "42\n"), result
    assert_no_sandbox_processes()


def _dying(pid: int) -> bool:
    """Killed and on its way out: a SIGKILL pending, or the kernel already exiting it (PF_EXITING)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        flags = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[6])
    except (OSError, IndexError, ValueError):
        return True  # gone while we looked
    pending = {
        k: int(v, 16) for k, v in (line.split(":\t") for line in status.splitlines()) if k in ("SigPnd", "ShdPnd")
    }
    return bool(flags & 0x4) or any(mask & (1 << 8) for mask in pending.values())


def assert_no_sandbox_processes(grace_s: float = 10.0, dying_grace_s: float = 30.0, span: range | None = None) -> None:
    """No process of the pool is alive. A process killed by a signal (PDEATHSIG when its supervisor is killed)
    is torn down asynchronously, after the pool saw the result pipe close: it gets a moment to go, and longer while
    the kernel is visibly tearing it down (on a loaded 2-core host that took more than 5 s)."""
    start = time.monotonic()
    while (pids := sandbox_pids(span)) and time.monotonic() - start < grace_s:
        time.sleep(0.05)
    while pids and all(_dying(pid) for pid in pids) and time.monotonic() - start < grace_s + dying_grace_s:
        time.sleep(0.1)
        pids = sandbox_pids(span)
    assert not pids, [_describe(pid) for pid in pids]


def _describe(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
    except (OSError, StopIteration):
        return f"{pid}: gone"
    return f"{pid}: {state.split(':', 1)[1].strip()} {cmdline[:200]}"


@dataclass
class Node:
    url: str
    key: str
    proc: subprocess.Popen
    tmp: Path
    """The node's TMPDIR: its pool keeps its folders there."""


NODE_UID_BASE = SESSION_UIDS + 340_000


NODE_IDLE_S = 8.0
"""The test node closes a connection idle this long (30 s by default): tests that wait it out take seconds."""


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A ``sandbox-node`` on 127.0.0.1 with a random key (in its environment as NODE_KEY)."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox pool needs root")
    key = secrets.token_urlsafe(24)
    tmp = tmp_path_factory.mktemp("node-tmp")
    env = {**os.environ, "NODE_KEY": key, "TMPDIR": str(tmp)}
    argv = [sys.executable, "-m", "prime_orchestrator.entrypoints.sandbox_node", "--port", "0"]
    argv += ["--api-key-var", "NODE_KEY", "--pool.uid-base", str(NODE_UID_BASE), "--pool.max-concurrency", "16"]
    argv += ["--idle-s", str(NODE_IDLE_S)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline()]
        while not lines[-1].startswith("sandbox node listening on") and lines[-1] and len(lines) < 50:  # logs first
            lines.append(proc.stdout.readline())
        assert lines[-1].startswith("sandbox node listening on http://127.0.0.1:"), lines
        yield Node(url=lines[-1].split()[-1], key=key, proc=proc, tmp=tmp)
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        assert_no_sandbox_processes(span=uid_span(NODE_UID_BASE, 16))
