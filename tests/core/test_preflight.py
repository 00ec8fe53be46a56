"""A new user's config mistakes end in one line on stderr and exit 2 before anything loads: a missing local model
path, a directory that is not a model, a hub id that cannot be downloaded (offline or no network), an unknown
environment id, a bad shared value (named where the user set it), and a dry run's resolved configs reused in another
output directory."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prime_core.config import parse_cli
from prime_core.config.rl import RLConfig
from prime_core.preflight import check_env_id, check_model_name, env_module, looks_like_path, port_in_use

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "reverse_text" / "rl.toml"
MODEL = REPO / "examples" / "reverse_text" / "model"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rl_error(capsys, *argv: str) -> str:
    """Parse an rl command line in-process; return its one error line (exit 2 asserted)."""
    with pytest.raises(SystemExit) as exc:
        parse_cli(RLConfig, ["@", str(EXAMPLE), *argv], prog="rl")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: ")
    return err.strip()


@pytest.fixture
def in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    ("name", "local"),
    [
        ("examples/reverse_text/modle", True),  # more than one slash
        ("examples/modle", True),  # the first part is a directory here
        ("./modle", True),
        ("/nowhere/model", True),
        ("~/model", True),
        ("bad name", True),  # not a valid hub id
        ("Qwen/Qwen3-0.6B", False),
        ("gpt2", False),
    ],
)
def test_which_names_are_paths(in_repo, name, local):
    assert looks_like_path(name) is local


def test_missing_local_model_is_one_line(in_repo, tmp_path, capsys):
    for name in ("examples/reverse_text/modle", "examples/modle"):
        err = rl_error(capsys, "--model.name", name)
        assert err == f"error: CLI --model.name: model.name: no such directory {name!r} (hub ids look like org/name)"
    # Also in a dry run, and set in a TOML file: the file is named.
    override = tmp_path / "model.toml"
    override.write_text('[model]\nname = "nowhere/x/y"\n')
    err = rl_error(capsys, "@", str(override), "--dry-run")
    assert err == f"error: file {override}: model.name: no such directory 'nowhere/x/y' (hub ids look like org/name)"


def test_directory_that_is_not_a_model_is_one_line(in_repo, tmp_path, capsys):
    """The task's folder instead of its model: one line pointing at the model inside, not a tokenizer traceback."""
    err = rl_error(capsys, "--model.name", "examples/reverse_text")
    assert err == (
        "error: CLI --model.name: model.name: 'examples/reverse_text' holds no config.json: not a model directory "
        "(did you mean 'examples/reverse_text/model'?)"
    )
    assert check_model_name(str(tmp_path)) == f"{str(tmp_path)!r} holds no config.json: not a model directory"
    (tmp_path / "config.json").write_text('{"model_type": "qwen3"}')
    assert check_model_name(str(tmp_path)) is None


