"""verifiers' own bash agent program, hosted by the ``sandbox_pool`` runtime: offline (no ``uv sync`` from PyPI),
isolated, reaching the model endpoint it was given and nothing else of the host.

The model is a scripted OpenAI-compatible stub on 127.0.0.1 (streaming, as the chat program asks): its first reply is
one ``bash`` tool call, its second a final message. Another listener on the host stands for every other host service
(an inference server, a node, a database) and must never receive a connection.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
from verifiers.v1.errors import SandboxError

pytestmark = [pytest.mark.xdist_group("sandbox"), pytest.mark.timeout(300)]


def _require_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the sandbox pool needs root (user namespaces with a uid range)")


class Host:
    """A scripted model on one port and a bystander service on another, both on the host's 127.0.0.1."""

    def __init__(self, command: str, *more: str) -> None:
        self.command, self.more = command, more  # one bash call a turn, then a final message
        self.tool_outputs: list[str] = []
        self.bystander_hits = 0

    async def __aenter__(self) -> Host:
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", lambda _: web.json_response({"object": "list", "data": []}))
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

        async def bystander(reader, writer):
            self.bystander_hits += 1
            writer.close()

        self._bystander = await asyncio.start_server(bystander, "127.0.0.1", 0)
        self.bystander_port = self._bystander.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._bystander.close()
        await self._runner.cleanup()

    async def _chat(self, request):
        from aiohttp import web

        body = await request.json()
        tools = [m for m in body["messages"] if m.get("role") == "tool"]
        if tools:
            self.tool_outputs.append(str(tools[-1].get("content")))
        commands = [self.command, *self.more]
        if len(tools) >= len(commands):
            delta = {"role": "assistant", "content": "done"}
            finish = "stop"
        else:
            call = {"index": 0, "id": f"call_{len(tools) + 1}", "type": "function"}
            call["function"] = {"name": "bash", "arguments": json.dumps({"command": commands[len(tools)]})}
            delta, finish = {"role": "assistant", "tool_calls": [call]}, "tool_calls"
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for choice in ({"index": 0, "delta": delta}, {"index": 0, "delta": {}, "finish_reason": finish}):
            chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [choice]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response


async def _bash_agent(host: Host, runtime, prompt: str = "write hi to out.txt"):
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE, launch_chat_program

    endpoint = runtime.host_url(f"http://127.0.0.1:{host.port}/v1")
    await runtime.prepare_execution([endpoint])
    return await launch_chat_program(
        CHAT_PROGRAM_SOURCE,
        SimpleNamespace(resolved_env={}),
        SimpleNamespace(model="m"),
        None,
        runtime,
        endpoint,
        "the-interception-secret",
        {},
        "You are a coding agent.",
        prompt,
        extra_args=["--bash"],
        activate=False,
    )


def _provisioned(**config):
    import verifiers.v1.runtimes as vr
    from prime_orchestrator.sandbox import verifiers_runtime  # noqa: F401  (registers sandbox_pool)
    from verifiers.v1.configs.agent import AgentConfig

    return vr.provision_runtime(AgentConfig(runtime={"type": "sandbox_pool", **config}).runtime)


def test_the_bash_agent_writes_its_workspace_reaches_its_model_and_nothing_else():
    """Before: ``prepare_uv_script`` ran ``uv sync --script`` in the box (no PyPI: it failed), and no execution had
    a network to reach the model. Now the program runs, its command writes /work/out.txt in the workspace, and its
    connections to another host port (IPv4 and IPv6 loopback) are refused: the bystander receives nothing."""
    _require_root()
    probe = f"/tmp/agentbox-probe-{uuid.uuid4().hex}"
    reach = (
        "import socket\n"
        "for host in ('127.0.0.1', '::1', 'localhost'):\n"
        "    try:\n"
        "        socket.create_connection((host, {port}), timeout=3); print('REACHED', host)\n"
        "    except OSError as e: print('refused', host, type(e).__name__)\n"
    )

    async def main():
        host = Host("")
        async with host, _provisioned() as runtime:
            code = reach.format(port=host.bystander_port)
            host.command = f'echo hi > /work/out.txt; echo probe > {probe}; python3 -c "{code}"; echo end'
            result = await _bash_agent(host, runtime)
            out = await runtime.read("/work/out.txt")
            return host, result, out

    host, result, out = asyncio.run(main())
    assert result.exit_code == 0, result.stderr[-2000:]
    assert out == b"hi\n"
    (output,) = host.tool_outputs
    assert "REACHED" not in output and output.count("refused") == 3 and output.rstrip().endswith("end"), output
    assert host.bystander_hits == 0
    assert not Path(probe).exists() and not Path("/work/out.txt").exists()  # the host's own /tmp and /work


