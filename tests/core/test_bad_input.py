"""Hostile config input to every entry point ends in one line naming the field (or file, or variable) and exit 2,
before anything loads: deeply nested TOML, booleans and infinities where numbers go, empty paths, near-miss PRIME_
variables, broken model directories, missing datasets, tokenizers and checkpoints, a run directory under a file, and
settings of rl's processes that can never work together."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from prime_core.config import parse_cli
from prime_core.config.orchestrator import EvalConfig, OrchestratorConfig
from prime_core.config.rl import RLConfig
from prime_core.config.trainer import SFTConfig, TrainerConfig
from prime_core.io import mark_stable

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "reverse_text" / "rl.toml"
MODEL = REPO / "examples" / "reverse_text" / "model"


def error_line(capsys, model, *argv: str) -> str:
    """Parse a command line in-process; return its one error line (exit 2 asserted)."""
    with pytest.raises(SystemExit) as exc:
        parse_cli(model, list(argv), prog="x")
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    return err.strip()


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


# ---------------------------------------------------------------- TOML files and values


@pytest.mark.parametrize(
    "text", ["max_steps = " + "[" * 100_000 + "]" * 100_000, "x = " + "{a=" * 3000 + "1" + "}" * 3000]
)
def test_deeply_nested_toml_is_one_line(capsys, tmp_path, text):
    (tmp_path / "deep.toml").write_text(text + "\n")
    err = error_line(capsys, RLConfig, "@", str(tmp_path / "deep.toml"))
    assert err == f"error: file {tmp_path}/deep.toml: cannot parse TOML file '{tmp_path}/deep.toml': arrays or " + (
        "tables nested too deeply"
    )


def test_deeply_nested_json_on_the_cli_is_one_line(capsys):
    err = error_line(capsys, TrainerConfig, "--loss.kwargs", "[" * 100_000 + "]" * 100_000)
    assert err.startswith("error: CLI --loss.kwargs: ")


def test_a_boolean_is_not_a_number(capsys, tmp_path):
    (tmp_path / "t.toml").write_text("max_steps = true\n[optim]\nlr = false\n")
    err = error_line(capsys, TrainerConfig, "@", str(tmp_path / "t.toml"))
    assert err == f"error: file {tmp_path}/t.toml: max-steps: expected a number, got the boolean true"


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--optim.lr", "inf"),
        ("--orchestrator.client.timeout", "inf"),
        ("--orchestrator.weights-timeout", "inf"),
        ("--health-timeout", "inf"),
        ("--orchestrator.sampling.temperature", "inf"),
        ("--orchestrator.advantage.length-penalty.weight", "-inf"),
    ],
)
def test_infinities_are_refused(capsys, flag, value):
    model = TrainerConfig if flag == "--optim.lr" else RLConfig
    argv = [flag, value] if model is TrainerConfig else ["@", str(EXAMPLE), flag, value]
    err = error_line(capsys, model, *argv)
    assert err == f"error: CLI {flag}: {flag[2:]}: Input should be a finite number, got '{value}'"


def test_empty_paths_are_refused_from_every_source(capsys, tmp_path, monkeypatch):
    expected = "empty path (a path of '' would mean the current directory)"
    assert error_line(capsys, RLConfig, "@", str(EXAMPLE), "--output-dir", "") == f"error: CLI --output-dir: {expected}"
    (tmp_path / "t.toml").write_text('output_dir = ""\n')
    err = error_line(capsys, TrainerConfig, "@", str(tmp_path / "t.toml"))
    assert err == f"error: file {tmp_path}/t.toml: output-dir: {expected}"
    monkeypatch.setenv("PRIME_OUTPUT_DIR", "")
    assert error_line(capsys, TrainerConfig) == f"error: env PRIME_OUTPUT_DIR: {expected}"


def test_a_section_error_names_the_cli_flag_that_overrode_the_file(capsys):
    err = error_line(capsys, RLConfig, "@", str(EXAMPLE), "--orchestrator.batch-size", "100")
    assert err.startswith("error: CLI --orchestrator.batch-size: orchestrator: batch_size (100) must be a multiple")


# ---------------------------------------------------------------- PRIME_ variables


def test_a_near_miss_prime_variable_is_an_error(capsys, monkeypatch):
    monkeypatch.setenv("PRIME_MAX_STEP", "3")
    err = error_line(capsys, TrainerConfig)
    assert err == "error: env PRIME_MAX_STEP: no option 'max_step' (did you mean PRIME_MAX_STEPS?)"


def test_prime_variables_of_other_commands_and_of_the_project_are_left_alone(monkeypatch):
    for name in ("PRIME_RUN_ID", "PRIME_PROGRESS_DIR", "PRIME_SERVER__PORT", "PRIME_STEPS", "PRIME_ENVIRONMENT_IDS"):
        monkeypatch.setenv(name, "1")
    assert parse_cli(TrainerConfig, [], prog="trainer", network=False).max_steps == TrainerConfig().max_steps


# ---------------------------------------------------------------- files a config names


def _model_copy(tmp_path: Path, config_text: str) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(config_text)
    return model


@pytest.mark.parametrize(
    ("config_text", "reason"),
    [
        ('{"model_type": ', "is not valid JSON (Expecting value: line 1 column 16 (char 15))"),
        ("{}", "has no model_type: not a Hugging Face model config"),
        ("[1, 2]", "has no model_type: not a Hugging Face model config"),
    ],
)
def test_a_broken_config_json_is_one_line_before_any_load(capsys, tmp_path, config_text, reason):
    model = _model_copy(tmp_path, config_text)
    err = error_line(capsys, TrainerConfig, "--model.name", str(model))
    assert err == f"error: CLI --model.name: model.name: '{model}/config.json' {reason}"


def test_a_file_is_not_a_model(capsys, tmp_path):
    (tmp_path / "weights.bin").write_text("x")
    err = error_line(capsys, TrainerConfig, "--model.name", str(tmp_path / "weights.bin"))
    assert err == f"error: CLI --model.name: model.name: '{tmp_path}/weights.bin' is a file, not a model directory " + (
        "(one holding config.json)"
    )


def test_missing_tokenizer_dataset_and_checkpoint_are_named(capsys, tmp_path):
    M = ("--model.name", str(MODEL))
    err = error_line(capsys, TrainerConfig, *M, "--init.tokenizer", str(tmp_path / "tok"))
    assert err == f"error: CLI --init.tokenizer: init.tokenizer: no such file or directory '{tmp_path}/tok' (tokenizer)"
    err = error_line(capsys, SFTConfig, *M, "--data.path", str(tmp_path / "sft.jsonl"))
    assert err == f"error: CLI --data.path: data.path: no such file or directory '{tmp_path}/sft.jsonl' (dataset)"
    (tmp_path / "empty").mkdir()
    err = error_line(capsys, SFTConfig, *M, "--data.path", str(tmp_path / "empty"))
    assert "holds no .jsonl/.json/.parquet file" in err and err.startswith("error: CLI --data.path: data.path: ")
    run = tmp_path / "run"
    err = error_line(capsys, TrainerConfig, *M, "--output-dir", str(run), "--ckpt.resume-step", "5")
    assert err == (
        f"error: CLI --ckpt.resume-step: ckpt.resume-step: no complete checkpoint {run}/checkpoints/step_5/trainer "
        "(complete checkpoint steps: none)"
    )
    (run / "checkpoints" / "step_5" / "trainer").mkdir(parents=True)
    mark_stable(run / "checkpoints" / "step_5")
    mark_stable(run / "checkpoints" / "step_5" / "trainer")
    config = parse_cli(
        TrainerConfig, [*M, "--output-dir", str(run), "--ckpt.resume-step", "5"], prog="x", network=False
    )
    assert config.ckpt.resume_step == 5


def test_a_run_directory_at_or_under_a_file_is_one_line(capsys, tmp_path):
    (tmp_path / "f").write_text("x")
    err = error_line(capsys, RLConfig, "@", str(EXAMPLE), "--output-dir", str(tmp_path / "f"))
    assert (
        err == f"error: CLI --output-dir: output-dir: '{tmp_path}/f' is a file; the run directory must be a directory"
    )
    err = error_line(capsys, TrainerConfig, "--output-dir", str(tmp_path / "f" / "run"))
    assert err == f"error: CLI --output-dir: output-dir: '{tmp_path}/f/run' cannot be created: '{tmp_path}/f' is a file"


# ---------------------------------------------------------------- settings that never work together


def test_settings_that_can_never_work_are_refused(capsys):
    err = error_line(capsys, RLConfig, "@", str(EXAMPLE), "--orchestrator.sampling.max-tokens", "1000000000000")
    assert err == (
        "error: CLI --orchestrator.sampling.max-tokens: orchestrator: sampling.max_tokens (1000000000000) > seq_len "
        "(256): a completion that long cannot fit a training sample"
    )
    err = error_line(capsys, RLConfig, "@", str(EXAMPLE), "--inference.max-model-len", "16")
    assert err == (
        "error: CLI --inference.max-model-len: inference.max_model_len (16) <= orchestrator.sampling.max_tokens (48): "
        "the server would refuse every request"
    )
    # A check across fields names the flag that set one of its fields, not the last flag given (here --seed).
    err = error_line(capsys, RLConfig, "@", str(EXAMPLE), "--trainer.model.lora.rank", "8", "--seed", "3")
    assert err.startswith("error: CLI --trainer.model.lora.rank: only trainer.model.lora is set: the trainer publishes")
    err = error_line(capsys, TrainerConfig, "--optim.betas", "0.9,1.5")
    assert err == "error: CLI --optim.betas: optim.betas.1: Input should be less than 1, got '1.5'"
    err = error_line(capsys, EvalConfig, "--environment-ids", "")
    assert err == "error: CLI --environment-ids: no environment to evaluate: set environment_ids or env"
    assert OrchestratorConfig(seq_len=128, sampling={"max_tokens": 128}).sampling.max_tokens == 128


# ---------------------------------------------------------------- prime-launch


def test_prime_launch_without_a_command_and_rewind_of_no_run_exit_2(tmp_path):
    def launch(*argv: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "prime_launch.entrypoints.cli", *argv]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    proc = launch()
    assert proc.returncode == 2 and proc.stderr.startswith("error: prime-launch needs a command"), proc.stderr
    proc = launch("rewind", "--output-dir", str(tmp_path / "none"), "--step", "3")
    assert proc.returncode == 2 and proc.stderr == (
        f"error: output-dir: '{tmp_path}/none' is not a run directory (no such directory)\n"
    )
    proc = launch("rewind", "--output-dir", str(tmp_path), "--step", "-1")
    assert proc.returncode == 2 and "step: Input should be greater than or equal to 0" in proc.stderr


def test_a_seq_len_no_row_can_hold_is_refused_at_start(capsys):
    """``--seq-len 10**12`` used to start every process and die at the first packing: a 7 TiB numpy traceback."""
    for model, argv in ((RLConfig, ["@", str(EXAMPLE)]), (TrainerConfig, []), (OrchestratorConfig, [])):
        err = error_line(capsys, model, *argv, "--seq-len", str(10**12))
        assert (
            err == "error: CLI --seq-len: seq-len: Input should be less than or equal to 16777216, got '1000000000000'"
        )


def test_a_model_directory_without_a_tokenizer_is_refused_where_one_is_needed(capsys, tmp_path):
    """``rl --model.name <dir without tokenizer files>`` used to load the server, start env workers and fail a minute
    later: "16 of 16 rollouts failed ... token_ids: List should have at least 1 item". The trainer needs none."""
    model = _model_copy(tmp_path, '{"model_type": "qwen3"}')
    reason = f"'{model}' holds no tokenizer (tokenizer.json or tokenizer_config.json): copy the tokenizer files there"
    (tmp_path / "sft.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    extra = {RLConfig: ["@", str(EXAMPLE)], SFTConfig: ["--data.path", str(tmp_path / "sft.jsonl")]}
    for config in (RLConfig, OrchestratorConfig, EvalConfig, SFTConfig):
        argv = extra.get(config, [])
        err = error_line(capsys, config, *argv, "--model.name", str(model))
        assert err == f"error: CLI --model.name: model.name: {reason}"
    err = error_line(capsys, RLConfig, "--trainer.model.name", str(model), "--orchestrator.model.name", str(model))
    assert err == f"error: CLI --orchestrator.model.name: orchestrator.model.name: {reason}"  # no shared model
    config = parse_cli(TrainerConfig, ["--model.name", str(model), "--output-dir", str(tmp_path)], prog="x")
    assert config.model.name == str(model)
    (model / "tokenizer.json").write_text("{}")
    assert parse_cli(EvalConfig, ["--model.name", str(model), "--environment-ids", "arithmetic"], prog="x")


def test_server_urls_that_cannot_be_connected_to_are_named(capsys):
    """``--client.base-url http://127.0.0.1:99999`` used to start the orchestrator and die in its first connect with
    an OverflowError traceback."""
    err = error_line(capsys, OrchestratorConfig, "--client.base-url", "http://127.0.0.1:99999")
    assert (
        err == "error: CLI --client.base-url: client.base-url: the port must be 0-65535, got 'http://127.0.0.1:99999'"
    )
    err = error_line(capsys, RLConfig, "@", str(EXAMPLE), "--orchestrator.judge.base-url", "localhost:8001/v1")
    assert err.endswith(
        "orchestrator.judge.base-url: not an http(s) URL like http://127.0.0.1:8000, got 'localhost:8001/v1'"
    )
    config = OrchestratorConfig(client={"base_urls": ["https://example.com/v1/", "http://[::1]:8000"]})
    assert config.client.base_urls == ["https://example.com", "http://[::1]:8000"]
