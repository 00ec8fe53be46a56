"""prime-launch slurm: rendered scripts (always) and a real single-node SLURM cluster (slow, root + apt)."""

import contextlib
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch.launch_fakes import HERE

CLI = [sys.executable, "-m", "prime_launch.entrypoints.cli", "slurm"]


def render(tmp_path: Path, kind: str, *args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, kind, *args, "--output-dir", str(tmp_path / "run"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_single_node_rl_script(tmp_path):
    result = render(
        tmp_path,
        "rl",
        "@",
        str(HERE / "rl_example.toml"),
        "--slurm.partition",
        "gpu",
        "--slurm.account",
        "acct",
        "--slurm.time",
        "02:00:00",
        "--slurm.gpus-per-node",
        "4",
        "--slurm.setup",
        "source .venv/bin/activate",
    )
    assert result.returncode == 0, result.stderr
    script = result.stdout
    for line in (
        "#SBATCH --partition=gpu",
        "#SBATCH --account=acct",
        "#SBATCH --time=02:00:00",
        "#SBATCH --gres=gpu:4",
        "#SBATCH --nodes=1",
        "source .venv/bin/activate",
    ):
        assert line in script
    rl_toml = tmp_path / "run" / "slurm" / "rl.toml"
    assert f"rl @ {rl_toml}" in script and rl_toml.is_file()
    assert subprocess.run(["bash", "-n", str(tmp_path / "run" / "slurm" / "rl.sbatch")]).returncode == 0


def test_multi_node_rl_script(tmp_path):
    result = render(
        tmp_path,
        "rl",
        "@",
        str(HERE / "rl_example.toml"),
        "--slurm.num-inference-nodes",
        "2",
        "--slurm.num-trainer-nodes",
        "2",
        "--slurm.gpus-per-node",
        "8",
        "--slurm.container-image",
        "nvcr.io/x:1",
    )
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert "#SBATCH --nodes=4" in script
    assert "--nnodes 2 --nproc-per-node 8 --node-rank $SLURM_PROCID --rdzv-backend c10d" in script
    assert "--rdzv-endpoint $MASTER_ADDR:$MASTER_PORT" in script
    assert 'run_on "$MASTER_ADDR"' in script and "--client.base-urls $BASE_URLS" in script
    assert "--container-image=nvcr.io/x:1" in script
    # The watchdog runs beside the steps and ends the job when one is stuck; a fresh run rewinds nothing.
    assert "prime-launch watch --output-dir" in script and "--trainer-ranks 16" in script
    assert "--liveness.slack-s 30.0" in script and "prime-launch rewind" not in script
    # Every step's output reaches its log through the bounded pump (an env printing without end filled the disk).
    assert 'prime-launch log-to "$1" --max-mb 1024; }' in script
    assert script.count('> >(log_to "$LOG_DIR/') == 4 and '> "$LOG_DIR/' not in script
    configs = tmp_path / "run" / "configs"
    assert "data_parallel_size = 8" in (configs / "inference.toml").read_text()
    assert "num_trainer_ranks = 16" in (configs / "orchestrator.toml").read_text()
    assert subprocess.run(["bash", "-n", str(tmp_path / "run" / "slurm" / "rl.sbatch")]).returncode == 0


@pytest.mark.parametrize("trainer_nodes", [1, 2])
def test_multi_node_rl_script_with_zmq_transport(tmp_path, trainer_nodes):
    """zmq rollouts: a fresh secret per launch; trainer ranks bind every interface only when the orchestrator (beside
    trainer rank 0) must reach another trainer node, and then it is given those nodes' hosts."""
    result = render(
        tmp_path,
        "rl",
        "@",
        str(HERE / "rl_example.toml"),
        "--transport.type",
        "zmq",
        "--slurm.num-inference-nodes",
        "1",
        "--slurm.num-trainer-nodes",
        str(trainer_nodes),
        "--slurm.gpus-per-node",
        "2",
    )
    assert result.returncode == 0, result.stderr
    script = result.stdout
    secret = tmp_path / "run" / "transport.secret"
    assert "umask 077" in script and f"mv -f {secret}.tmp {secret}" in script
    assert script.index(str(secret)) < script.index("torchrun")  # before any process reads it
    trainer = (tmp_path / "run" / "configs" / "trainer.toml").read_text()
    if trainer_nodes == 1:
        assert 'bind_host = "127.0.0.1"' in trainer and "--transport.host" not in script
    else:
        assert 'bind_host = "0.0.0.0"' in trainer and "--transport.host $TRAINER_HOSTS_CSV" in script
    assert subprocess.run(["bash", "-n", str(tmp_path / "run" / "slurm" / "rl.sbatch")]).returncode == 0


def test_multi_node_sft_script(tmp_path):
    result = render(
        tmp_path, "sft", "--data.fake.batch-size", "4", "--slurm.num-nodes", "3", "--slurm.gpus-per-node", "8"
    )
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --nodes=3" in result.stdout
    assert "torchrun --nnodes 3 --nproc-per-node 8" in result.stdout and "--no-python sft @" in result.stdout
    # Its output goes into logs/sft.log through `prime-launch log-to`, bounded (before: `| tee`, without a bound, into
    # the log and the job log both).
    assert 'prime-launch log-to "$LOG_DIR/sft.log" --max-mb 1024) 2>&1 || rc=$?' in result.stdout, result.stdout
    assert "| tee" not in result.stdout
    result = render(tmp_path, "sft", "--data.fake.batch-size", "4", "--max-log-mb", "7", "--overwrite", "true")
    assert result.returncode == 0, result.stderr
    assert 'prime-launch log-to "$LOG_DIR/sft.log" --max-mb 7)' in result.stdout
    assert subprocess.run(["bash", "-n", str(tmp_path / "run" / "slurm" / "sft.sbatch")]).returncode == 0


def test_slurm_refuses_other_run(tmp_path):
    (tmp_path / "run" / "weights" / "step_1").mkdir(parents=True)
    result = render(tmp_path, "rl", "@", str(HERE / "rl_example.toml"))
    assert result.returncode == 2 and "holds another run" in result.stderr


# ---------------------------------------------------------------- a real single-node cluster

SLURM_CONF = """\
ClusterName=primetest
SlurmctldHost={host}(127.0.0.1)
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/d
SlurmctldPidFile={state}/slurmctld.pid
SlurmdPidFile={state}/slurmd.pid
SlurmctldLogFile={state}/slurmctld.log
SlurmdLogFile={state}/slurmd.log
SlurmctldPort=16817
SlurmdPort=16818
MpiDefault=none
NodeName={host} NodeAddr=127.0.0.1 {resources} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


CLUSTER_LOCK = Path("/tmp/prime-test-slurm-cluster.lock")
"""Held (flock) by the one local cluster of this host: its daemons listen on the fixed ports of ``SLURM_CONF``. Two at
once (two xdist workers, or two checkouts' suites) shared one controller, and the first to end shut it down under the
other's job: ``squeue`` then answered nothing and an unfinished job passed for ended (a flake under ``-n 2``)."""
CLUSTER_LOCK_WAIT_S = 600.0
"""Longest a fixture waits for another cluster of this host to stop (one test module's jobs)."""


@contextlib.contextmanager
def _cluster_lock():
    """Hold ``CLUSTER_LOCK`` for the life of one cluster; wait for another holder at most ``CLUSTER_LOCK_WAIT_S``."""
    with CLUSTER_LOCK.open("a+") as f:
        deadline = time.monotonic() + CLUSTER_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    f.seek(0)
                    holder = f.read().strip() or "unknown"
                    pytest.fail(
                        f"another local SLURM cluster (pid {holder}) held {CLUSTER_LOCK} for {CLUSTER_LOCK_WAIT_S:.0f} s"
                    )
                time.sleep(0.5)
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _install_slurm() -> None:
    if os.geteuid() != 0:
        pytest.skip("a local SLURM cluster needs root")
    if shutil.which("apt-get") is None:
        pytest.skip("apt-get not available")
    if shutil.which("slurmctld") is None:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        _run(["apt-get", "update"], env=env, timeout=300)
        install = _run(
            ["apt-get", "install", "-y", "slurmctld", "slurmd", "slurm-client", "munge"], env=env, timeout=600
        )
        if install.returncode != 0:
            pytest.skip(f"cannot install SLURM: {install.stderr[-500:]}")


def _configure(state: Path) -> dict[str, str]:
    """Write ``state``/slurm.conf for this host and the munge key if there is none; the environment naming the conf."""
    host = _run(["hostname", "-s"]).stdout.strip()
    node_line = _run(["slurmd", "-C"]).stdout.splitlines()[0]
    resources = " ".join(
        part
        for part in node_line.split()
        if part.split("=")[0] in ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
    )
    for sub in ("ctld", "d"):
        (state / sub).mkdir()
    conf = state / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, state=state, resources=resources))
    Path("/run/munge").mkdir(exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    if not Path("/etc/munge/munge.key").exists():
        _run(["mungekey", "--create"])
        shutil.chown("/etc/munge/munge.key", "munge", "munge")
    return {**os.environ, "SLURM_CONF": str(conf)}


def _daemons(state: Path) -> list[int]:
    """The pids slurmctld and slurmd of ``state`` wrote (each once it runs)."""
    return [int(p.read_text()) for p in (state / "slurmctld.pid", state / "slurmd.pid") if p.is_file()]


def _munged() -> list[int]:
    """Running munged pids. Not a zombie: this host's init reaps late, and a cluster's munged stopped a moment ago,
    still listed by ``pgrep``, once passed for a running one (the next cluster then had no munge socket)."""
    return [pid for p in _run(["pgrep", "-x", "munged"]).stdout.split() if _alive(pid := int(p))]


def _wait_up(state: Path, env: dict[str, str]) -> None:
    """Until the node is idle, 60 s at most; this cluster's own daemons must be the ones answering."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = _run(["sinfo", "-h", "-o", "%T"], env=env)
        if info.returncode == 0 and info.stdout.strip() in ("idle", "mixed"):
            break
        time.sleep(1)
    else:
        pytest.fail(
            f"SLURM did not come up: {_run(['sinfo'], env=env)} {(state / 'slurmctld.log').read_text()[-2000:]}"
        )
    if len(daemons := _daemons(state)) != 2 or not all(map(_alive, daemons)):
        pytest.fail(f"slurmctld/slurmd of {state} not running: {(state / 'slurmctld.log').read_text()[-2000:]}")


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """Install Debian's SLURM and start munged, slurmctld and slurmd for one node (PLATFORM.md recipe), the only
    cluster of this host while it runs (``CLUSTER_LOCK``)."""
    _install_slurm()
    state = tmp_path_factory.mktemp("slurm")
    with _cluster_lock():
        env = _configure(state)
        started: list[int] = []  # daemons this fixture started: stopped at the end, whatever happens
        if not _munged():
            _run(["su", "-s", "/bin/sh", "munge", "-c", "/usr/sbin/munged"])
            started += _munged()
        try:
            _run(["slurmctld"], env=env)
            _run(["slurmd"], env=env)
            _wait_up(state, env)
            yield env
        finally:
            started += _daemons(state)
            _run(["scontrol", "shutdown"], env=env)
            _stop(started)
            assert not [p for p in started if _alive(p)], "SLURM/munge daemons left running"


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"


def _stop(pids: list[int], grace_s: float = 10.0) -> None:
    """SIGTERM each pid, SIGKILL what is still alive after ``grace_s``."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in filter(_alive, pids):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


_ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING"}


def _wait_job(job_id: str, env, timeout: float) -> str:
    """``scontrol show job`` of ``job_id`` once its JobState is final. A controller that does not answer is asked
    again until ``timeout``: no answer is not a job that ended."""
    deadline = time.monotonic() + timeout
    shown = _run(["scontrol", "show", "job", job_id], env=env)
    while time.monotonic() < deadline:
        shown = _run(["scontrol", "show", "job", job_id], env=env)
        state = re.search(r"JobState=(\S+)", shown.stdout)
        if state is not None and state.group(1) not in _ACTIVE:
            return shown.stdout
        time.sleep(1)
    _run(["scancel", job_id], env=env)
    raise AssertionError(
        f"job {job_id} had not ended after {timeout} s: {shown.stdout.strip() or shown.stderr.strip()}"
    )


@pytest.mark.slow
@pytest.mark.xdist_group("slurm")  # one cluster at a time: tests/faults/test_slurm_faults.py's group
def test_single_node_rl_job_on_local_slurm(tmp_path, slurm_cluster, fake_bin, fake_hf_cache):
    """Submit a CPU-only single-node RL job (fake process commands) and wait for the launcher's normal finish."""
    from tests.launch.launch_fakes import free_port

    env = {**slurm_cluster, "PRIME_LAUNCH_BIN_DIR": str(fake_bin)}
    out = tmp_path / "run"
    result = subprocess.run(
        [
            *CLI,
            "rl",
            "@",
            str(HERE / "rl_example.toml"),
            "--output-dir",
            str(out),
            "--inference.server.port",
            str(free_port()),
            "--slurm.gpus-per-node",
            "0",
            "--slurm.exclusive",
            "false",
            "--slurm.time",
            "5:00",
            "--slurm.launcher",
            "none",
            "--slurm.job-name",
            "prime-test",
            "--slurm.setup",
            f"export PATH={Path(sys.executable).parent}:$PATH",
            f"export PRIME_LAUNCH_BIN_DIR={fake_bin}",
            f"export HF_HUB_CACHE={fake_hf_cache}",
            "export CUDA_VISIBLE_DEVICES=",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.split()[2]
    assert "job log:" in result.stdout
    state = _wait_job(job_id, env, 180)
    job_log = (out / "slurm" / f"job_{job_id}.log").read_text()
    assert "JobState=COMPLETED" in state, state + job_log
    assert "rl: trainer finished" in job_log and "reward, last 3 steps   0.3000" in job_log, job_log
    assert "trainer step 4" in (out / "logs" / "trainer.log").read_text()


@pytest.mark.slow
@pytest.mark.xdist_group("slurm")  # one cluster at a time: tests/faults/test_slurm_faults.py's group
def test_sft_job_under_srun_and_torchrun_on_local_slurm(tmp_path, slurm_cluster):
    """multi-node-sft on one node, 2 CPU ranks: srun -> torchrun (c10d rendezvous) -> a fake `sft` per rank."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_sft = bin_dir / "sft"
    # Each rank prints 640 KiB after its line: past --max-log-mb 1, sft.log moves to sft.log.1 and starts again.
    fake_sft.write_text('#!/bin/bash\necho "fake sft rank $RANK of $WORLD_SIZE master $MASTER_ADDR args $*"\n'
                        'head -c 655360 /dev/zero | tr "\\0" x; echo\necho "fake sft rank $RANK done"\n')  # fmt: skip
    fake_sft.chmod(0o755)
    out = tmp_path / "run"
    result = subprocess.run(
        [
            *CLI,
            "sft",
            "--data.fake.batch-size",
            "4",
            "--output-dir",
            str(out),
            "--slurm.gpus-per-node",
            "0",
            "--slurm.cpu-procs-per-node",
            "2",
            "--slurm.exclusive",
            "false",
            "--slurm.time",
            "5:00",
            "--slurm.launcher",
            "none",
            "--slurm.master-port",
            "29517",
            "--slurm.setup",
            f"export PATH={bin_dir}:{Path(sys.executable).parent}:$PATH",
            "--max-log-mb",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=slurm_cluster,
    )
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.split()[2]
    state = _wait_job(job_id, slurm_cluster, 180)
    log, moved = (out / "logs" / "sft.log").read_text(), (out / "logs" / "sft.log.1").read_text()
    assert "JobState=COMPLETED" in state, state + log
    both = moved + log
    assert "fake sft rank 0 of 2" in both and "fake sft rank 1 of 2" in both
    assert "fake sft rank 0 done" in log or "fake sft rank 1 done" in log  # the newest output is kept
    assert f"args @ {out / 'configs' / 'sft.toml'} --log.file false" in both
    sizes = [len(t.encode()) for t in (moved, log)]
    print(f"sft.log.1 {sizes[0]} bytes, sft.log {sizes[1]} bytes (1.25 MiB printed, --max-log-mb 1)")
    assert max(sizes) <= (1 << 20) + (1 << 16), sizes  # the bound, plus at most one read's chunk
    job_log = (out / "slurm" / f"job_{job_id}.log").read_text()
    assert "x" * 1000 not in job_log and "job: sft finished" in job_log, job_log[-2000:]
