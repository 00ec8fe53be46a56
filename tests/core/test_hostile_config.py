"""A careless or hostile user's way of starting runs: control characters in paths and sbatch fields, settings the
trainer only finds wrong once it loads, seeds no generator takes, config files that are not files. Each ends in one
line naming the field and exit 2, never a traceback or a script that runs what a value smuggled in."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prime_core.config import parse_cli
from prime_core.config.rl import RLConfig
from prime_core.config.shared import default_run_dir
from prime_core.config.trainer import SFTConfig, TrainerConfig
from prime_core.io import mark_stable

from tests.core.test_bad_input import EXAMPLE, MODEL, REPO, error_line
from tests.tiny import free_port


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=REPO)


# ---------------------------------------------------------------- control characters


@pytest.mark.parametrize("bad", ["run\ntouch /tmp/pwned #", "run\x00", "run\rx"])
def test_a_path_with_a_control_character_is_refused(capsys, tmp_path, bad):
    """A NUL in ``output_dir`` used to end in os.stat's "embedded null byte" traceback; a newline went into the sbatch
    script's ``#SBATCH --output=`` line, and what followed it ran as a command of the job."""
    err = error_line(capsys, TrainerConfig, "--model.name", str(MODEL), "--output-dir", str(tmp_path / bad))
    assert err.startswith("error: CLI --output-dir: output-dir: the path holds the control character ")
    (tmp_path / "t.toml").write_text(f"output_dir = {json.dumps(str(tmp_path / bad))}\n")  # JSON escapes are TOML's
    err = error_line(capsys, TrainerConfig, "--model.name", str(MODEL), "@", str(tmp_path / "t.toml"))
    assert err.startswith(f"error: file {tmp_path}/t.toml: output-dir: the path holds the control character ")


def test_a_name_too_long_for_the_filesystem_is_one_line_naming_the_field(capsys, tmp_path):
    """A path part over NAME_MAX used to end in pathlib's ``OSError: [Errno 36] File name too long`` traceback (output
    dir, model name, SFT dataset: ``Path.exists`` raises ENAMETOOLONG), and a 2 MB value came back whole in the error."""
    long_part = "a" * 300
    err = error_line(capsys, TrainerConfig, "--model.name", str(MODEL), "--output-dir", str(tmp_path / long_part / "b"))
    assert err.startswith("error: CLI --output-dir: output-dir: the path has a part of 300 bytes ("), err
    assert "a file name holds at most 255" in err and len(err) < 400
    err = error_line(capsys, TrainerConfig, "--model.name", f"/tmp/{long_part}", "--output-dir", str(tmp_path))
    assert err.startswith("error: CLI --model.name: model.name: '/tmp/aaa") and "has a part of 300 bytes" in err, err
    err = error_line(
        capsys, SFTConfig, "--model.name", str(MODEL), "--data.path", long_part, "--output-dir", str(tmp_path)
    )
    assert err.startswith("error: CLI --data.path: data.path: ") and "has a part of 300 bytes" in err, err
    (tmp_path / "t.toml").write_text(f'max_steps = "{"9" * 2_000_000}"\n')
    err = error_line(capsys, TrainerConfig, "--model.name", str(MODEL), "@", str(tmp_path / "t.toml"))
    assert err.startswith(f"error: file {tmp_path}/t.toml: max-steps: ") and err.endswith("(2000002 characters)"), err
    assert len(err) < 400


def test_a_newline_in_an_sbatch_field_is_refused_and_no_script_is_written(tmp_path):
    """``--slurm.job-name $'x\\necho hi'`` used to put ``echo hi`` on a line of its own in the rendered script."""
    out = tmp_path / "run"
    for flag, value in (("--slurm.job-name", "x\necho hi"), ("--slurm.extra-sbatch", '["--a=1", "--b\\nrm -rf x"]')):
        proc = _run(
            "-m", "prime_launch.entrypoints.cli", "slurm", "rl", "@", str(EXAMPLE), "--output-dir", str(out), flag,
            value, "--dry-run",
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"error: CLI {flag}: {flag[2:]}: holds the control character '\\n'"), proc.stderr
        assert proc.stderr.count("\n") == 1
    assert not (out / "slurm" / "rl.sbatch").exists()


