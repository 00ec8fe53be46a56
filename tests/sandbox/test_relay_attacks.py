"""Red-team attacks on what a harness program's routes reach (``sandbox_pool`` runtime, :mod:`relay`), driven as a
reward-hacking policy would: from the model's own commands, which run inside the program's execution. Each test
asserts what the host sees."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from verifiers.v1.errors import SandboxError

from tests.sandbox.test_agent_programs import Host, _bash_agent, _provisioned, _require_root

pytestmark = [pytest.mark.xdist_group("sandbox"), pytest.mark.timeout(300)]


class RecordingHost(Host):
    """The scripted model, keeping every request's bearer and body as its server received them."""

    def __init__(self, command: str) -> None:
        super().__init__(command)
        self.requests: list[tuple[str, dict]] = []

    async def _chat(self, request):
        body = await request.json()
        self.requests.append((request.headers.get("Authorization", ""), body))
        return await super()._chat(request)


# The policy's harness: the interception secret read from its own argv, then model calls the real harness never makes
# (100 choices, a billion tokens, a prompt of the policy's choosing), each a turn of the trace that trains.
FAKE_HARNESS = r"""
import json, sys, urllib.request
args = dict(a[2:].split('=', 1) for a in sys.argv[1:] if a.startswith('--') and '=' in a)
body = {'model': 'm', 'n': 100, 'max_tokens': 10**9, 'messages': [{'role': 'user', 'content': 'INJECTED'}]}
headers = {'Authorization': 'Bearer ' + args['api-key'], 'Content-Type': 'application/json'}
request = urllib.request.Request(args['base-url'] + '/chat/completions', json.dumps(body).encode(), headers)
print('injected', urllib.request.urlopen(request, timeout=10).status)
"""
TAMPER = f"""for f in /work/.vf-scripts/*.py; do cat > "$f" <<'EOF'
{FAKE_HARNESS}
EOF
done; ls /work/.vf-scripts"""


def test_the_models_command_cannot_replace_the_harness_that_runs_the_next_segment():
    """An exchange of several segments (a user's turns; verifiers relaunches the harness program for each) in one
    workspace. The first segment's command overwrites the harness script the runtime wrote in /work/.vf-scripts with
    the policy's own program. Before: ``prepare_uv_script`` wrote that script once per runtime, so the second segment
    ran the policy's program, with the interception secret in its argv: the model's server received its request
    (bearer the secret, 100 choices, max_tokens 10^9, the prompt ``INJECTED``), a turn that the rollout's trace records
    and trains. Now the script is written again before every segment and the boot runs only bytes whose sha256 names
    the file: the second segment runs verifiers' harness, and the server sees only its calls."""
    _require_root()

    async def main():
        host = RecordingHost(TAMPER)
        async with host, _provisioned() as runtime:
            first = await _bash_agent(host, runtime)
            host.command = "echo second-segment"
            second = await _bash_agent(host, runtime, prompt="and now?")
            return host, first, second

    host, first, second = asyncio.run(main())
    assert first.exit_code == 0, first.stderr[-2000:]
    assert ".py" in host.tool_outputs[0], host.tool_outputs  # the command did replace the file
    injected = [body for _, body in host.requests if "n" in body or body["messages"][-1]["content"] == "INJECTED"]
    assert not injected, injected
    assert all(auth == "Bearer the-interception-secret" for auth, _ in host.requests)
    assert second.exit_code == 0, second.stderr[-2000:]
    assert host.tool_outputs[1:] == ["second-segment\n"], host.tool_outputs
    assert len(host.requests) == 4  # two calls a segment: the tool call, then the final answer


FOREIGN = r"""
import http.server, os, sys
log = sys.argv[1]
class Admin(http.server.BaseHTTPRequestHandler):
    def _hit(self):
        with open(log, 'a') as f:
            f.write(self.command + ' ' + self.path + '\n')
        self.send_response(200); self.send_header('Content-Length', '2'); self.end_headers(); self.wfile.write(b'ok')
    do_GET = do_POST = _hit
    def log_message(self, *a):
        pass
server = http.server.HTTPServer(('127.0.0.1', 0), Admin)
with open(log + '.port', 'w') as f:
    f.write(f"{os.getpid()} {server.server_address[1]}")
server.serve_forever()
"""
DRIVE = r"""
import sys, urllib.request
for port in sys.argv[1:]:
    for path in ('/pause', '/update_weights', '/load_lora_adapter'):
        try:
            urllib.request.urlopen(urllib.request.Request(f'http://127.0.0.1:{port}{path}', b'{}'), timeout=5)
            print('REACHED', port, path)
        except OSError as e:
            print('refused', port, path, type(e).__name__)
"""


