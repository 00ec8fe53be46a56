"""A cgroup v2 pool in a cgroup that holds processes (a shell's scope, a service, a GPU host's job cgroup) delegates
the controllers itself (:mod:`prime_orchestrator.sandbox.delegate`). Checked for real on a GPU host's cgroup v2
(benchmarks/results/sandbox_disk_read.json, ``gpu-host-v2-leaf``: 4 processes moved, memory, pids, cpu and io
enforced, an execution's 8 x 120 MB children ended ``memory_limit`` at 256 MB where they ran ``ok`` without cgroups);
this VM's controllers are on cgroup v1, so here the cgroup files are plain files: what the pool writes, and the line
it says when it cannot. A cgroup given ``memory`` alone (the GPU host's own job cgroup) still delegates it."""

from __future__ import annotations

from pathlib import Path

from prime_orchestrator.sandbox import cgroups
from prime_orchestrator.sandbox.delegate import LEAF, delegate


def _cgroup(tmp_path: Path, controllers: str, procs: str = "") -> Path:
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "cgroup.controllers").write_text(controllers + "\n")
    (tmp_path / "cgroup.procs").write_text(procs)
    (tmp_path / "cgroup.subtree_control").write_text("")
    return tmp_path


def test_a_cgroup_its_parent_gives_the_controllers_moves_its_processes_and_enables_them(tmp_path):
    cgroup = _cgroup(tmp_path, "cpuset cpu io memory pids")
    assert delegate(cgroup) == ""
    assert (cgroup / LEAF).is_dir()
    assert (cgroup / "cgroup.subtree_control").read_text() == "+io"  # memory, pids, cpu, io written one by one


def test_a_cgroup_given_memory_alone_still_delegates_it_and_never_asks_for_pids(tmp_path, monkeypatch):
    # a GPU host's job cgroup: its parent enables only memory (and cpu, io) for it; the pool said it had no cgroups
    cgroup = _cgroup(tmp_path, "cpu io memory", procs="")
    written = _subtree_writes(monkeypatch)
    assert delegate(cgroup) == ""
    assert (cgroup / LEAF).is_dir() and written == ["+memory", "+cpu", "+io"]


def test_a_cgroup_with_all_it_is_given_enabled_already_moves_nothing(tmp_path):
    cgroup = _cgroup(tmp_path, "memory io")
    (cgroup / "cgroup.subtree_control").write_text("memory io\n")
    assert delegate(cgroup) == "" and not (cgroup / LEAF).exists()


def test_a_cgroup_without_memory_from_its_parent_is_one_line_naming_why(tmp_path):
    cgroup = _cgroup(tmp_path, "cpu pids")
    why = delegate(cgroup)
    assert "\n" not in why and "not given the memory controller by its parent" in why
    assert not (cgroup / LEAF).exists()


def test_a_v2_cgroup_given_memory_alone_gives_the_pool_memory_cgroups_without_pids(tmp_path, monkeypatch):
    # The pool's whole path on such a host: delegate, the shared and the pool's cgroups, a slot's limits
    job = _cgroup(tmp_path / "job", "memory", procs="")
    written = _subtree_writes(monkeypatch)
    monkeypatch.setattr(cgroups, "own_cgroups", lambda: {"": "/job"})
    monkeypatch.setattr(cgroups, "mounts", lambda: {"": ("/", str(tmp_path))})
    made, why = cgroups.Cgroups.detect("pool")
    assert made is not None and made.version == 2, why
    assert made.no_tasks == f"the pids controller is not enabled below {job}", made.no_tasks
    made._set_limits("s0", 64 << 20, 8)  # what enter writes (the rest opens files only the kernel makes)
    slot = job / cgroups.SHARED / "pool" / "s0"
    assert (slot / "memory.max").read_text() == str(64 << 20) and (slot / "memory.oom.group").read_text() == "1"
    assert not (slot / "pids.max").exists() and not [w for w in written if "pids" in w], written
    assert written.count("+memory") == 3, written  # the job's, the shared cgroup's and the pool's


def _subtree_writes(monkeypatch) -> list[str]:
    """What is written to any ``cgroup.subtree_control`` from here on (a plain file keeps only the last write)."""
    written, write_text = [], Path.write_text

    def record(path: Path, data: str, *args, **kwargs):
        if path.name == "cgroup.subtree_control":
            written.append(data)
        return write_text(path, data, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", record)
    return written


def test_processes_that_never_leave_are_one_line_not_a_hang(tmp_path):
    # a plain file keeps listing the pid however often it is moved: a cgroup whose processes keep coming back
    cgroup = _cgroup(tmp_path, "memory pids", procs="4242\n")
    why = delegate(cgroup)
    assert "\n" not in why and "kept appearing" in why and str(cgroup) in why


def test_a_v2_slot_reports_its_peak_from_memory_peak_which_each_execution_resets(tmp_path, monkeypatch):
    # Linux 6.12+: a write to memory.peak resets the peak its descriptor reads. Before, every v2 execution had
    # memory_peak_mb None, and a pool's total_memory_mb could not be told from the slot's own limit.
    _cgroup(tmp_path / "job", "memory pids", procs="")
    monkeypatch.setattr(cgroups, "own_cgroups", lambda: {"": "/job"})
    monkeypatch.setattr(cgroups, "mounts", lambda: {"": ("/", str(tmp_path))})
    made, why = cgroups.Cgroups.detect("pool")
    assert made is not None, why
    slot = tmp_path / "job" / cgroups.SHARED / "pool" / "s0"
    slot.mkdir()
    (slot / "cgroup.procs").write_text("")
    (slot / "memory.peak").write_text("x" * 12)  # the kernel's file: any write resets it
    made.enter("s0", 64, 8)
    assert (slot / "memory.peak").read_text().startswith("0")  # reset before the execution
    (slot / "memory.peak").write_text(f"{96 << 20}\n")
    assert made.peak_mb("s0") == 96.0
    made.close()