# ---------------------------------------------------------------- what the trainer finds wrong once it loads


@pytest.mark.integration
def test_settings_the_trainer_refuses_once_it_loads_are_one_line(tmp_path):
    """``--model.dtype float16``, ``--device cuda`` on a host without one, ``--init.config-overrides`` on a model with
    weights: each used to be a ValueError traceback from rank 0 and exit 1."""
    common = ["-m", "prime_trainer.entrypoints.trainer", "--model.name", str(MODEL), "--output-dir", str(tmp_path)]
    cases = [
        (["--model.dtype", "float16"], "model.dtype='float16' is not supported for training"),
        (["--init.config-overrides", '{"hidden_size": 128}'], "init.config_overrides change the architecture"),
    ]
    import torch

    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "device='cuda' but no CUDA device is visible"))
    for argv, message in cases:
        proc = _run(*common, *argv)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"error: {message}") and "Traceback" not in proc.stderr, proc.stderr


# ---------------------------------------------------------------- a run directory that holds another run


def _trained_run(root: Path, *steps: int) -> None:
    for step in steps:
        for part in (root / "checkpoints" / f"step_{step}", root / "weights" / f"step_{step}"):
            (part / "trainer").mkdir(parents=True, exist_ok=True)
            mark_stable(part / "trainer")
            mark_stable(part)


