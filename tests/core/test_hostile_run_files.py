"""Small files of a run that another process, an earlier run or a user can replace with something that is not a
file: a FIFO (``open`` for reading waits for a writer that never comes), a link to a device (read without end). The
reader must answer at once, one line naming the path, never wait. Each reader runs in a subprocess: the bound is the
test's, so a hang shows as a failure instead of stopping the suite."""

import os
import subprocess
import sys
import textwrap

import pytest
from prime_core import io
from prime_core.io import UnreadableFile


def run_bounded(code: str) -> str:
    """stdout of ``code`` run by a fresh interpreter, which must end by itself."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the reader was still waiting after 120 s (killed)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def _socket(path) -> None:
    import socket

    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    sock.close()


PLANTED = {
    "fifo": os.mkfifo,
    "device": lambda p: p.symlink_to("/dev/zero"),
    "directory": os.mkdir,
    # Before: OSError 'No such device or address' / 'Too many levels of symbolic links', which the entry points
    # name as a failing disk (a socket at transport.secret), or the callers that read a missing file as none miss.
    "socket": _socket,
    "link_loop": lambda p: p.symlink_to(p.name),
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_read_regular_names_what_is_there_instead(tmp_path, kind):
    path = tmp_path / "progress.json"
    PLANTED[kind](path)
    with pytest.raises(UnreadableFile, match=rf"^{path}: not a regular file \(a progress record is one\)$"):
        io.read_regular(path, "a progress record", limit=1 << 20)


def test_read_regular_refuses_a_file_over_its_bound_without_reading_it_whole(tmp_path):
    path = tmp_path / "progress.json"
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: a 1 GiB record costs nothing to make
    with pytest.raises(UnreadableFile, match=rf"^{path}: over 1048576 bytes, too large for a progress record$"):
        io.read_regular(path, "a progress record", limit=1 << 20)


def test_a_fifo_at_metrics_jsonl_is_refused_in_one_line(tmp_path):
    """Before, ``read_metrics`` (the launcher's summary and report) waited in ``open`` for good; then it read as no
    records, silently (``prime-launch report``: "no metrics in ..."); now one line names what is there."""
    os.mkfifo(tmp_path / "metrics.jsonl")
    out = run_bounded(f"""
        from prime_core.io import UnreadableFile
        from prime_core.monitor import read_metrics
        try:
            print(read_metrics({str(tmp_path / "metrics.jsonl")!r}))
        except UnreadableFile as e:
            print(e)
    """)
    assert out == f"{tmp_path / 'metrics.jsonl'}: not a regular file (a metrics file is one)"


def test_a_fifo_at_metrics_jsonl_stops_the_monitor_with_one_line(tmp_path):
    """Before, the trainer and the orchestrator hung creating their metrics sink (``open`` of the FIFO, to see whether
    its last line was torn); the error is a `MonitorUnavailable`, which both print as one line, exit 1."""
    path = tmp_path / "metrics.jsonl"
    os.mkfifo(path)
    out = run_bounded(f"""
        from prime_core.monitor import JsonlMonitor, MonitorUnavailable
        try:
            JsonlMonitor({str(path)!r}, "trainer")
        except MonitorUnavailable as e:
            print(e)
    """)
    assert out == f"{path}: not a regular file (metrics are appended to one): remove it"


@pytest.mark.parametrize("kind", ["fifo", "socket"])
def test_a_fifo_at_the_transport_secret_is_one_line(tmp_path, kind):
    """Before, a FIFO (its mode 0600 passes the permission check) blocked each process of the run in ``open``, and a
    socket raised a bare OSError 'No such device or address' (ENXIO). (A link to /dev/zero was already refused: its
    mode 0666 fails that check.)"""
    from prime_core.run_dir import RunDir
    from prime_core.transport import secret_path

    path = secret_path(RunDir(tmp_path))
    path.parent.mkdir(parents=True, exist_ok=True)
    PLANTED[kind](path)
    path.chmod(0o600)
    out = run_bounded(f"""
        import os
        os.environ.pop("PRIME_TRANSPORT_SECRET", None)
        from prime_core.config import ConfigError
        from prime_core.run_dir import RunDir
        from prime_core.transport import transport_secret
        try:
            transport_secret(RunDir({str(tmp_path)!r}))
        except ConfigError as e:
            print(e)
    """)
    assert out == f"{path}: not a regular file (a transport secret is one) (delete it)"


def test_the_model_preflight_names_a_fifo_at_config_json(tmp_path):
    """Before, the check said the directory "holds no config.json", with one there (a FIFO, on which the launcher's
    sizing, the orchestrator and the servers each blocked in ``open``)."""
    from prime_core.preflight import check_model_name

    os.mkfifo(tmp_path / "config.json")
    why = check_model_name(str(tmp_path), network=False)
    assert why == f"{str(tmp_path / 'config.json')!r} is not a regular file: not a Hugging Face model config"


def test_a_link_to_a_terminal_never_becomes_the_readers_controlling_terminal(tmp_path):
    """Every process rl starts leads a session of its own, without a terminal. Before, reading a link to a terminal
    (a model's config.json, a checkpoint's progress.json) made that terminal the reader's controlling one, and its
    hang-up then killed the reader with SIGHUP (exit 129)."""
    link = tmp_path / "progress.json"
    out = run_bounded(f"""
        import os, time
        from prime_core import io
        from prime_core.io import UnreadableFile
        master, slave = os.openpty()
        name = os.ttyname(slave)
        os.close(slave)
        os.setsid()  # as rl's processes: a session leader without a controlling terminal
        os.symlink(name, {str(link)!r})
        try:
            io.read_regular({str(link)!r}, "a progress record")
        except UnreadableFile as e:
            print(e)
        try:
            os.close(os.open("/dev/tty", os.O_RDONLY))
            print("a controlling terminal")
        except OSError:
            print("no controlling terminal")
        os.close(master)  # the terminal hangs up
        time.sleep(0.2)
        print("alive")
    """)
    assert out.splitlines() == [
        f"{link}: not a regular file (a progress record is one)",
        "no controlling terminal",
        "alive",
    ]


@pytest.mark.parametrize("swap", ["link", "readable"])
def test_a_transport_secret_swapped_after_its_check_is_refused(tmp_path, monkeypatch, swap):
    """Another user who can write to a shared run directory replaces ``transport.secret`` between the check and the
    read: with a link to a file of theirs, or with a file others can read. Before, the mode was checked by path, then
    the path read again: the swapped-in secret (known to them, so their zmq batches train) was returned. The open
    descriptor is what is checked now. The swap is made inside ``os.open`` of the secret: after any check by path."""
    from prime_core.config import ConfigError
    from prime_core.run_dir import RunDir
    from prime_core.transport import SECRET_ENV, secret_path, transport_secret

    monkeypatch.delenv(SECRET_ENV, raising=False)
    path = secret_path(RunDir(tmp_path))
    path.write_bytes(b"a" * 64)
    path.chmod(0o600)
    theirs = tmp_path / "theirs"
    theirs.write_bytes(b"b" * 64)
    theirs.chmod(0o644)
    real_open, swapped = os.open, []

    def open_after_swap(file, flags, *args, **kwargs):
        if os.fspath(file) == str(path) and not swapped:
            swapped.append(file)
            planted = tmp_path / "planted"
            if swap == "link":
                planted.symlink_to(theirs)
            else:
                planted.write_bytes(b"b" * 64)
                planted.chmod(0o644)
            os.replace(planted, path)
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_after_swap)
    message = (
        f"{path}: not a regular file (a transport secret is one) (delete it)"
        if swap == "link"
        else f"{path} is readable by other users: chmod 600 it (or set ${SECRET_ENV})"
    )
    with pytest.raises(ConfigError) as e:
        transport_secret(RunDir(tmp_path))
    assert str(e.value) == message
    assert swapped


def test_a_fifo_swapped_in_at_a_weight_manifest_is_one_line(tmp_path):
    """``read_manifest`` finds the manifest with a check by path; a FIFO renamed over it after that passed the size
    check (0 bytes), and the inference server's read of it blocked in ``open`` for good, on its weight update."""
    path = tmp_path / "broadcast.json"
    os.mkfifo(path)
    out = run_bounded(f"""
        from prime_core.schemas.weights import BroadcastManifest, _read
        try:
            _read(__import__("pathlib").Path({str(path)!r}), BroadcastManifest)
        except ValueError as e:
            print(e)
    """)
    assert out == f"{path} is not a valid broadcast manifest: not a regular file (a weight manifest is one)"
