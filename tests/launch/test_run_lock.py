"""Two `rl` launches on one output directory: the second is refused with one line naming the first, whatever its flags
(``--overwrite`` deleted the running run's files, ``--resume`` rewound them, a plain launch before the first step
cleared them as a failed start's), and the running run goes on untouched. The lock goes with its launcher."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
from prime_launch.run_lock import DirectoryInUse, lock_output_dir

from tests.launch.test_rl_launcher import alive, pids_of, rl_cmd, start_hanging_run, wait_for


@pytest.mark.parametrize("flags", [("--overwrite",), ("--dry-run",), ()], ids=["overwrite", "dry-run", "plain"])
def test_a_second_launch_on_a_running_runs_directory_is_refused(tmp_path, rl_env, flags):
    out = tmp_path / "run"
    first = start_hanging_run(out, rl_env)
    try:
        pids = pids_of(out)
        before = {p.relative_to(out): p.read_bytes() for p in (out / "configs").iterdir()}
        second = subprocess.run(rl_cmd(out, *flags), env=rl_env, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr
        assert second.stderr.count("\n") == 1, second.stderr
        assert second.stderr.startswith(f"error: output directory {out} is in use by another rl launch (pid "
                                        f"{first.pid}"), second.stderr  # fmt: skip
        # The running run's files and processes are untouched.
        assert {p.relative_to(out): p.read_bytes() for p in (out / "configs").iterdir()} == before
        assert "trainer ready" in (out / "logs" / "trainer.log").read_text()
        assert pids_of(out) == pids and all(alive(p) for group in pids.values() for p in group)
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 128 + signal.SIGTERM


def test_the_lock_goes_with_a_killed_launcher(tmp_path, rl_env):
    out = tmp_path / "run"
    first = start_hanging_run(out, rl_env)
    pids = pids_of(out)
    first.kill()
    first.wait()
    everything = [p for group in pids.values() for p in group]
    wait_for(lambda: not any(alive(p) for p in everything), 30, "its children to follow it")
    again = subprocess.run(rl_cmd(out, "--overwrite"), env=rl_env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr


def test_after_a_kill_9_of_the_launcher_the_lock_is_free_only_once_its_processes_are_gone(tmp_path, rl_env):
    """rl killed -9 while a descendant of the trainer is slow to stop (it ignores SIGTERM; the watchdog SIGKILLs it after
    the grace). Before: the lock went with rl at once, so a relaunch (`rl --resume` from a supervisor) took the
    directory and rewound it while the stopped run's processes still wrote there. Now the watchdog holds the lock until
    they are gone."""
    out = tmp_path / "run"
    first = start_hanging_run(out, {**rl_env, "FAKE_STUBBORN": "trainer"})
    stubborn = int((out / "trainer.stubborn.pid").read_text())
    everything = [stubborn, *(p for group in pids_of(out).values() for p in group)]
    try:
        first.kill()
        first.wait()
        while True:  # bounded by the watchdog's grace (3 s) and the test's timeout
            try:
                lock = lock_output_dir(out)
            except DirectoryInUse:
                continue
            break
        left = [pid for pid in everything if alive(pid)]
        lock.close()
        assert left == [], f"the lock was free while {left} of the killed run still ran"
    finally:
        for pid in everything:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("how", ["deleted", "moved", "emptied"])
def test_a_run_directory_deleted_or_moved_under_the_run_stops_it_with_one_line(tmp_path, rl_env, how):
    """Before: nothing noticed (a minute and more): the processes made the paths they write again (progress files, a
    checkpoint in an empty skeleton) while the run's logs and files were gone or elsewhere."""
    out = tmp_path / "run"
    first = subprocess.Popen(rl_cmd(out, "--console", "quiet"), env={**rl_env, "FAKE_HANG": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    log = out / "logs" / "trainer.log"
    wait_for(lambda: log.exists() and "trainer ready" in log.read_text() and len(pids_of(out)) == 3, 60, "the fakes")
    pids = pids_of(out)
    try:
        # The processes go on writing their files meanwhile: rmtree can meet one made after it listed a directory.
        if how == "deleted":
            wait_for(lambda: shutil.rmtree(out, ignore_errors=True) or not out.exists(), 30, "the directory gone")
        elif how == "moved":
            out.rename(tmp_path / "elsewhere")
        else:
            for child in out.iterdir():
                if child.is_dir():
                    wait_for(
                        lambda c=child: shutil.rmtree(c, ignore_errors=True) or not c.exists(), 30, f"{child} gone"
                    )
                else:
                    child.unlink(missing_ok=True)
        _, err = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 1, err
    assert err.count("\n") == 1 and err.startswith(f"error: output directory {out} was deleted or moved while "), err
    wait_for(lambda: not any(alive(p) for group in pids.values() for p in group), 30, "every process to be gone")
