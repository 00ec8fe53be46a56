"""W&B is a side channel of a run that lasts days: its failures must not stop, crash or hang the run.

Each W&B case runs in a fresh Python process (W&B keeps a per-process service, exit hooks and global state), offline
or against a local server that never answers, so no network is needed."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs wandb")

KILL_SERVICE = """
import os, signal
def children(pid):
    found = []
    for entry in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{entry}/stat").read()
        except (OSError, ValueError):
            continue
        if entry.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found += [int(entry), *children(int(entry))]
    return found
for pid in children(os.getpid()):
    if b"wandb-core" in open(f"/proc/{pid}/cmdline", "rb").read():
        os.kill(pid, signal.SIGKILL)
"""


def run_script(tmp_path, body: str, env: dict[str, str] | None = None, timeout: float = 120):
    script = tmp_path / "script.py"
    script.write_text(
        "import logging, sys\nlogging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "from pathlib import Path\nfrom prime_core.config.shared import WandbConfig\n"
        "from prime_core.monitor import WandbMonitor\n" + textwrap.dedent(body)
    )
    environ = {"WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path), "HOME": str(tmp_path)}
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, **environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_dead_wandb_service_switches_wandb_off_and_the_run_goes_on(tmp_path):
    """Before, the next `log` after W&B's service process died raised ConnectionResetError: the trainer or the
    orchestrator crashed on a metrics side channel, and the exit printed a second traceback."""
    done = run_script(
        tmp_path,
        f"""
        m = WandbMonitor(WandbConfig(enabled=True, offline=True), "trainer", {{}}, dir=Path("."))
        m.log(0, {{"loss": 1.0}})
        {KILL_SERVICE.strip().replace(chr(10), chr(10) + "        ")}
        for step in range(1, 4):
            m.log(step, {{"loss": 1.0}})
        m.close()
        print("run went on")
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "run went on" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if "W&B" in line]
    # The broken connection shows at the next log, or (when W&B buffered those) at closing: one line either way.
    assert len(warnings) == 1, done.stderr
    assert "W&B logging stopped at step" in warnings[0] or "W&B did not finish" in warnings[0], done.stderr
    assert "Traceback" not in done.stderr


def test_a_wandb_server_that_does_not_answer_is_one_line_at_start(tmp_path):
    """Before, wandb's CommError reached the entry point as a traceback."""
    silent = socket.socket()  # listens and never accepts: the kernel completes the handshakes, nobody answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    try:
        done = run_script(
            tmp_path,
            """
            from prime_core.monitor import MonitorUnavailable
            try:
                WandbMonitor(WandbConfig(enabled=True), "orchestrator", {}, dir=Path("."))
            except MonitorUnavailable as e:
                print("refused:", e)
            """,
            env={
                "WANDB_BASE_URL": f"http://127.0.0.1:{silent.getsockname()[1]}",
                "WANDB_API_KEY": "a" * 40,
                "WANDB_INIT_TIMEOUT": "3",
            },
        )
    finally:
        silent.close()
    refused = [line for line in done.stdout.splitlines() if line.startswith("refused:")]
    assert len(refused) == 1, (done.stdout, done.stderr)
    assert "W&B did not start" in refused[0] and "monitor.wandb.offline" in refused[0]


def test_runs_of_one_process_each_keep_their_wandb_run(tmp_path):
    """The multi-tenant trainer holds one W&B run per tenant in one process. Before, starting the second run
    finished the first (``reinit=True``), whose next `log` raised UsageError and stopped the trainer."""
    done = run_script(
        tmp_path,
        """
        a = WandbMonitor(WandbConfig(enabled=True, offline=True, name="a"), "trainer", {}, dir=Path("."))
        b = WandbMonitor(WandbConfig(enabled=True, offline=True, name="b"), "trainer", {}, dir=Path("."))
        for step in range(3):
            a.log(step, {"loss": 1.0})
            b.log(step, {"loss": 2.0})
        print("both logging:", a._run is not None and b._run is not None)
        a.close()
        b.close()
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "both logging: True" in done.stdout and "W&B logging stopped" not in done.stderr


def test_closing_waits_for_wandb_at_most_its_bound(monkeypatch, caplog):
    """A W&B server that stopped answering mid-run kept ``finish()`` uploading forever: the finished run never
    exited. Closing now gives up after ``WANDB_FINISH_TIMEOUT_S`` with a warning naming the local files."""
    from pathlib import Path

    from prime_core import monitor

    class Stuck:
        def finish(self):
            time.sleep(3600)

    m = monitor.WandbMonitor.__new__(monitor.WandbMonitor)
    m._run, m._dir, m._failed = Stuck(), Path("/runs/x"), False
    monkeypatch.setattr(monitor, "WANDB_FINISH_TIMEOUT_S", 0.5)
    closing = threading.Thread(target=m.close, daemon=True)
    start = time.monotonic()
    with caplog.at_level("WARNING"):
        closing.start()
        closing.join(30)
    assert not closing.is_alive() and time.monotonic() - start < 10
    assert "W&B did not finish uploading within 0.5 s (/runs/x/wandb; `wandb sync` uploads it)" in caplog.text
