"""Red-team attacks on what a harness program's routes reach (``sandbox_pool`` runtime, :mod:`relay`), driven as a
reward-hacking policy would: from the model's own commands, which run inside the program's execution. Each test
asserts what the host sees."""

from __future__ import annotations

import asyncio
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
