"""SIGKILL and SIGSTOP of the parts the orchestrator keeps going, at a random point of a short run of the real
orchestrator (its env servers, the torch engine in-process): an env-server worker, a shared tool server, a sandbox
zygote. Each asserts the detection time within its bound, the one-line cause, that the run finishes all its steps
(the part replaced, the rollouts it held re-run or counted failed) and that no process is left (slow: each run starts
env servers twice on a 2-core host). The random point is drawn from a seed printed with each test (``FAULT_SEED``)."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from multiprocessing import forkserver

import pytest
from prime_core.progress import PROGRESS_DIR_VAR, read_progress
from prime_orchestrator.env_server import pool_workers
from prime_orchestrator.proc_tree import ZYGOTE_MARK, command, family, process_tree
from prime_orchestrator.tool_watch import shared_tool_server

from tests.faults.test_env_faults import fault_config, step_metrics
from tests.fixtures.vf import use_vf_envs
from tests.orchestrator.test_integration import make_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.xdist_group("multiprocess"),
    pytest.mark.timeout(2400),
]
SIGNALS = pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["SIGKILL", "SIGSTOP"])
# The env watch probes every 2 s and a dead worker is seen within 0.2 s; the rest is a loaded 2-core host.
WATCH_LIMIT_S = 10.0
HANG_TIMEOUT_S = 20.0  # SandboxPoolConfig.hang_timeout_s, the pool's own bound for a zygote that forks nothing


class EnvLog(logging.Handler):
    """The orchestrator's env-server warnings, with the time each was logged."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((time.monotonic(), record.getMessage()))


def run_with_fault(config, victim, sig: signal.Signals, request, detect=None) -> dict:
    """Run the orchestrator; once ``victim(orch)`` names a pid, wait a random moment and send it ``sig``. With
    ``detect(fault)``, ``fault["detected"]`` is the seconds until it first returned true."""
    from prime_core.logging import setup_logging
    from prime_orchestrator.orchestrator import Orchestrator

    seed = int(os.environ.get("FAULT_SEED", random.randrange(1 << 30)))
    print(f"{request.node.name}: FAULT_SEED={seed}")
    setup_logging("orchestrator", level="info")
    log = EnvLog()
    logging.getLogger("prime.orchestrator.env").addHandler(log)
    orch, seen, fault = Orchestrator(config), set(), {}

    async def note_servers():  # every process of every env server (an orphan would leave the tree)
        while True:
            for pool in orch.pools.values():
                seen.update(process_tree(pool.server.pid) if pool.server.pid else ())
            await asyncio.sleep(0.1)

    async def inject():
        while victim(orch) is None:
            await asyncio.sleep(0.1)
        await asyncio.sleep(random.Random(seed).uniform(0, 1))
        pid = victim(orch)
        fault.update(pid=pid, command=command(pid), parent=family(pid).get(pid, (None,))[0])
        os.kill(pid, sig)
        fault["at"] = time.monotonic()
        while detect is not None and not detect(fault):
            await asyncio.sleep(0.1)
        fault["detected"] = time.monotonic() - fault["at"]

    async def main():
        helpers = [asyncio.create_task(note_servers()), asyncio.create_task(inject())]
        try:
            await orch.run()
        finally:
            for task in helpers:
                task.cancel()

    start = time.monotonic()
    try:
        asyncio.run(main())
        fault["error"] = None
    except Exception as e:  # the test asserts on it
        fault["error"] = e
    finally:
        logging.getLogger("prime.orchestrator.env").removeHandler(log)
    for pid in seen:  # a stopped process that outlived its tree would never end on its own
        if process_tree(pid):
            os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 5  # a process killed at the close needs a moment to be gone
    while any(process_tree(pid) for pid in seen) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: command(pid) for pid in seen if process_tree(pid)}
    fault.update(orch=orch, took=time.monotonic() - start, left=left)
    fault["found"] = [(t - fault["at"], m) for t, m in log.records if "at" in fault and t >= fault["at"]]
    return fault


def server_pid(orch) -> int | None:
    (pool,) = orch.pools.values()
    return pool.server.pid


def assert_replaced(fault: dict, expected: str, max_steps: int, tmp_path) -> str:
    assert fault["error"] is None and fault["left"] == {}, fault
    assert "at" in fault, "the fault was never injected"
    line = next((m for took, m in fault["found"] if expected in m), None)
    assert line is not None, fault["found"]
    took = next(t for t, m in fault["found"] if m == line)
    assert took < WATCH_LIMIT_S and "\n" not in line, (took, line)
    assert sorted(step_metrics(tmp_path)) == list(range(max_steps))
    (pool,) = fault["orch"].pools.values()
    assert pool.server.num_restarts >= 1
    print(f"found after {took:.1f} s: {line}; {max_steps} steps in {fault['took']:.0f} s")
    return line


@SIGNALS
def test_an_env_worker_killed_or_stopped_is_replaced(tmp_path, tiny_model, torch_server, monkeypatch, request, sig):
    use_vf_envs(monkeypatch)
    config = fault_config(tmp_path, tiny_model, torch_server, "", env={"num_workers": 2}, max_steps=3,
                          recovery={"min_ok_fraction": 0})  # fmt: skip

    def worker(orch) -> int | None:
        pid = server_pid(orch)
        workers = sorted(pool_workers(pid)) if pid else []
        return workers[0] if len(workers) == 2 else None

    fault = run_with_fault(config, worker, sig, request)
    if sig == signal.SIGKILL:
        line = assert_replaced(fault, f"env server worker(s) [{fault.get('pid')}] died; restarting the server", 3,
                               tmp_path)  # fmt: skip
    else:
        line = assert_replaced(fault, f"pid {fault.get('pid')} (", 3, tmp_path)
        assert "was stopped by a signal and would never resume; killed it; replacing the server" in line