def test_hub_id_offline_fails_at_once(in_repo, empty_cache, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = rl_error(capsys, "--model.name", "Qwen/Qwen3-0.6B")
    assert "'Qwen/Qwen3-0.6B' is not a local directory and not in the HF cache" in err
    assert "HF_HUB_OFFLINE=1" in err


def test_hub_id_without_network_fails_at_once(in_repo, empty_cache, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    start = time.monotonic()
    err = rl_error(capsys, "--model.name", "Qwen/Qwen3-0.6B")
    # Hub retries take 53 s; a bound well under that, not a timing, so a loaded CI machine does not fail it.
    assert time.monotonic() - start < 20
    assert "is unreachable" in err


def test_cached_hub_id_and_dry_run_need_no_network(empty_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert check_model_name("Qwen/Qwen3-0.6B", network=False) is None  # a dry run resolves configs only
    (Path(os.environ["HF_HUB_CACHE"]) / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc").mkdir(parents=True)
    assert check_model_name("Qwen/Qwen3-0.6B") is None


def test_unknown_environment_is_one_line_with_suggestion(in_repo, capsys):
    err = rl_error(capsys, "--orchestrator.env", '[{id = "reverse-txt"}]')
    assert err == (
        "error: CLI --orchestrator.env: orchestrator.env.0.id: environment 'reverse-txt': no installed package "
        "provides module 'reverse_txt' (did you mean 'reverse-text'?)"
    )
    assert check_env_id("reverse-text") is None
    assert check_env_id("owner/reverse-text@0.1") is None and env_module("owner/Reverse-Text@0.1") == "reverse_text"


def test_shared_value_error_names_where_it_was_set(in_repo, capsys):
    err = rl_error(capsys, "--max-steps", "ten")
    assert err.startswith("error: CLI --max-steps: max-steps: Input should be a valid integer")


def test_resolved_config_runs_in_another_output_dir(in_repo, tmp_path, capsys):
    """A resolved config carries its output_dir; a new --output-dir replaces it instead of conflicting."""
    first = tmp_path / "first"
    with pytest.raises(SystemExit) as exc:
        parse_cli(RLConfig, ["@", str(EXAMPLE), "--output-dir", str(first), "--dry-run"], prog="rl")
    assert exc.value.code == 0
    resolved = first / "configs" / "rl.toml"
    assert f'output_dir = "{first}"' in resolved.read_text()
    config = parse_cli(RLConfig, ["@", str(resolved), "--output-dir", str(tmp_path / "second")], prog="rl")
    dirs = {config.trainer.output_dir, config.orchestrator.output_dir, config.inference.output_dir}
    assert dirs == {tmp_path / "second"}


def test_port_in_use_is_named():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert (
            port_in_use("127.0.0.1", port)
            == f"port {port} on 127.0.0.1 is already in use (another server is listening there)"
        )
    assert port_in_use("127.0.0.1", port) is None


RL = ("prime_launch.entrypoints.rl", "@", str(EXAMPLE))
MISTAKES = {
    "rl-missing-path": ((*RL, "--model.name", "examples/reverse_text/modle"), "no such directory"),
    "rl-missing-path-one-slash": ((*RL, "--model.name", "examples/modle"), "no such directory 'examples/modle'"),
    "rl-hub-id-offline": ((*RL, "--model.name", "org/missing"), "'org/missing' is not a local directory"),
    "rl-unknown-env": ((*RL, "--orchestrator.env", '[{id = "reverse-txt"}]'), "environment 'reverse-txt'"),
    "rl-bad-shared-value": ((*RL, "--max-steps", "ten"), "CLI --max-steps: max-steps: "),
    "rl-not-a-model-dir": ((*RL, "--model.name", "examples/reverse_text"), "holds no config.json"),
    "inference-missing-path": (
        ("prime_inference.entrypoints.inference", "--model.name", "examples/modle"),
        "no such directory",
    ),
    "trainer-missing-path": (
        ("prime_trainer.entrypoints.trainer", "--model.name", "examples/reverse_text/modle"),
        "no such directory",
    ),
    "eval-unknown-env": (
        ("prime_orchestrator.entrypoints.eval", "--environment-ids", "reverse-txt", "--model.name", str(MODEL)),
        "environment 'reverse-txt'",
    ),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_mistake_fails_in_seconds(tmp_path, mistake):
    """Each mistake as a user makes it, through the entry point: one line on stderr naming the cause, exit 2,
    nothing loaded, written or started (well under the 53 s of hub retries or the 12-20 s of a model load or an
    environment worker start this used to cost)."""
    argv, cause = MISTAKES[mistake]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", *argv, "--output-dir", str(tmp_path / "run")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    took = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ") and cause in proc.stderr, proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "run").exists(), "nothing was written or started"
    assert took < 30, took  # well under the 53 s of hub retries; not a timing (CI machines are loaded)


def test_unknown_eval_environment_id_is_one_line(capsys):
    from prime_core.config.orchestrator import EvalConfig

    with pytest.raises(SystemExit) as exc:
        parse_cli(EvalConfig, ["--environment-ids", "reverse-text,reverse-txt", "--dry-run"], prog="eval")
    assert exc.value.code == 2
    assert capsys.readouterr().err == (
        "error: CLI --environment-ids: environment-ids.1: environment 'reverse-txt': no installed package provides "
        "module 'reverse_txt' (did you mean 'reverse-text'?)\n"
    )


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory that takes no files: a read-only bind mount as root (root ignores modes), else mode 0o500."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o500)
        yield ro, "Permission denied (errno 13 EACCES)"
        ro.chmod(0o700)
        return
    subprocess.run(["mount", "--bind", str(ro), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        yield ro, "Read-only file system (errno 30 EROFS)"
    finally:
        subprocess.run(["umount", str(ro)], check=False)


WRITERS = {
    "rl": RL,
    "trainer": ("prime_trainer.entrypoints.trainer", "--model.name", str(MODEL)),
    "sft": ("prime_trainer.entrypoints.sft", "@", str(REPO / "examples" / "reverse_text" / "sft.toml")),
    "orchestrator": ("prime_orchestrator.entrypoints.orchestrator", "--model.name", str(MODEL)),
    "eval": ("prime_orchestrator.entrypoints.eval", "--model.name", str(MODEL)),
}


@pytest.mark.parametrize("entry", list(WRITERS))
def test_an_output_dir_that_takes_no_files_fails_at_start(read_only_dir, entry):
    """A read-only (or not permitted) output directory: one line naming it and the errno, exit 2, before any model
    or environment loads (it used to be a traceback from rl and the orchestrator, and a line after torch loaded from
    the trainer, after a warning about its progress file)."""
    ro, why = read_only_dir
    out = ro / "run"
    proc = subprocess.run(
        [sys.executable, "-m", *WRITERS[entry], "--output-dir", str(out)],
        cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr == f"error: CLI --output-dir: output-dir: cannot write under {out}: {why}\n", proc.stderr
    assert "torch" not in proc.stdout


def test_a_full_output_dir_fails_at_start(tmp_path, monkeypatch, capsys):
    from prime_core.config.trainer import TrainerConfig

    real_write = os.write

    def full(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
            raise OSError(28, os.strerror(28))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(SystemExit) as exc:
        argv = ["--model.name", str(MODEL), "--output-dir", str(tmp_path / "run")]
        parse_cli(TrainerConfig, argv, prog="trainer", writes_output_dir=True)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert (
        err == f"error: CLI --output-dir: output-dir: cannot write under {tmp_path / 'run'}: No space left on device "
        "(errno 28 ENOSPC)\n"
    ), err
    assert [p.name for p in (tmp_path / "run").iterdir()] == []  # the probe is gone
