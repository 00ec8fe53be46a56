"""A process's log in the run directory is bounded, whatever the process (or an environment, tool or program it runs)
writes: before, every child wrote straight into ``logs/<name>.log``, and an env reward printing a megabyte a rollout
filled the run's disk over a run left alone."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from pathlib import Path

from prime_launch.log_pump import LogPump
from prime_launch.process import ProcessManager, ProcessSpec

MIB = 1 << 20

# 24 MiB of numbered lines, half from a grandchild that cleared its environment and left the child's session.
FLOOD = r"""
import os, subprocess, sys
line = lambda who, i: f"{who} {i:06d} ".ljust(1023, "x") + "\n"
grandchild = subprocess.Popen([sys.executable, "-c",
    "import os, sys\nfor i in range(12288): sys.stdout.write(f'grandchild {i:06d} '.ljust(1023, 'x') + chr(10))\n"],
    env={}, start_new_session=True)
for i in range(12288):
    sys.stdout.write(line("child", i))
sys.stdout.flush()
grandchild.wait()
print("child done", flush=True)
"""


def test_a_child_writing_24_mib_leaves_at_most_twice_the_bound_and_its_last_line(tmp_path):
    manager = ProcessManager(grace_s=0.5, watchdog=False, max_log_bytes=4 * MIB)
    log = tmp_path / "logs" / "orchestrator.log"
    proc = manager.start(ProcessSpec("orchestrator", [sys.executable, "-c", FLOOD], log))
    assert proc.wait(timeout=120) == 0
    manager.stop_all()
    manager.close()
    older = log.with_name("orchestrator.log.1")
    assert log.stat().st_size <= 4 * MIB and older.stat().st_size <= 4 * MIB
    assert sorted(p.name for p in log.parent.iterdir()) == ["orchestrator.log", "orchestrator.log.1"]
    text = log.read_text()
    assert text.endswith("child done\n")
    assert "[rl] this log reached 4 MiB" in text.splitlines()[0]
    assert "orchestrator.log.1, older output is gone" in text.splitlines()[0]


def test_a_restarted_child_appends_to_its_log(tmp_path):
    manager = ProcessManager(grace_s=0.5, watchdog=False, max_log_bytes=MIB)
    log = tmp_path / "trainer.log"
    log.write_text("first life\n")
    proc = manager.start(ProcessSpec("trainer", [sys.executable, "-c", "print('second life')"], log), append_log=True)
    assert proc.wait(timeout=60) == 0
    manager.stop_all()
    manager.close()
    assert log.read_text() == "first life\nsecond life\n"


def test_a_disk_that_refuses_the_log_is_said_once_and_the_child_is_never_blocked(tmp_path, capfd):
    read_fd, write_fd = os.pipe()
    pump = LogPump(read_fd, Path("/dev/full"), 4 * MIB).start()

    def write():  # 8 MiB through a 64 KiB pipe: it returns only if the pump drains what it cannot store
        for _ in range(128):
            os.write(write_fd, b"y" * (1 << 16))
        os.close(write_fd)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(timeout=30)
    assert not writer.is_alive()
    assert pump.join(timeout=30)
    assert pump.refused is not None and pump.refused.errno == errno.ENOSPC
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "No space left on device (errno 28 ENOSPC) writing /dev/full" in err, err
    assert "that process's later output is dropped" in err


def test_log_to_bounds_what_a_multi_node_step_writes(tmp_path):
    """``prime-launch log-to``: the multi-node job's steps write their logs through it (``multi_node_rl.sbatch.j2``)."""
    log = tmp_path / "orchestrator.log"
    cmd = [sys.executable, "-m", "prime_launch.entrypoints.cli", "log-to", str(log), "--max-mb", "1"]
    lines = "".join(f"line {i:05d} ".ljust(99, "x") + "\n" for i in range(30000)).encode()  # 2.9 MiB
    result = subprocess.run(cmd, input=lines + b"last\n", capture_output=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert log.stat().st_size <= MIB and log.with_name("orchestrator.log.1").stat().st_size <= MIB
    assert log.read_bytes().endswith(b"line 29999 " + b"x" * 88 + b"\nlast\n")
    refused = subprocess.run([*cmd[:-1], "0"], input="", capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and refused.stderr == "error: max-mb: 0 is not a positive number of MiB\n"
