"""A sandbox pool shared by the sandbox tests, and the host-side checks they use."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from prime_core.config.sandbox import SandboxClientConfig, SandboxLimits, SandboxPoolConfig
from prime_orchestrator.sandbox import ExecRequest, ExecResult, SandboxClient
from prime_orchestrator.sandbox.pool import NUM_LEASES, SandboxUnavailable

UID_BASE = 310_000  # away from the default range, so a pool of another process is never counted here
MAX_CONCURRENCY = 64
# Generous: every test that loops forever sets its own wall limit; the rest end on their own, even on a loaded host.
FAST = SandboxLimits(wall_s=20, cpu_s=20)


def sandbox_pids() -> list[int]:
    """Live host processes running as any execution or workspace uid of the test pool (a leak when no execution
    runs). Zombies are dead already: an orphan waits there for the host's init to reap it."""
    hi = UID_BASE + MAX_CONCURRENCY + NUM_LEASES
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
        if UID_BASE <= uid < hi and not fields.get("State", "").strip().startswith(("Z", "X")):
            found.append(int(entry.name))
    return found


@pytest.fixture(scope="session")
def sandbox():
    if os.geteuid() != 0:
        pytest.skip("the sandbox pool needs root (user namespaces with a uid range)")
    config = SandboxClientConfig(pool=SandboxPoolConfig(uid_base=UID_BASE, max_concurrency=MAX_CONCURRENCY, zygotes=1))
    try:
        client = SandboxClient(config)
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox here: {e}")
    yield client
    client.close()
    assert_no_sandbox_processes()


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


def assert_no_sandbox_processes(grace_s: float = 10.0, dying_grace_s: float = 30.0) -> None:
    """No process of the pool is alive. A process killed by a signal (PDEATHSIG when its supervisor is killed)
    is torn down asynchronously, after the pool saw the result pipe close: it gets a moment to go, and longer while
    the kernel is visibly tearing it down (on a loaded 2-core host that took more than 5 s)."""
    start = time.monotonic()
    while (pids := sandbox_pids()) and time.monotonic() - start < grace_s:
        time.sleep(0.05)
    while pids and all(_dying(pid) for pid in pids) and time.monotonic() - start < grace_s + dying_grace_s:
        time.sleep(0.1)
        pids = sandbox_pids()
    assert not pids, [_describe(pid) for pid in pids]


def _describe(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
    except (OSError, StopIteration):
        return f"{pid}: gone"
    return f"{pid}: {state.split(':', 1)[1].strip()} {cmdline[:200]}"