def _admin_server(tmp_path: Path, name: str, detached: bool) -> tuple[int, int, Path]:
    """A stand-in for an inference server's admin routes (weight updates, LoRA loads, /pause) on the host's 127.0.0.1:
    (pid, port, log of its hits). ``detached``: not a descendant of this process (started by a shell that exits at
    once), as the inference server, the trainer and the orchestrator are to an env worker; else this process's child,
    as a tool server verifiers launches on its subprocess runtime is."""
    log = tmp_path / name
    log.touch()
    argv = [sys.executable, "-c", FOREIGN, str(log)]
    if detached:
        subprocess.run(["sh", "-c", 'setsid "$@" </dev/null >/dev/null 2>&1 &', "sh", *argv], check=True)
    else:
        subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    port_file = Path(f"{log}.port")
    deadline = time.monotonic() + 30
    while not port_file.exists() or not port_file.read_text().strip():  # bounded: the server's start
        assert time.monotonic() < deadline, f"the stand-in server {name} did not start"
        time.sleep(0.05)
    pid, port = map(int, port_file.read_text().split())
    return pid, port, log


def test_a_route_to_a_host_service_that_is_not_the_rollouts_own_is_refused(tmp_path):
    """verifiers relays in every route it names: the interception endpoint and each tool server's URL, also one an
    environment's toolset names by ``url`` (a config, not launched). Such a URL on 127.0.0.1 can be any host service:
    the inference server (``/update_weights``, LoRA loads, ``/pause``), the orchestrator's or a node's. Before: the
    runtime relayed it, and the policy's command drove the admin routes of a stand-in inference server (3 requests
    reached it). Now a route must be a port that this process or one of its descendants listens on (the interception
    server, the tool servers verifiers launched): the foreign one is refused in one line naming it, the stand-in sees
    nothing, and a tool server this process launched (its child) is still relayed."""
    _require_root()
    foreign_pid, foreign_port, foreign_log = _admin_server(tmp_path, "foreign", detached=True)
    child_pid, child_port, child_log = _admin_server(tmp_path, "child", detached=False)
    try:

        async def main():
            host = Host("")
            async with host, _provisioned() as runtime:
                endpoint = f"http://127.0.0.1:{host.port}/v1"
                errors = []
                try:
                    await runtime.prepare_execution([endpoint, f"http://127.0.0.1:{foreign_port}/mcp"])
                except SandboxError as e:
                    errors.append(str(e))
                    await runtime.prepare_execution([endpoint, f"http://localhost:{child_port}/mcp"])
                argv = ["python3", "-c", DRIVE, str(foreign_port), str(child_port)]
                return errors, await runtime.run_program(argv, {})

        errors, result = asyncio.run(main())
    finally:
        for pid in (foreign_pid, child_pid):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(child_pid, 0)
    assert foreign_log.read_text() == "", result.stdout
    assert len(errors) == 1 and "\n" not in errors[0] and f":{foreign_port}/mcp" in errors[0], errors
    assert result.stdout.count(f"REACHED {child_port}") == 3, result.stdout
    assert child_log.read_text().split("\n")[:3] == ["POST /pause", "POST /update_weights", "POST /load_lora_adapter"]


def test_the_boot_runs_only_the_bytes_its_file_name_hashes_to(tmp_path):
    """The boot reads the harness script once and runs those bytes only if their sha256 is its file's name: a file
    swapped between the runtime's write and the program's start (by a command of another run in the same workspace)
    ends the program in one line instead of running; the genuine one runs as ``__main__``."""
    import hashlib

    from prime_orchestrator.sandbox import programs

    script = b"import sys\nprint(__name__, sys.argv[1:])\n"
    path = tmp_path / f"{hashlib.sha256(script).hexdigest()}.py"
    path.write_bytes(script)
    ran = subprocess.run([*programs.program_argv(sys.executable, str(path)), "--x"], capture_output=True, text=True)
    path.write_bytes(b"print('the policy runs')\n")
    swapped = subprocess.run(programs.program_argv(sys.executable, str(path)), capture_output=True, text=True)
    assert (ran.returncode, ran.stdout) == (0, "__main__ ['--x']\n"), ran.stderr
    assert (swapped.returncode, swapped.stdout) == (1, "")
    assert swapped.stderr == f"{path}: the harness script was changed after the runtime wrote it\n"