def test_a_program_cannot_reach_other_ports_through_its_route_and_its_relay_ends_with_it():
    """The code speaks raw bytes to the route: a CONNECT to the bystander, a request whose Host names it, a
    megabyte of body, and a second connection it keeps open. All reach the model's server (which answers them or
    not); the bystander gets nothing, and the connection kept open ends with the execution."""
    _require_root()
    attack = (
        "import socket, sys\n"
        "port, other = int(sys.argv[1]), int(sys.argv[2])\n"
        "def send(data):\n"
        "    s = socket.create_connection(('127.0.0.1', port), timeout=5); s.sendall(data)\n"
        "    s.settimeout(5)\n"
        "    try: return s.recv(200)\n"
        "    except OSError as e: return repr(e).encode()\n"
        "print(send(b'CONNECT 127.0.0.1:%d HTTP/1.1\\r\\nHost: 127.0.0.1:%d\\r\\n\\r\\n' % (other, other))[:12])\n"
        "print(send(b'GET / HTTP/1.1\\r\\nHost: 127.0.0.1:%d\\r\\n\\r\\n' % other)[:12])\n"
        "big = b'x' * (1 << 20)\n"
        "print(send(b'POST /v1/x HTTP/1.1\\r\\nHost: a\\r\\nContent-Length: %d\\r\\n\\r\\n' % len(big) + big)[:12])\n"
        "held = socket.create_connection(('127.0.0.1', port)); held.sendall(b'GET /v1/models HTTP/1.1\\r\\n')\n"
        "print('held')\n"
    )

    async def main():
        host = Host("")
        async with host, _provisioned() as runtime:
            await runtime.write("/work/attack.py", attack.encode())
            await runtime.prepare_execution([f"http://127.0.0.1:{host.port}/v1"])
            argv = ["python3", "/work/attack.py", str(host.port), str(host.bystander_port)]
            result = await runtime.run_program(argv, {})
            pool = runtime._client.pool
            open_relays = await asyncio.wrap_future(runtime._client.call(_open_connections(pool)))
            return host, result, open_relays

    host, result, open_relays = asyncio.run(main())
    assert result.exit_code == 0, result.stderr[-2000:]
    assert result.stdout.count("HTTP/1.1") == 3 and result.stdout.rstrip().endswith("held"), result.stdout
    assert host.bystander_hits == 0
    assert open_relays == 0


async def _open_connections(pool) -> int:
    """Relayed connections still open on the host once the execution's verdict is in."""
    await asyncio.sleep(0)
    tasks = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.startswith("Relay.")]
    return len(tasks)


def test_an_ordinary_command_has_no_network_and_no_program_packages():
    """The routes and the packages are the program's alone: a command of the same runtime (``run``), after
    ``prepare_execution`` named a route, still reaches nothing and imports nothing of the host's environment."""
    _require_root()
    code = (
        "import os, socket\n"
        "try: socket.create_connection(('127.0.0.1', {port}), timeout=2); print('REACHED')\n"
        "except OSError as e: print('unreachable', type(e).__name__)\n"
        "print(os.listdir('/opt/prime/site-packages'))\n"
        "try: os.listdir('/.programs')\n"
        "except PermissionError: print('hidden')\n"
    )

    async def main():
        host = Host("")
        async with host, _provisioned() as runtime:
            await runtime.prepare_execution([f"http://127.0.0.1:{host.port}/v1"])
            return await runtime.run(["python3", "-c", code.format(port=host.port)], {})

    result = asyncio.run(main())
    assert result.stdout.split("\n")[:3] == ["unreachable OSError", "[]", "hidden"], result