@pytest.fixture(scope="module")
def tool_model_server(tmp_path_factory):
    """A tiny model whose chat template renders tools (the default renderer refuses them), sampling freely."""
    from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
    from tests.fixtures.scripted import ScriptedServer

    server = ScriptedServer(
        save_tiny_model(tmp_path_factory.mktemp("tool_model"), build_tool_tokenizer()), lambda p: None
    )
    yield server
    server.stop()


@SIGNALS
def test_a_tool_server_killed_or_stopped_gets_its_env_server_replaced(
    tmp_path, tool_model_server, monkeypatch, request, sig
):
    use_vf_envs(monkeypatch)
    env = {"args": {"faults": "", "tools": True}}
    model = tool_model_server.config.model.name
    config = fault_config(tmp_path, model, tool_model_server, "", env=env, max_steps=3, seq_len=1024,
                          recovery={"min_ok_fraction": 0})  # fmt: skip

    def tool_server(orch) -> int | None:
        pid = server_pid(orch)
        tools = [p for p in family(pid, without_sandboxes=True) if shared_tool_server(p)[0]] if pid else []
        return tools[0] if tools else None

    fault = run_with_fault(config, tool_server, sig, request)
    line = assert_replaced(fault, f"pid {fault.get('pid')} (", 3, tmp_path)
    assert "-m vf_faults.tools" in line
    if sig == signal.SIGKILL:
        assert f"tool server pid {fault['pid']} (" in line and "exited; its worker pid" in line, line
    else:
        assert "was stopped by a signal" in line, line


def reference_policy(num_examples: int):
    """Every reply is the task's reference solution, after a short sleep (executions stay in flight a moment)."""
    from code_tasks import generate_tasks

    tasks = {t["prompt"]: t for t in generate_tasks(num_examples, seed=0)}

    def script(prompt: str) -> str | None:
        task = next((t for text, t in tasks.items() if text in prompt), None)
        code = "import time\ntime.sleep(0.3)\n" + task["reference"] if task else None
        return f"Here is my solution.\n```python\n{code}```\n" if code else None

    return script


def zygote(orch) -> int | None:
    """A sandbox zygote of the env server (not one of the supervisors it forks, which carry its command line)."""
    pid = server_pid(orch)
    tree = family(pid) if pid else {}
    marked = {p for p in tree if ZYGOTE_MARK in _cmdline(p)}
    return next((p for p, (parent, _) in tree.items() if p in marked and parent not in marked), None)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@SIGNALS
def test_a_sandbox_zygote_killed_or_stopped_is_replaced_by_its_pool(tmp_path, monkeypatch, request, capfd, sig):
    if os.geteuid() != 0:
        pytest.skip("the sandbox pool needs root")
    from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
    from tests.fixtures.scripted import ScriptedServer

    monkeypatch.setenv(PROGRESS_DIR_VAR, str(tmp_path / "progress"))  # the env worker's pool reports there
    (tmp_path / "progress").mkdir()
    # The env servers fork from multiprocessing's forkserver, which writes to the stderr of the test that started it:
    # a forkserver an earlier test started sends the pool's warning to that test's capture, not this one's.
    forkserver._forkserver._stop()
    server = ScriptedServer(save_tiny_model(tmp_path / "model", build_tool_tokenizer()), reference_policy(50))
    env = {"id": "code-tasks", "args": {"num_examples": 50, "wall_s": 2}, "rollout_timeout": 300}
    # Long enough that the fault lands mid-run: a scripted reply is scored in about a second.
    config = make_config(tmp_path, server.config.model.name, server, env=[env], max_steps=6, async_level=5,
                         batch_size=16, num_trainer_ranks=1, seq_len=2048, sampling={"max_tokens": 1024},
                         recovery={"min_ok_fraction": 0})  # fmt: skip

    def replaced(fault: dict) -> bool:  # the pool's heartbeat counts the replacement
        record = read_progress(tmp_path / "progress" / f"sandbox_pool_{fault['parent']}.json")
        return record is not None and record.counters.get("zygotes_replaced", 0) >= 1

    try:
        fault = run_with_fault(config, zygote, sig, request, detect=replaced)
    finally:
        server.stop()
    assert fault["error"] is None and fault["left"] == {}, fault
    record = read_progress(tmp_path / "progress" / f"sandbox_pool_{fault['parent']}.json")
    # SIGKILL: found at the pool's next execution; SIGSTOP: once it forked nothing for hang_timeout_s.
    limit = WATCH_LIMIT_S if sig == signal.SIGKILL else HANG_TIMEOUT_S + WATCH_LIMIT_S
    assert "detected" in fault, "the run ended before the pool replaced its zygote"
    assert fault["detected"] < limit, fault
    lines = [line for line in capfd.readouterr().err.splitlines() if f"sandbox zygote 0 (pid {fault['pid']})" in line]
    assert lines and lines[0].endswith("; replacing it"), lines
    assert ("died (exit -9)" if sig == signal.SIGKILL else "forked nothing for 20.0 s") in lines[0], lines
    metrics = step_metrics(tmp_path)
    assert sorted(metrics) == list(range(6))
    failed = sum(m["failed/code-tasks"] for m in metrics.values())
    # SIGKILL: what the zygote was running fails (sandbox_error: not the code's fault), named; the rest scores.
    assert failed <= 8 and all(m["env_servers/code-tasks/restarts"] == 0 for m in metrics.values()), metrics
    print(f"{signal.Signals(sig).name} zygote: found after {fault['detected']:.1f} s: {lines[0]}; {record.counters}; "
          f"{failed} rollouts failed; run {fault['took']:.0f} s")  # fmt: skip