ROUGH = r"""
import os, socket, struct, sys, time
port = int(sys.argv[1])
def stream():
    s = socket.create_connection(('127.0.0.1', port), timeout=5); s.sendall(b'stream\n'); s.recv(1 << 16)
    return s
s = stream()  # reset mid-copy: the server is still writing
s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack('ii', 1, 0)); s.close()
for family, host in ((socket.AF_INET, '127.0.0.1'), (socket.AF_INET6, '::1')):
    u = socket.socket(family, socket.SOCK_DGRAM)
    try:
        u.sendto(b'udp', (host, port)); print('udp sent', host)
    except OSError as e:
        print('udp', host, e.errno)
for addr in (('::1', port), ('127.0.0.1', port + 1), ('127.0.0.2', port)):
    try:
        socket.create_connection(addr, timeout=2); print('REACHED', addr)
    except OSError as e:
        print('refused', addr[0])
half = stream(); half.shutdown(socket.SHUT_WR)  # half-closed, the reply still coming
held = stream()  # then the program exits while the relay copies the server's endless reply to it
print('exiting', flush=True)
os._exit(0)
"""


class Streamer:
    """A route's server that answers ``stream`` with 64 KiB chunks until its reader goes away, beside a UDP socket on
    its port (IPv4) and TCP and UDP listeners on ``::1`` at the same port: counts what reached each."""

    def __init__(self) -> None:
        self.accepted = self.open = self.other = 0

    async def __aenter__(self) -> Streamer:
        import socket

        async def serve(reader, writer):
            self.accepted += 1
            self.open += 1
            try:
                if (await reader.readline()).strip() == b"stream":
                    while True:
                        writer.write(b"x" * (64 << 10))
                        await writer.drain()
            except OSError:
                pass
            finally:
                self.open -= 1
                writer.close()

        async def other(reader, writer):
            self.other += 1
            writer.close()

        self._server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        self._v6 = await asyncio.start_server(other, "::1", self.port)
        self._udp = [socket.socket(f, socket.SOCK_DGRAM) for f in (socket.AF_INET, socket.AF_INET6)]
        self._udp[0].bind(("127.0.0.1", self.port))
        self._udp[1].bind(("::1", self.port))
        for u in self._udp:
            u.setblocking(False)
        return self

    def datagrams(self) -> int:
        got = 0
        for u in self._udp:
            while True:
                try:
                    u.recv(64)
                except BlockingIOError:
                    break
                got += 1
        return got

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        self._v6.close()
        for u in self._udp:
            u.close()


def test_resets_udp_ipv6_other_ports_and_an_exit_mid_copy_reach_nothing_and_leave_nothing():
    """The model's command resets a connection while the route's server is still writing to it, sends UDP to the
    route's port (IPv4 and IPv6), connects to ``::1`` and to other ports and addresses, half-closes a connection whose
    reply keeps coming, and exits while the relay copies an endless reply to another. The host's route server saw the
    three TCP connections and nothing else reached the host (no datagram, nothing on ``::1``); once the verdict is
    in, the server's connections are closed, and the pool's process holds no relay task and as many descriptors as
    before."""
    _require_root()
    from prime_core.config.sandbox import SandboxLimits
    from prime_orchestrator.sandbox import ExecRequest

    from tests.sandbox.conftest import own_pool
    from tests.sandbox.test_program_attacks import _fds, _relay_tasks

    limits = SandboxLimits(wall_s=20, cpu_s=20)
    with own_pool(uid_base=4_860_000, max_concurrency=1) as client:

        async def main():
            async with Streamer() as svc:
                await client.execute(ExecRequest(code="pass", limits=limits), routes=[svc.port])  # cgroup files open
                before = _fds()
                request = ExecRequest(argv=["python3", "-c", ROUGH, str(svc.port)], limits=limits)
                result = await client.execute(request, routes=[svc.port])
                while svc.open:  # bounded by the test's timeout: the pool closed its ends at the verdict
                    await asyncio.sleep(0.05)
                tasks = await asyncio.wrap_future(client.call(_relay_tasks()))
                return result, before, _fds(), tasks, svc.accepted, svc.other, svc.datagrams()

        result, before, after, tasks, accepted, other, datagrams = asyncio.run(main())
    assert result.status == "ok" and result.stdout.endswith("exiting\n"), result
    assert "REACHED" not in result.stdout and result.stdout.count("refused") == 3, result.stdout
    assert (accepted, other, datagrams) == (3, 0, 0), result.stdout
    assert (tasks, after) == (0, before)


PROBE_ROUTES = r"""
import json, sys, urllib.request, urllib.error
port, routes = int(sys.argv[1]), json.loads(sys.argv[2])
for method, path in routes:
    for auth in ({}, {'Authorization': 'Bearer guess'}, {'x-api-key': 'guess'}):
        request = urllib.request.Request(f'http://127.0.0.1:{port}{path}', b'{}' if method != 'GET' else None,
                                         {'Content-Type': 'application/json', **auth}, method=method)
        try:
            print(urllib.request.urlopen(request, timeout=10).status, method, path)
        except urllib.error.HTTPError as e:
            print(e.code, method, path)
"""