def test_a_trainer_started_afresh_does_not_overwrite_another_runs_checkpoints(capsys, tmp_path):
    """``sft --output-dir <a run that trained>`` (no resume) used to train from step 0 and replace that run's
    checkpoint and weights of every step it reached: two runs mixed in one directory, the first one's lost."""
    run = tmp_path / "run"
    _trained_run(run, 2, 4)
    (tmp_path / "sft.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    sft = ["--model.name", str(MODEL), "--data.path", str(tmp_path / "sft.jsonl"), "--output-dir", str(run)]
    err = error_line(capsys, SFTConfig, *sft)
    assert err == (
        f"error: CLI --output-dir: output-dir: '{run}' holds another run's checkpoints (steps 2, 4) and weights "
        "(steps 2, 4), which this run would overwrite: resume it with --ckpt.resume-step 4, delete them with "
        "--overwrite, or choose another --output-dir"
    )
    err = error_line(capsys, TrainerConfig, "--model.name", str(MODEL), "--output-dir", str(run))
    assert err.endswith("resume it with --ckpt.resume-step 4, delete them, or choose another --output-dir")
    assert error_line(capsys, SFTConfig, *sft, "--overwrite", "--ckpt.resume-step", "4").endswith(
        "overwrite and ckpt.resume_step exclude each other"
    )
    # Resuming, a benchmark, --overwrite and a directory with only the base weights (step 0) are fine.
    assert parse_cli(SFTConfig, [*sft, "--ckpt.resume-step", "4"], prog="sft").ckpt.resume_step == 4
    assert parse_cli(TrainerConfig, ["--model.name", str(MODEL), "--output-dir", str(run), "--bench"], prog="t").bench
    assert parse_cli(SFTConfig, [*sft, "--overwrite"], prog="sft").overwrite
    fresh = tmp_path / "fresh"
    (fresh / "weights" / "step_0").mkdir(parents=True)
    mark_stable(fresh / "weights" / "step_0")
    assert parse_cli(TrainerConfig, ["--model.name", str(MODEL), "--output-dir", str(fresh)], prog="t")
    assert (run / "checkpoints" / "step_4" / "trainer").is_dir()  # nothing above deleted anything


def test_the_refusal_names_the_other_runs_rollouts_too(capsys, tmp_path):
    """The refusal says to delete what it names. Before, it named the checkpoints and weights only: a user who deleted
    those kept the other run's last rollouts (steps 4 and 5 here), and the fresh trainer, which takes the file at its
    step's path without asking who wrote it (no launch id by hand), trained on the other run's batch at step 4.
    Rollouts alone still start a trainer: this run's orchestrator may have started first."""
    run = tmp_path / "run"
    _trained_run(run, 2, 4)
    for step in (4, 5):
        (run / "rollouts" / f"step_{step}").mkdir(parents=True)
        (run / "rollouts" / f"step_{step}" / "rank_0.safetensors").write_bytes(b"")
    err = error_line(capsys, TrainerConfig, "--model.name", str(MODEL), "--output-dir", str(run))
    assert err == (
        f"error: CLI --output-dir: output-dir: '{run}' holds another run's checkpoints (steps 2, 4), weights (steps 2, "
        "4) and rollouts (steps 4, 5), which this run would overwrite: resume it with --ckpt.resume-step 4, delete "
        "them, or choose another --output-dir"
    )
    shutil.rmtree(run / "checkpoints")
    shutil.rmtree(run / "weights")
    assert parse_cli(TrainerConfig, ["--model.name", str(MODEL), "--output-dir", str(run)], prog="t")


def test_a_dry_run_in_a_trained_runs_directory_keeps_that_runs_config(capsys, tmp_path):
    """The config a run trained with is its record: a dry run of its resume writes beside it, not over it."""
    run = tmp_path / "run"
    _trained_run(run, 2)
    (run / "configs").mkdir()
    (run / "configs" / "sft.toml").write_text("# what step 2 was trained with\n")
    sft = ["--model.name", str(MODEL), "--output-dir", str(run), "--data.fake.batch-size", "1", "--max-steps", "4"]
    with pytest.raises(SystemExit) as e:
        parse_cli(SFTConfig, [*sft, "--ckpt.resume-step", "2", "--dry-run"], prog="sft", writes_output_dir=True)
    assert e.value.code == 0
    assert (run / "configs" / "sft.toml").read_text() == "# what step 2 was trained with\n"
    assert "resume_step = 2" in (run / "configs" / "sft.dry-run.toml").read_text()
    assert capsys.readouterr().out.strip().endswith("sft.dry-run.toml")


@pytest.mark.integration
def test_sft_overwrite_deletes_the_previous_run_and_a_dry_run_deletes_nothing(tmp_path):
    run = tmp_path / "run"
    _trained_run(run, 2)
    (run / "notes.txt").write_text("mine")
    sft = ["-m", "prime_trainer.entrypoints.sft", "--model.name", str(MODEL), "--output-dir", str(run), "--overwrite"]
    sft += ["--data.fake.batch-size", "1", "--seq-len", "16", "--max-steps", "1", "--device", "cpu"]
    proc = _run(*sft, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert (run / "checkpoints" / "step_2" / "trainer").is_dir()
    proc = _run(*sft)
    assert proc.returncode == 0, proc.stderr
    assert not (run / "checkpoints" / "step_2").exists() and (run / "notes.txt").read_text() == "mine"
    assert (run / "weights" / "step_1").is_dir()


# ---------------------------------------------------------------- resuming past the end


def test_resuming_at_or_past_max_steps_is_refused(capsys, tmp_path):
    """``sft --ckpt.resume-step 4 --max-steps 2`` used to load the checkpoint, print a validation loss and exit 0
    having trained nothing; ``rl --resume`` of a finished run started every process for nothing."""
    from prime_launch.host import HostFacts
    from prime_launch.resolver import resolve

    run = tmp_path / "run"
    _trained_run(run, 4)
    (tmp_path / "sft.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    sft = ["--model.name", str(MODEL), "--data.path", str(tmp_path / "sft.jsonl"), "--output-dir", str(run)]
    err = error_line(capsys, SFTConfig, *sft, "--ckpt.resume-step", "4", "--max-steps", "2")
    assert err == (
        "error: CLI --max-steps: ckpt.resume_step (4) >= max_steps (2): nothing is left to train (max_steps counts "
        "from the run's start)"
    )
    err = error_line(capsys, RLConfig, "@", str(EXAMPLE), "--ckpt.resume-step", "60")
    assert err.startswith("error: CLI --ckpt.resume-step: trainer: ckpt.resume_step (60) >= max_steps (60)")
    rl = parse_cli(RLConfig, ["@", str(EXAMPLE), "--resume", "--output-dir", str(run)], prog="rl")
    facts = HostFacts(gpus=(), cores=8, executables={}, run_id="r", checkpoint_steps=(30, 60))
    with pytest.raises(ValueError, match=r"^--resume: the newest checkpoint \(step 60\) is at max-steps 60: the run"):
        resolve(rl, facts)


# ---------------------------------------------------------------- config files that are not config files


def test_config_files_that_are_not_files_say_what_they_are(capsys, tmp_path):
    """A directory, a FIFO, a device and a symlink loop were all "not found"; a 100 MB file (a checkpoint given by
    mistake) was read whole before its first byte failed to parse."""
    import os

    (tmp_path / "dir.toml").mkdir()
    os.mkfifo(tmp_path / "fifo.toml")
    os.symlink(tmp_path / "b.toml", tmp_path / "a.toml")
    os.symlink(tmp_path / "a.toml", tmp_path / "b.toml")
    with open(tmp_path / "big.toml", "wb") as f:
        f.truncate(100 * 2**20)
    for name, why in [
        ("dir.toml", "is a directory"),
        ("fifo.toml", "is not a regular file"),
        ("a.toml", "is a symlink that leads nowhere"),
        ("big.toml", "is 100 MiB; a config is at most 16 MiB (is it the right file?)"),
    ]:
        path = tmp_path / name
        assert error_line(capsys, TrainerConfig, "@", str(path)) == f"error: file {path}: config file '{path}' {why}"
    assert error_line(capsys, TrainerConfig, "@", "/dev/zero").endswith("'/dev/zero' is not a regular file")


def test_a_boolean_given_a_word_names_the_flag(capsys):
    """``--bench maybe`` said "unexpected argument 'maybe'", naming no option."""
    err = error_line(capsys, TrainerConfig, "--model.name", str(MODEL), "--bench", "maybe")
    assert err == "error: CLI --bench: expected true or false (or --bench / --no-bench alone), got 'maybe'"


def test_a_seed_no_generator_takes_is_refused(capsys):
    """``--seed 99999999999999999999999`` used to start the trainer and fail in torch's generator ("Overflow when
    unpacking long long", a traceback); ``sft --seed -1`` failed in numpy's."""
    err = error_line(capsys, TrainerConfig, "--model.name", str(MODEL), "--seed", str(10**23))
    assert err == f"error: CLI --seed: seed: Input should be less than or equal to 4294967295, got '{10**23}'"
    err = error_line(capsys, RLConfig, "@", str(EXAMPLE), "--seed", "-1")
    assert err == "error: CLI --seed: seed: Input should be greater than or equal to 0, got '-1'"


def test_a_directory_no_run_wrote_is_never_cleared_as_a_run(capsys, tmp_path):
    """``rl --output-dir <a project>`` whose ``logs/`` and ``configs/`` were the project's used to take them for the
    leftovers of a failed start and delete them, unasked; ``--overwrite`` (and ``sft --overwrite``) deleted its
    ``eval/`` too."""
    from prime_core.config import load_config
    from prime_launch.launcher import _prepare

    project = tmp_path / "project"
    for name, text in (("logs/keep.txt", "precious"), ("configs/mine.yaml", "x: 1"), ("eval/results.csv", "1")):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    for extra in ([], ["--overwrite"]):
        rl = load_config(RLConfig, ["@", str(EXAMPLE), "--output-dir", str(project), *extra])
        with pytest.raises(FileExistsError, match="holds configs, logs, eval that no run wrote"):
            _prepare(rl)
    err = error_line(capsys, SFTConfig, "--model.name", str(MODEL), "--data.fake.batch-size", "1", "--overwrite",
                     "--output-dir", str(project))  # fmt: skip
    assert err.endswith("holds configs, logs, eval that no run wrote (no configs/<process>.toml, no step_N " + (
        "directories, no metrics), which --overwrite would delete; choose another --output-dir"
    ))  # fmt: skip
    assert sorted(p.name for p in project.rglob("*") if p.is_file()) == ["keep.txt", "mine.yaml", "results.csv"]
    # A failed start's leftovers (its configs) are still cleared.
    (tmp_path / "failed" / "configs").mkdir(parents=True)
    (tmp_path / "failed" / "configs" / "trainer.toml").write_text("")
    (tmp_path / "failed" / "logs").mkdir()
    (tmp_path / "failed" / "logs" / "trainer.log").write_text("boom")
    port = ("--inference.server.port", str(free_port()))
    _, cleared = _prepare(load_config(RLConfig, ["@", str(EXAMPLE), *port, "--output-dir", str(tmp_path / "failed")]))
    assert cleared and not (tmp_path / "failed" / "logs" / "trainer.log").exists()


def test_a_checkpoint_of_another_kind_of_run_is_not_resumed(capsys, tmp_path):
    """``trainer --ckpt.resume-step 2`` in an SFT run's directory used to load the SFT model and optimizer state and
    then wait, at step 2, for rollouts an RL run had never made; the reverse resumed RL state as SFT."""
    run = tmp_path / "run"
    _trained_run(run, 2)
    (run / "checkpoints" / "step_2" / "trainer" / "progress.json").write_text('{"step": 2, "process": "sft"}')
    err = error_line(
        capsys, TrainerConfig, "--model.name", str(MODEL), "--output-dir", str(run), "--ckpt.resume-step", "2"
    )
    assert err == (
        f"error: CLI --ckpt.resume-step: ckpt.resume-step: checkpoint step 2 in {run} was written by sft, and trainer "
        f"does not resume another kind of run: start afresh in another --output-dir from its weights (--model.name "
        f"{run}/weights/step_2)"
    )
    (run / "checkpoints" / "step_2" / "trainer" / "progress.json").write_text('{"step": 2}')  # saved before the field
    assert parse_cli(TrainerConfig, ["--model.name", str(MODEL), "--output-dir", str(run), "--ckpt.resume-step", "2"],
                     prog="trainer").ckpt.resume_step == 2  # fmt: skip


@pytest.mark.parametrize(
    ("value", "why"),
    [('{"A=B": "x"}', "'A=B'"), ('{"": "x"}', "''"), ('{"A": "x\\u0000y"}', "A's value (a NUL)")],
)
def test_an_environment_variable_no_process_can_get_is_named(capsys, value, why):
    """``--env-vars '{"A=B": "x"}'`` was accepted and failed at the first process start as "illegal environment
    variable name" (a NUL: "embedded null byte"), naming no option."""
    err = error_line(capsys, RLConfig, "@", str(EXAMPLE), "--env-vars", value)
    assert err == f"error: CLI --env-vars: env_vars: {why} cannot be set in a process's environment"


@pytest.mark.parametrize(
    "flag",
    ["--health-timeout", "--orchestrator.client.timeout", "--trainer.parallel.timeout-s", "--liveness.startup-s"],
)
def test_a_wait_of_a_thousand_years_is_no_bound(capsys, flag):
    """``inf`` was refused but ``1e300`` was taken: a wait with no bound, and past threading.TIMEOUT_MAX (2**63 ns) a
    lock's ``acquire(timeout=...)`` raises OverflowError."""
    big = "99999999999" if flag.endswith("timeout-s") else "1e300"  # an int field takes no exponent
    err = error_line(capsys, RLConfig, "@", str(EXAMPLE), flag, big)
    expected = f"a wait of {float(big):g} s is no bound: at most 604800 s (7 days), got '{big}'"
    assert err == f"error: CLI {flag}: {flag[2:]}: {expected}"
    assert parse_cli(RLConfig, ["@", str(EXAMPLE), flag, "604800"], prog="rl", network=False)


def test_rewind_to_a_step_with_no_checkpoint_removes_nothing(tmp_path):
    """``prime-launch rewind --step 3`` (a typo for 4) used to remove the weights of every step after 3, leaving
    checkpoint 4 without the weights it resumes with (no longer resumable)."""
    run = tmp_path / "run"
    _trained_run(run, 2, 4)
    proc = _run("-m", "prime_launch.entrypoints.cli", "rewind", "--output-dir", str(run), "--step", "3")
    assert proc.returncode == 2 and proc.stderr == (
        f"error: step: 3 is not a complete checkpoint of {run} (complete checkpoint steps: 2, 4); rewind to the step "
        "the run resumes from\n"
    )
    assert (run / "weights" / "step_4").is_dir()


def test_an_sbatch_value_with_a_space_is_refused_before_anything_is_cleared(tmp_path):
    """sbatch ends an ``#SBATCH`` value at a space: ``--slurm.job-name 'my run'`` named the job ``my``, and an output
    directory with a space sent the job log to the path's first word (``slurm sft --overwrite`` cleared the run
    first)."""
    spaced = tmp_path / "my run"
    _trained_run(spaced, 2)
    (spaced / "configs").mkdir()
    (spaced / "configs" / "sft.toml").write_text("")
    sft = ["-m", "prime_launch.entrypoints.cli", "slurm", "sft", "--model.name", str(MODEL), "--data.fake.batch-size"]
    proc = _run(*sft, "1", "--output-dir", str(spaced), "--overwrite")
    assert proc.returncode == 2 and proc.stderr == (
        f"error: output-dir: '{spaced}' holds a space, which the job's #SBATCH --output line cannot carry: choose a "
        "directory without spaces\n"
    )
    assert (spaced / "checkpoints" / "step_2").is_dir()
    proc = _run(*sft, "1", "--output-dir", str(tmp_path / "run"), "--slurm.job-name", "my run", "--dry-run")
    assert proc.returncode == 2 and proc.stderr == (
        "error: CLI --slurm.job-name: slurm.job-name: an #SBATCH value is one word: no spaces, not empty, got 'my run'\n"
    )


def test_inference_output_dir_urls_and_lengths_are_checked_at_parse(capsys, tmp_path):
    """``inference --output-dir <not writable>`` was a FileNotFoundError traceback (its dry run too); a URL with a
    space and a ``max_model_len`` of 10**11 were taken."""
    from prime_core.config.inference import InferenceConfig
    from prime_core.config.orchestrator import OrchestratorConfig

    blocked = tmp_path / "file"
    blocked.write_text("")
    for extra in ([], ["--dry-run"]):
        proc = _run("-m", "prime_inference.entrypoints.inference", "--model.name", str(MODEL), "--output-dir",
                    str(blocked / "run"), "--server.port", "1", *extra)  # fmt: skip
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith("error: CLI --output-dir: output-dir: "), proc.stderr
    err = error_line(capsys, OrchestratorConfig, "--model.name", str(MODEL), "--client.base-urls", "http://a b")
    assert err.endswith("client.base-urls.0: not an http(s) URL like http://127.0.0.1:8000, got 'http://a b'")
    err = error_line(capsys, InferenceConfig, "--model.name", str(MODEL), "--max-model-len", str(10**11))
    assert (
        err
        == f"error: CLI --max-model-len: max-model-len: Input should be less than or equal to 16777216, got '{10**11}'"
    )


def test_a_key_of_a_section_or_of_another_command_says_where_it_belongs(capsys, tmp_path):
    """A trainer config given to ``rl`` said "unknown key 'optim'", ``--lr`` suggested nothing, and sft.toml given to
    ``trainer`` suggested 'data.fake' for its data.path."""
    (tmp_path / "t.toml").write_text("[optim]\nlr = 1e-4\n")
    err = error_line(capsys, RLConfig, "@", str(EXAMPLE), "@", str(tmp_path / "t.toml"))
    assert err == f"error: file {tmp_path}/t.toml: unknown key 'optim' (did you mean 'trainer.optim'?)"
    err = error_line(capsys, RLConfig, "@", str(EXAMPLE), "--lr", "1e-4")
    assert err == "error: CLI --lr: unknown key 'lr' (did you mean 'trainer.optim.lr'?)"
    sft_toml = REPO / "examples" / "reverse_text" / "sft.toml"
    err = error_line(capsys, TrainerConfig, "@", str(sft_toml))
    assert err == f"error: file {sft_toml}: unknown key 'data.path' (an option of sft)"
    err = error_line(capsys, TrainerConfig, "--max-step", "3")
    assert err == "error: CLI --max-step: unknown key 'max-step' (did you mean 'max-steps'?)"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("Qwen/Qwen3-0.6B", "outputs/Qwen-Qwen3-0.6B-eval"),
        ("outputs/run/weights/step_60", "outputs/run-step_60-eval"),
        ("../../..", "outputs/model-eval"),
        (f"/models/{'a' * 255}/{'b' * 255}", f"outputs/{'a' * 128}-eval"),
    ],
)
def test_the_default_run_directory_of_any_model_name_is_one_creatable_directory_under_outputs(tmp_path, name, expected):
    """A model's name (two path parts of up to 255 characters each) names an eval's directory that can be made."""
    run_dir = default_run_dir(name, "eval")
    assert str(run_dir) == expected
    (tmp_path / run_dir).mkdir(parents=True)
