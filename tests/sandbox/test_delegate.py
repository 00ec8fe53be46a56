"""A cgroup v2 pool in a cgroup that holds processes (a shell's scope, a service, a GPU host's job cgroup) delegates
the controllers itself (:mod:`prime_orchestrator.sandbox.delegate`). Checked for real on a GPU host's cgroup v2
(benchmarks/results/sandbox_disk_read.json, ``gpu-host-v2-leaf``: 4 processes moved, memory, pids, cpu and io
enforced, an execution's 8 x 120 MB children ended ``memory_limit`` at 256 MB where they ran ``ok`` without cgroups);
this VM's controllers are on cgroup v1, so here the cgroup files are plain files: what the pool writes, and the line
it says when it cannot."""

from __future__ import annotations

from pathlib import Path

from prime_orchestrator.sandbox.delegate import LEAF, delegate


def _cgroup(tmp_path: Path, controllers: str, procs: str = "") -> Path:
    (tmp_path / "cgroup.controllers").write_text(controllers + "\n")
    (tmp_path / "cgroup.procs").write_text(procs)
    (tmp_path / "cgroup.subtree_control").write_text("")
    return tmp_path


def test_a_cgroup_its_parent_gives_the_controllers_moves_its_processes_and_enables_them(tmp_path):
    cgroup = _cgroup(tmp_path, "cpuset cpu io memory pids")
    assert delegate(cgroup) == ""
    assert (cgroup / LEAF).is_dir()
    assert (cgroup / "cgroup.subtree_control").read_text() == "+io"  # memory, pids, cpu, io written one by one


def test_a_cgroup_without_memory_and_pids_from_its_parent_is_one_line_naming_why(tmp_path):
    # a GPU host's job cgroup: its parent enables only memory for it
    cgroup = _cgroup(tmp_path, "memory")
    why = delegate(cgroup)
    assert "\n" not in why and "not given the memory and pids controllers by its parent" in why
    assert not (cgroup / LEAF).exists()


def test_processes_that_never_leave_are_one_line_not_a_hang(tmp_path):
    # a plain file keeps listing the pid however often it is moved: a cgroup whose processes keep coming back
    cgroup = _cgroup(tmp_path, "memory pids", procs="4242\n")
    why = delegate(cgroup)
    assert "\n" not in why and "kept appearing" in why and str(cgroup) in why
