"""Red-team attacks on harness program executions (``SandboxPool.execute(..., routes=...)``, the ``sandbox_pool``
runtime's ``run_program``): what a reward-hacking policy's bash commands, run inside the program's execution, and a
hostile environment could do to the host, the pool and the rollout. Each test asserts the host-side outcome."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shlex

import pytest
from prime_core.config.sandbox import SandboxLimits
from prime_orchestrator.sandbox import ExecRequest

from tests.sandbox.conftest import own_pool

pytestmark = [pytest.mark.xdist_group("sandbox"), pytest.mark.timeout(300)]

HOLD = "import time\nb = bytearray({mb} << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\ntime.sleep({s})\nprint('held')\n"


def _together(client, requests: list[ExecRequest]):
    async def main():
        return await asyncio.gather(*(client.execute(r) for r in requests))

    return asyncio.run(main())


def test_executions_together_cannot_hold_more_than_the_pools_memory_limit():
    """Before: nothing bounded the executions of a pool together but ``max_concurrency × memory_mb`` (256 × 2 GiB of
    program_limits, past any host's RAM): 8 executions of 256 MB held 1,853 MB at once, all ``ok``. Now the pool's
    cgroup bounds them (``total_memory_mb``, 512 here): 3 executions hold 100 MB each, a fourth grows to 230 MB (all
    under their own 256 MB); the kernel kills the largest and that execution ends as ``memory_limit`` in one line
    naming the pool's field, while the 3 others, which v1 signals too (every eventfd of the subtree), go on ``ok``:
    before that was told apart, all 4 ended ``memory_limit``. None waits at the limit."""
    limits = SandboxLimits(wall_s=30, cpu_s=30, memory_mb=256, disk_mb=8)
    calm = ExecRequest(code=HOLD.format(mb=100, s=4), limits=limits)
    hog = ExecRequest(code="import time\ntime.sleep(1)\n" + HOLD.format(mb=230, s=2), limits=limits)
    with own_pool(uid_base=4_800_000, max_concurrency=4, total_memory_mb=512) as client:
        *calms, hogged = _together(client, [calm, calm, calm, hog])
        assert [r.status for r in calms] == ["ok"] * 3, calms
        assert hogged.status == "memory_limit", hogged
        assert hogged.reason == (
            "the pool's memory limit of 512 MB for all its executions together (total_memory_mb) exceeded"
        )
        after = _together(client, [ExecRequest(code="print(1)", limits=limits)] * 4)  # the slots serve again
        assert [r.stdout for r in after] == ["1\n"] * 4, after


class Service:
    """A route's server on the host's 127.0.0.1: answers ``pong`` to a ``ping`` line, counts what it accepted and holds
    open."""

    def __init__(self) -> None:
        self.accepted = 0
        self.open = 0

    async def __aenter__(self) -> Service:
        async def serve(reader, writer):
            self.accepted += 1
            self.open += 1
            try:
                while line := await reader.readline():
                    if line.strip() == b"ping":
                        writer.write(b"pong\n")
                        await writer.drain()
            except OSError:
                pass
            finally:
                self.open -= 1
                writer.close()

        self._server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


HOLDER = """
import socket, sys, time
port, n = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(n):
    try:  # past the relay's cap, reset
        s = socket.create_connection(('127.0.0.1', port), timeout=5); held.append(s); s.sendall(b'x')
    except OSError:
        pass
time.sleep(0.5)
try:
    s = socket.create_connection(('127.0.0.1', port), timeout=5); s.settimeout(3)
    s.sendall(b'ping\\n'); print('model call:', s.recv(10).decode().strip() or 'closed')
except OSError as e:
    print('model call:', type(e).__name__)
"""


def test_connections_held_by_the_code_are_capped_refused_past_the_cap_and_leave_no_descriptor():
    """The model's command holds 40 connections to the route (a process left in the background would), then the
    harness makes its model call. Before: the relay took 32, the rest waited in the listener's backlog, and the model
    call got no answer (3 s here; in a rollout, its HTTP timeout or the program's 900 s wall limit, the slot held
    throughout). Now past the 32 a connection is reset at once: the call fails fast, the route's server saw 32
    connections, and the pool's process holds no more descriptors after the execution than before it."""
    limits = SandboxLimits(wall_s=20, cpu_s=20)
    with own_pool(uid_base=4_810_000, max_concurrency=1) as client:

        async def main():
            async with Service() as svc:
                request = ExecRequest(argv=["python3", "-c", HOLDER, str(svc.port), "40"], limits=limits)
                await client.execute(request, routes=[svc.port])  # the slot's cgroup files, kept open, now open
                await asyncio.sleep(0.2)
                svc.accepted, before = 0, _fds()
                result = await client.execute(request, routes=[svc.port])
                while svc.open:  # the pool closed its ends; the server here closes its own once it reads the EOF
                    await asyncio.sleep(0.05)
                return svc, result, before, _fds()

        svc, result, before, after = asyncio.run(main())
    assert result.status == "ok", result
    assert result.stdout.split(": ")[1].strip() in ("closed", "ConnectionResetError", "BrokenPipeError"), result
    assert svc.accepted == 32
    assert after == before


HARNESS = """
import os, subprocess, sys
import httpx  # what the real harness imports, from the offered packages
print('harness imports', httpx.__file__)
command = r'''
echo "openai = 'shadowed'" > /work/httpx.py; mkdir -p /work/openai; echo "x = 1" > /work/openai/__init__.py
cat /proc/$PPID/cmdline 2>/dev/null && echo READ-ARGV
env | grep -q the-secret && echo READ-ENV
touch /opt/prime/site-packages/httpx.py 2>/dev/null && echo WROTE-PACKAGES
echo "import sys; sys.exit(0)" > /work/sitecustomize.py
echo command-done
'''
print(subprocess.run(['sh', '-c', command], capture_output=True, text=True, env={'PYTHONPATH': '/work'}).stdout)
print(subprocess.run([sys.executable, '-I', '-S', '-c', 'import site, sys; site.addsitedir(%r); import httpx;'
                      'print(httpx.__file__)' % '/opt/prime/site-packages'], capture_output=True, text=True,
                     env={'PYTHONPATH': '/work'}, cwd='/work').stdout)
"""


def test_the_models_commands_cannot_read_the_harness_secret_or_shadow_its_packages():
    """The harness (a PEP 723 script run as programs.program_argv runs it, the interception secret in its argv, as
    verifiers passes it) runs a command as the model's would: no /proc (argv unreadable), no secret in its
    environment, /opt/prime/site-packages read-only, and modules it leaves in /work (``httpx.py``, a
    ``sitecustomize.py``, with PYTHONPATH) do not shadow what a harness started the same way imports."""
    from prime_orchestrator.sandbox import programs

    path = f"/work/{hashlib.sha256(HARNESS.encode()).hexdigest()}.py"  # the name the boot checks the bytes against
    argv = programs.program_argv("python3", path)
    script = f"printf %s {shlex.quote(HARNESS)} > {path}\nexec {shlex.join(argv)} --api-key=the-secret"
    limits = SandboxLimits(wall_s=20, cpu_s=20)
    with own_pool(uid_base=4_820_000, max_concurrency=1) as client:

        async def main():
            return await client.execute(ExecRequest(argv=["sh", "-c", script], limits=limits), routes=[])

        result = asyncio.run(main())
    assert result.status == "ok", result
    lines = result.stdout.split()
    assert "command-done" in lines and not {"READ-ARGV", "READ-ENV", "WROTE-PACKAGES"} & set(lines), result.stdout
    assert [line for line in lines if line.endswith(".py")] == ["/opt/prime/site-packages/httpx/__init__.py"] * 2


def test_a_flood_of_the_programs_output_ends_it_in_one_line_within_the_cap():
    """A command floods the harness's stdout (20 MiB, its children share it): the execution ends as
    ``output_limit`` in one line, and what comes back to the host is within the cap."""
    limits = SandboxLimits(wall_s=20, cpu_s=20, output_bytes=1 << 20)
    with own_pool(uid_base=4_830_000, max_concurrency=1) as client:

        async def main():
            flood = ExecRequest(argv=["sh", "-c", "head -c 20000000 /dev/zero | tr '\\0' x; sleep 30"], limits=limits)
            return await client.execute(flood, routes=[])

        result = asyncio.run(main())
    assert (result.status, result.reason) == ("output_limit", f"stdout+stderr over {1 << 20} bytes"), result.reason
    assert len(result.stdout) + len(result.stderr) <= 1 << 20


async def _relay_tasks() -> int:
    await asyncio.sleep(0)
    return sum(1 for t in asyncio.all_tasks() if t.get_coro().__qualname__.startswith("Relay."))


STAY = """
import socket, sys, time
s = socket.create_connection(('127.0.0.1', int(sys.argv[1]))); s.sendall(b'x')
l = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen()
print('holding', flush=True)
time.sleep(60)
"""
AFTER = """
import os, socket, sys
try:
    socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=2); print('REACHED')
except OSError as e:
    print('unreachable', e.errno)
l = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen()
try:
    socket.create_connection(l.getsockname(), timeout=2); print('LOOPBACK')
except OSError as e:
    print('no loopback', e.errno)
print(os.listdir('/opt/prime/site-packages'))
"""


def test_a_program_killed_at_its_wall_limit_leaves_nothing_and_its_slot_comes_back_bare():
    """A program holding a relayed connection and a listener of its own is killed at its wall limit: no relay task,
    no descriptor of the pool's process and no connection to the route's server remain, and the next execution of
    the same (only) slot, an ordinary one, has no loopback, reaches nothing and sees no offered packages."""
    import errno

    limits = SandboxLimits(wall_s=1, cpu_s=1)
    with own_pool(uid_base=4_840_000, max_concurrency=1) as client:

        async def main():
            async with Service() as svc:
                ok = SandboxLimits(wall_s=20, cpu_s=20)
                await client.execute(ExecRequest(code="pass", limits=ok), routes=[svc.port])  # cgroup files open
                before = _fds()
                killed = await client.execute(
                    ExecRequest(argv=["python3", "-c", STAY, str(svc.port)], limits=limits), routes=[svc.port]
                )
                while svc.open:
                    await asyncio.sleep(0.05)
                tasks = await asyncio.wrap_future(client.call(_relay_tasks()))
                fds = _fds()
                after = await client.execute(ExecRequest(argv=["python3", "-c", AFTER, str(svc.port)], limits=ok))
                return killed, tasks, before, fds, after, svc.accepted

        killed, tasks, before, fds, after, accepted = asyncio.run(main())
    assert (killed.status, killed.stdout) == ("timeout", "holding\n"), killed
    assert (tasks, fds, accepted) == (0, before, 1)
    assert after.stdout.split("\n")[:3] == [
        f"unreachable {errno.ENETUNREACH}",
        f"no loopback {errno.ENETUNREACH}",
        "[]",
    ], after.stdout


CYCLES = """
import socket, sys, time
port = int(sys.argv[1])
for _ in range(40):
    socket.create_connection(('127.0.0.1', port), timeout=5).close()
half = []
for _ in range(10):  # half-open: a ping, then its write side shut, its replies never read
    s = socket.create_connection(('127.0.0.1', port), timeout=5); s.sendall(b'ping\\n' * 1000)
    s.shutdown(socket.SHUT_WR); half.append(s)
time.sleep(2)  # held while the relay takes them: one the program no longer holds is refused (relay.from_program)
print('done')
"""


def test_connect_close_cycles_and_half_open_connections_leave_no_descriptor():
    """Connect/close cycles and half-open connections through the relay: once the execution is over the pool's
    process holds as many descriptors as before and the route's server none. (Quick cycles stall the code's own
    connects 1 s every ~18, SYNs retransmitted past the listener's backlog of 16, and some never reach the server;
    the pool's process spent 0.07 s of CPU on 300 in 12 s: its own execution's wall time, nobody else's.)"""
    limits = SandboxLimits(wall_s=20, cpu_s=20)
    with own_pool(uid_base=4_850_000, max_concurrency=1) as client:

        async def main():
            async with Service() as svc:
                await client.execute(ExecRequest(code="pass", limits=limits), routes=[svc.port])  # cgroup files open
                before = _fds()
                request = ExecRequest(argv=["python3", "-c", CYCLES, str(svc.port)], limits=limits)
                result = await client.execute(request, routes=[svc.port])
                while svc.open:
                    await asyncio.sleep(0.05)
                return result, before, _fds(), svc.accepted

        result, before, after, accepted = asyncio.run(main())
    assert (result.status, result.stdout) == ("ok", "done\n"), result
    assert after == before and 10 <= accepted <= 50


def test_a_relay_out_of_descriptors_refuses_its_callers_instead_of_leaving_them_waiting(monkeypatch):
    """The pool's open-files limit reached (its relays are budgeted but not guaranteed): an accept that fails closed
    the relay's task and left the listener up, so the harness's model calls waited in its queue until their timeout."""
    import errno
    import socket

    from prime_orchestrator.sandbox.relay import Relay

    async def main() -> None:
        listener = socket.create_server(("127.0.0.1", 0))
        listener.setblocking(False)
        port = listener.getsockname()[1]
        relay = Relay([port])
        loop = asyncio.get_running_loop()

        async def out_of_fds(sock):
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(loop, "sock_accept", out_of_fds)
        relay._listeners.append(listener)
        relay._spawn(relay._accept(listener, port))
        await asyncio.sleep(0.05)
        try:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
        finally:
            relay.close()

    asyncio.run(main())
