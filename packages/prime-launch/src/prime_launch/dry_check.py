"""``rl --dry-run`` checks what only the orchestrator can: its environments' settings, which verifiers validates (a
misspelt ``args`` key). prime-launch does not import the orchestrator (nor verifiers), so it runs each orchestrator's
own ``--dry-run``, with the command and environment ``rl`` would start it with, into a scratch output directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prime_core.progress import NOTICE_EVERY_S

from prime_launch.plan import role
from prime_launch.process import ProcessSpec

CHECK_TIMEOUT_S = 300.0
"""Bound on the orchestrators' checks together (they import verifiers and each environment: seconds)."""


def check_orchestrators(specs: list[ProcessSpec], timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Run every orchestrator's ``--dry-run`` side by side; the first that refuses its config raises ``ValueError``
    with its one line (``<process>: <line>``)."""
    checked = [spec for spec in specs if role(spec.name) == "orchestrator"]
    with tempfile.TemporaryDirectory(prefix="prime-rl-dry-run-") as scratch:
        procs = {spec.name: _start(spec, Path(scratch)) for spec in checked}
        try:
            start = time.monotonic()
            for spec in checked:
                code = _wait(procs[spec.name], spec, start, timeout_s)
                if code != 0:
                    raise ValueError(f"{spec.name}: {_last_line(Path(scratch) / f'{spec.name}.err', code)}")
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def _wait(proc: subprocess.Popen, spec: ProcessSpec, start: float, timeout_s: float) -> int:
    """The check's exit code, within ``timeout_s`` of ``start``; a line every minute says what it waits for."""
    what = f"{spec.name}: its config check ({Path(spec.cmd[0]).name} --dry-run)"
    while True:
        waited = time.monotonic() - start
        try:
            return proc.wait(timeout=max(min(NOTICE_EVERY_S, timeout_s - waited), 0.0))
        except subprocess.TimeoutExpired:
            waited = time.monotonic() - start
            if waited >= timeout_s:
                raise ValueError(f"{what} did not finish within {timeout_s:.0f} s") from None
            print(f"rl: still waiting for {what} after {waited:.0f} s (bound {timeout_s:.0f} s)", file=sys.stderr)


def _start(spec: ProcessSpec, scratch: Path) -> subprocess.Popen:
    # Written to the scratch directory, not the run's: the check must leave the configs rl wrote as they are.
    cmd = [*spec.cmd, "--dry-run", "--output-dir", str(scratch / spec.name)]
    with open(scratch / f"{spec.name}.err", "wb") as err:
        return subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **spec.env},
            cwd=spec.cwd, start_new_session=True,
        )  # fmt: skip


def _last_line(err_file: Path, code: int) -> str:
    """The child's one-line error (``error: `` dropped: rl adds its own), else the last line it wrote."""
    lines = [line.strip() for line in err_file.read_text(errors="replace").splitlines() if line.strip()]
    if not lines:
        return f"its config check (--dry-run) exited with code {code} and wrote nothing"
    return lines[-1].removeprefix("error: ")