def test_a_program_past_its_wall_limit_is_stopped_naming_program_limits():
    _require_root()

    async def main():
        async with _provisioned(program_limits={"wall_s": 1, "cpu_s": 1}) as runtime:
            await runtime.prepare_execution([])
            return await runtime.run_program(["sleep", "30"], {})

    result = asyncio.run(main())
    assert result.exit_code != 0
    assert result.stderr.splitlines()[-1] == (
        "harness program stopped: wall time limit of 1.0 s exceeded (program_limits)"
    )


def test_a_script_needing_a_package_the_pool_lacks_is_refused_in_one_line():
    _require_root()
    script = '# /// script\n# dependencies = ["openai", "not-installed-anywhere>=1"]\n# ///\nprint(1)\n'
    pinned = '# /// script\n# dependencies = ["mcp==0.0.1"]\n# ///\nprint(1)\n'

    async def main():
        errors = []
        async with _provisioned() as runtime:
            for text in (script, pinned):
                try:
                    await runtime.prepare_uv_script(text)
                except SandboxError as e:
                    errors.append(str(e))
        return errors

    missing, version = asyncio.run(main())
    assert "\n" not in missing and "'not-installed-anywhere>=1'" in missing and "program_packages" in missing
    assert "\n" not in version and "'mcp==0.0.1'" in version and "offered at version" in version


def test_a_route_elsewhere_than_this_hosts_loopback_is_refused():
    from prime_orchestrator.sandbox.verifiers_runtime import SandboxPoolRuntime, SandboxPoolRuntimeConfig

    runtime = SandboxPoolRuntime(SandboxPoolRuntimeConfig())
    with pytest.raises(SandboxError, match="only kind"):
        asyncio.run(runtime.prepare_execution(["http://10.0.0.1:8000/v1"]))


def test_a_program_on_sandbox_nodes_is_refused_in_one_line():
    from prime_orchestrator.sandbox.verifiers_runtime import SandboxPoolRuntime, SandboxPoolRuntimeConfig

    runtime = SandboxPoolRuntime(SandboxPoolRuntimeConfig(urls=["http://127.0.0.1:1"]))
    runtime._client = SimpleNamespace(pool=None)
    with pytest.raises(SandboxError, match="local sandbox pool only") as e:
        asyncio.run(runtime.prepare_uv_script("print(1)\n"))
    assert "\n" not in str(e.value)


def test_a_script_without_dependencies_runs_on_a_pool_of_another_interpreter():
    """Before: a pool whose ``python`` is not this process's offers no packages, and a script needing none was
    launched with ``None`` as its interpreter."""
    from prime_orchestrator.sandbox.verifiers_runtime import SandboxPoolRuntime, SandboxPoolRuntimeConfig

    other = "/usr/bin/python3" if os.path.realpath("/usr/bin/python3") != os.path.realpath(sys.executable) else "/x"
    runtime = SandboxPoolRuntime(SandboxPoolRuntimeConfig())
    runtime._client = SimpleNamespace(pool=SimpleNamespace(config=SimpleNamespace(python=other, program_packages=[])))
    written = {}

    async def write(path, data):
        written[path] = data

    runtime.write = write
    argv = asyncio.run(runtime.prepare_uv_script("print(1)\n"))
    assert argv[0] == other and list(written.values()) == [b"print(1)\n"]
    with pytest.raises(SandboxError, match="program_packages"):
        asyncio.run(runtime.prepare_uv_script('# /// script\n# dependencies = ["openai"]\n# ///\nprint(1)\n'))


def test_the_models_command_cannot_interrupt_its_harness_program():
    """The program is PID 1 of its namespace; Python's SIGINT handler made it the one signal a command could end it
    with (`kill -INT 1`: exit 130, a failed rollout that trains nothing, where the episode should score). Now the
    program goes on and the command's own later output reaches the model."""
    _require_root()

    async def main():
        host = Host("kill -INT 1; kill -TERM 1; kill -HUP 1; sleep 0.2; echo still-here")
        async with host, _provisioned() as runtime:
            return host, await _bash_agent(host, runtime)

    host, result = asyncio.run(main())
    assert result.exit_code == 0, result.stderr[-2000:]
    (output,) = host.tool_outputs
    assert "still-here" in output, output