def test_every_route_of_the_interception_server_answers_the_code_401_without_its_secret():
    """What the interception port, the route every harness program gets, offers the model's commands, which cannot
    read the secret (no /proc, not in their environment, not in a harness file since the boot's check): every route
    of verifiers' own server (each dialect's model and aux routes, ``/v1/models``, ``/state``, ``/task``, ``/tool``)
    answers 401 to requests with no bearer or a guessed one, and the registered rollout's state is untouched."""
    _require_root()
    from types import SimpleNamespace

    from prime_core.config.sandbox import SandboxLimits
    from prime_orchestrator.sandbox import ExecRequest
    from verifiers.v1.interception.server import InterceptionServer

    from tests.sandbox.conftest import own_pool

    with own_pool(uid_base=4_870_000, max_concurrency=1) as client:

        async def main():
            server = InterceptionServer()
            await server.start()
            server._client = lambda config: None  # no model behind it: a request that got past the secret would fail
            session = SimpleNamespace(ctx=SimpleNamespace(client=None), trace=SimpleNamespace(id="t", state={"k": 1}))
            server.register(session)
            routes = sorted(
                {(r.method, r.resource.canonical) for r in server.runner.app.router.routes() if r.method != "HEAD"}
            )
            try:
                argv = ["python3", "-c", PROBE_ROUTES, str(server.port), json.dumps(routes)]
                limits = SandboxLimits(wall_s=60, cpu_s=60)
                result = await client.execute(ExecRequest(argv=argv, limits=limits), routes=[server.port])
            finally:
                await server.stop()
            return routes, result, session.trace.state

        routes, result, state = asyncio.run(main())
    lines = result.stdout.splitlines()
    assert len(routes) >= 8 and {("GET", "/state"), ("PUT", "/state"), ("POST", "/tool")} <= set(routes), routes
    assert len(lines) == 3 * len(routes) and all(line.startswith("401 ") for line in lines), result.stdout
    assert state == {"k": 1}


CHILD_THEN_SELF = r"""
import socket, subprocess, sys
port = int(sys.argv[1])
def call(who):
    try:
        with socket.create_connection(('127.0.0.1', port), timeout=10) as s:
            s.sendall(b'ping')
            print(who, s.recv(16).decode() or 'closed', flush=True)
    except OSError as e:
        print(who, 'refused', type(e).__name__, flush=True)
subprocess.run([sys.executable, '-c', CALL_CHILD, str(port)], check=False)
call('program')
"""


def test_only_the_program_itself_reaches_its_routes_not_the_commands_it_runs():
    """The model's commands run as the harness program's children, inside its network namespace: before, a
    command's connection to a route was relayed like the program's (a task's MCP tool called outside the tool gate,
    an unauthenticated flood of the interception server). Now the relay takes a connection only when the PID
    namespace's init, the program, holds its other end: the host's server saw the program's connection alone."""
    _require_root()
    from prime_core.config.sandbox import SandboxLimits
    from prime_orchestrator.sandbox import ExecRequest

    from tests.sandbox.conftest import own_pool

    seen = []

    async def pong(reader, writer):
        seen.append(await reader.read(4))
        writer.write(b"pong")
        await writer.drain()
        writer.close()

    child = "import socket, sys\ntry:\n"
    child += "    s = socket.create_connection(('127.0.0.1', int(sys.argv[1])), timeout=10); s.sendall(b'ping')\n"
    child += "    print('command', s.recv(16).decode() or 'closed', flush=True)\n"
    child += "except OSError as e:\n    print('command refused', type(e).__name__, flush=True)\n"
    code = CHILD_THEN_SELF.replace("CALL_CHILD", repr(child))
    limits = SandboxLimits(wall_s=30, cpu_s=30)
    with own_pool(uid_base=4_880_000, max_concurrency=1) as client:

        async def main():
            server = await asyncio.start_server(pong, "127.0.0.1", 0)
            port = server.sockets[0].getsockname()[1]
            async with server:
                request = ExecRequest(argv=["python3", "-c", code, str(port)], limits=limits)
                return await client.execute(request, routes=[port])

        result = asyncio.run(main())
    assert result.status == "ok", result
    lines = result.stdout.splitlines()
    assert lines[0].startswith("command ") and "pong" not in lines[0], result.stdout
    assert lines[1] == "program pong", result.stdout
    assert seen == [b"ping"]  # the program's connection, and nothing of the command's reached the host
