"""``rl --dry-run`` checks the orchestrators' environment settings (a misspelt ``args`` key) through the orchestrator's
own ``--dry-run``: one line naming the key, exit 2, where it used to pass and the run failed only once started."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prime_launch.dry_check import check_orchestrators
from prime_launch.process import ProcessSpec

ROOT = Path(__file__).resolve().parents[2]


def rl_dry_run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PRIME_")}
    cmd = [sys.executable, "-m", "prime_launch.entrypoints.rl", "@", "examples/reverse_text/rl.toml",
           "--output-dir", str(out), "--dry-run", *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_misspelt_env_arg_fails_rl_dry_run_in_one_line_naming_the_key(tmp_path):
    typo = rl_dry_run(tmp_path / "run", "--orchestrator.env", '[{"id": "reverse-text", "args": {"num_exampels": 5}}]')
    assert typo.returncode == 2, typo.stdout + typo.stderr
    assert typo.stderr == (
        "error: orchestrator: env.0 (reverse-text): args.num_exampels: Extra inputs are not permitted "
        "(did you mean 'num_examples'?)\n"
    )
    evals = rl_dry_run(tmp_path / "run", "--orchestrator.eval.envs", '[{"id": "reverse-text", "args": {"sed": 1}}]')
    assert evals.returncode == 2 and evals.stderr.startswith(
        "error: orchestrator: eval.envs.0 (reverse-text): args.sed:"
    )


def test_a_correct_config_passes_rl_dry_run_and_its_configs_stay_as_rl_wrote_them(tmp_path):
    out = tmp_path / "run"
    ok = rl_dry_run(out)
    assert ok.returncode == 0, ok.stderr
    assert "orchestrator @ " in ok.stdout and "Traceback" not in ok.stderr
    configs = out / "configs"
    assert sorted(p.name for p in configs.iterdir()) == [".dry-run", "inference.toml", "orchestrator.toml",
                                                           "trainer.toml"]  # fmt: skip
    assert "file = true" in (configs / "orchestrator.toml").read_text()  # not the check's --log.file false
    assert not (out / "logs").exists()


def test_an_orchestrator_check_that_hangs_is_stopped_and_named(tmp_path):
    pid_file = tmp_path / "pid"
    script = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    spec = ProcessSpec(name="orchestrator-a", cmd=[sys.executable, "-c", script], log_file=tmp_path / "log")
    with pytest.raises(ValueError) as e:
        check_orchestrators([spec], timeout_s=3)
    exe = Path(sys.executable).name
    assert str(e.value) == f"orchestrator-a: its config check ({exe} --dry-run) did not finish within 3 s"
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists(), "the hanging check was left running"


def test_an_orchestrator_check_that_dies_silently_is_named(tmp_path):
    spec = ProcessSpec(name="orchestrator", cmd=[sys.executable, "-c", "raise SystemExit(3)"], log_file=tmp_path / "l")
    with pytest.raises(ValueError, match=r"^orchestrator: its config check \(--dry-run\) exited with code 3 and wrote"):
        check_orchestrators([spec])


def test_ctrl_c_during_the_checks_ends_the_dry_run_in_one_line(tmp_path, monkeypatch, capsys):
    """Before: a traceback from the wait on the orchestrators' checks."""
    import prime_launch.launcher as launcher
    from prime_launch.entrypoints.rl import main

    def interrupted(specs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "check_orchestrators", interrupted)
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exited:
        main(["@", "examples/reverse_text/rl.toml", "--output-dir", str(tmp_path / "run"), "--dry-run"])
    assert exited.value.code == 130
    assert capsys.readouterr().err == "rl: dry run interrupted; nothing was started\n"
