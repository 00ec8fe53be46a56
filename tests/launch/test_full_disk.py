"""A full disk while the trainer writes (checkpoint, weights): one line naming the errno and the path, from the
trainer itself and from `rl` (whose log files sit on the full disk, cut off). The disk is a small tmpfs mounted
in a private mount namespace (``unshare``); the tests skip where that is not allowed."""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launch.launch_fakes import HERE, free_port
from tests.trainer.trainer_utils import TINY_QWEN3, write_rollouts


def _can_mount() -> bool:
    try:
        probe = subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs tmpfs /mnt"],
            capture_output=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(not _can_mount(), reason="needs unshare --user --mount (a private tmpfs)")


def on_small_disk(disk: Path, size_kib: int, setup: str, cmd: list[str], env: dict[str, str], timeout: float):
    """Run ``cmd`` with a ``size_kib`` tmpfs mounted on ``disk`` (after the shell line ``setup``)."""
    disk.mkdir(parents=True, exist_ok=True)
    script = f"mount -t tmpfs -o size={size_kib}k tmpfs {shlex.quote(str(disk))} && {setup} exec {shlex.join(cmd)}"
    return subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_trainer_checkpoint_on_full_disk_is_one_line(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_QWEN3))
    staged = tmp_path / "staged"
    write_rollouts(staged, steps=2, num_ranks=1)
    disk = tmp_path / "disk"
    cmd = [sys.executable, "-m", "prime_trainer.entrypoints.trainer", "--model.name", str(model), "--output-dir",
           str(disk), "--max-steps", "2", "--seq-len", "32", "--async-level", "1", "--ckpt.interval", "1",
           "--log.file", "false", "--log.level", "warning"]  # fmt: skip
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)}
    proc = on_small_disk(disk, 320, f"cp -r {shlex.quote(str(staged))}/. {shlex.quote(str(disk))} &&", cmd, env, 300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    # What was being written (the first step's weights or checkpoint, whichever filled the disk) and where.
    assert re.match(
        rf"error: No space left on device \(errno 28 ENOSPC\) writing (weights|checkpoint) step \d+ to {disk}/", last
    ), last


def test_rl_names_the_full_disk_its_logs_cannot_hold(tmp_path, rl_env):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "prime_launch.entrypoints.rl", "@", str(HERE / "rl_example.toml"), "--output-dir",
           str(out), "--inference.server.port", str(free_port()), "--stop-grace", "3"]  # fmt: skip
    proc = on_small_disk(out, 256, "", cmd, {**rl_env, "FAKE_FILL_DISK": "1"}, 120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: No space left on device (errno 28 ENOSPC): {out} has "), proc.stderr
    assert " exited with code " in proc.stderr or " was killed by " in proc.stderr, proc.stderr
