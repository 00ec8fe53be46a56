"""The config system's contract: precedence, CLI syntax, one-line errors, help, dry run."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Annotated, Literal

import pytest
from prime_core.config import BaseConfig, ConfigError, config_to_toml, load_config, parse_cli
from pydantic import Field, model_validator


class Optim(BaseConfig):
    lr: float = 1e-3
    """Learning rate."""
    betas: list[float] = [0.9, 0.999]
    """Adam betas."""
    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay."""


class GrpoLoss(BaseConfig):
    type: Literal["grpo"] = "grpo"
    """Objective."""
    clip_high: float = 0.28
    """Upper clip."""


class GspoLoss(BaseConfig):
    type: Literal["gspo"] = "gspo"
    """Objective."""
    seq_clip: float = 3e-4
    """Sequence clip."""


class Wandb(BaseConfig):
    enabled: bool = False
    """Log to W&B."""
    name: str | None = None
    """Run name."""


class Cfg(BaseConfig):
    output_dir: Path = Path("outputs")
    """Run directory."""
    max_steps: int = 10
    """Steps to train."""
    seed: int = 0
    """Seed."""
    bench: bool = False
    """Benchmark mode."""
    mode: Literal["fast", "slow"] = "fast"
    """Mode."""
    envs: list[str] = ["reverse-text"]
    """Environment ids."""
    tags: dict[str, str] = {}
    """Tags."""
    optim: Optim = Field(default_factory=Optim)
    """Optimizer."""
    loss: Annotated[GrpoLoss | GspoLoss, Field(discriminator="type")] = Field(default_factory=GrpoLoss)
    """Loss."""
    wandb: Wandb = Field(default_factory=Wandb)
    """W&B."""
    micro_batch_size: int = 1
    """Micro-batch rows."""
    batch_size: int = 4
    """Batch rows."""

    @model_validator(mode="after")
    def _batch_divides(self) -> Cfg:
        if self.batch_size % self.micro_batch_size:
            raise ValueError("batch_size must be a multiple of micro_batch_size")
        return self


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_precedence_cli_then_last_file_then_first_then_env_then_default(tmp_path):
    first = write(tmp_path, "a.toml", "max_steps = 1\n[optim]\nlr = 0.1\n")
    last = write(tmp_path, "b.toml", "max-steps = 2\n[optim]\nlr = 0.2\n")
    env = {"PRIME_MAX_STEPS": "3", "PRIME_OPTIM__LR": "0.3"}

    cfg = load_config(Cfg, ["@", first, f"@{last}", "--max-steps", "4", "--optim.lr=0.4"], environ=env)
    assert (cfg.max_steps, cfg.optim.lr) == (4, 0.4)
    cfg = load_config(Cfg, ["@", first, "@", last], environ=env)
    assert (cfg.max_steps, cfg.optim.lr) == (2, 0.2)
    cfg = load_config(Cfg, ["@", first], environ=env)
    assert (cfg.max_steps, cfg.optim.lr) == (1, 0.1)
    cfg = load_config(Cfg, [], environ=env)
    assert (cfg.max_steps, cfg.optim.lr) == (3, 0.3)
    cfg = load_config(Cfg, [], environ={})
    assert (cfg.max_steps, cfg.optim.lr) == (10, 1e-3)


def test_cli_syntax_forms(tmp_path):
    cfg = load_config(
        Cfg,
        [
            "--max_steps=7",
            "--bench",
            "--no-wandb.enabled",
            "--envs",
            "a",
            "b",
            "--optim.betas",
            "0.5,0.6",
            "--tags",
            '{"team": "rl"}',
            "--loss.type",
            "gspo",
            "--loss.seq-clip",
            "0.01",
        ],
        environ={},
    )
    assert cfg.max_steps == 7 and cfg.bench and not cfg.wandb.enabled
    assert cfg.envs == ["a", "b"] and cfg.optim.betas == [0.5, 0.6] and cfg.tags == {"team": "rl"}
    assert isinstance(cfg.loss, GspoLoss) and cfg.loss.seq_clip == 0.01
    assert load_config(Cfg, ["--envs", "x,y"], environ={}).envs == ["x", "y"]
    assert load_config(Cfg, ["--bench", "false"], environ={}).bench is False
    assert load_config(Cfg, ["--wandb.no-enabled"], environ={}).wandb.enabled is False
    assert load_config(Cfg, ["--envs", ""], environ={}).envs == []
    assert load_config(Cfg, ["--wandb.name", ""], environ={}).wandb.name == ""


def test_union_option_without_type_keeps_the_default_type(tmp_path):
    """``--loss.clip-high 0.3`` tunes the default objective (as a whole-section default would): it used to stop with
    "loss: Unable to extract tag using discriminator 'type'" unless ``--loss.type`` was given too."""
    cfg = load_config(Cfg, ["--loss.clip-high", "0.3"], environ={})
    assert isinstance(cfg.loss, GrpoLoss) and cfg.loss.clip_high == 0.3
    cfg = load_config(Cfg, [], environ={"PRIME_LOSS__CLIP_HIGH": "0.4"})
    assert isinstance(cfg.loss, GrpoLoss) and cfg.loss.clip_high == 0.4
    cfg = load_config(Cfg, ["@", write(tmp_path, "l.toml", "[loss]\nclip-high = 0.5\n")], environ={})
    assert isinstance(cfg.loss, GrpoLoss) and cfg.loss.clip_high == 0.5
    # An option of another type is still refused, naming the type that has it.
    with pytest.raises(
        ConfigError, match=r"^CLI --loss.seq-clip: unknown key 'loss.seq-clip' \(an option of loss.type gspo\)$"
    ):
        load_config(Cfg, ["--loss.seq-clip", "0.1"], environ={})


def test_section_file(tmp_path):
    optim = write(tmp_path, "optim.toml", "lr = 0.05\nweight-decay = 0.1\n")
    cfg = load_config(Cfg, ["--optim", "@", optim], environ={})
    assert cfg.optim.lr == 0.05 and cfg.optim.weight_decay == 0.1


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match=r"unknown key 'optim.lrr' \(did you mean 'optim.lr'\?\)"):
        load_config(Cfg, ["--optim.lrr", "1"], environ={})


def test_unknown_key_suggests_the_option_holding_that_word():
    """sbatch's ``--nodes`` typed as ``--slurm.nodes``: ``slurm.num-nodes`` is meant, not the similar ``nodelist``."""
    from prime_core.config.slurm import SlurmConfig

    with pytest.raises(ConfigError, match=r"'nodes' \(did you mean 'num-nodes'\?\)"):
        load_config(SlurmConfig, ["--nodes", "2"], environ={})
    with pytest.raises(ConfigError, match=r"'gpus' \(did you mean 'gpus-per-node'\?\)"):
        load_config(SlurmConfig, ["--gpus", "2"], environ={})


def test_error_names_source(tmp_path):
    bad = write(tmp_path, "bad.toml", "[optim]\nlr = 'fast'\n")
    with pytest.raises(ConfigError, match=r"^file .*bad.toml: optim.lr: "):
        load_config(Cfg, ["@", bad], environ={})
    with pytest.raises(ConfigError, match=r"^env PRIME_SEED: seed: "):
        load_config(Cfg, [], environ={"PRIME_SEED": "x"})
    with pytest.raises(ConfigError, match=r"^CLI --loss.seq-clip: "):
        load_config(Cfg, ["--loss.type", "gspo", "--loss.seq-clip", "big"], environ={})

    # A check across fields: the validator's own message, without pydantic's wrapping.
    with pytest.raises(ConfigError) as exc:
        load_config(Cfg, ["--micro-batch-size", "3"], environ={})
    assert str(exc.value) == "CLI --micro-batch-size: batch_size must be a multiple of micro_batch_size"


def test_dry_run_round_trip(tmp_path):
    out = tmp_path / "run"
    argv = ["--output-dir", str(out), "--loss.type", "gspo", "--tags", '{"a": "b"}', "--wandb.name", "x", "--dry-run"]
    with redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as exc:
        parse_cli(Cfg, argv, prog="trainer")
    assert exc.value.code == 0
    resolved = out / "configs" / "trainer.toml"
    original = load_config(Cfg, argv[:-1], environ={})
    assert load_config(Cfg, ["@", str(resolved)], environ={}) == original
    assert config_to_toml(original) == resolved.read_text()


def test_help_lists_every_option_with_docstring():
    buf = io.StringIO()
    with redirect_stdout(buf), pytest.raises(SystemExit) as exc:
        parse_cli(Cfg, ["--help"], prog="trainer")
    assert exc.value.code == 0
    text = buf.getvalue()
    for flag in ["--max-steps int", "--optim.lr float", "--loss.seq-clip float", "--wandb.enabled bool"]:
        assert flag in text
    assert "Learning rate." in text and "(default: 10)" in text


# ----------------------------------------------------------------- 50 malformed inputs


def malformed_cases(tmp: Path) -> list[tuple[list[str], dict[str, str]]]:
    broken = write(tmp, "broken.toml", "max_steps = [\n")
    unknown = write(tmp, "unknown.toml", "[optim]\nlearning_rate = 1\n")
    wrong_type = write(tmp, "wrong.toml", "max_steps = 'many'\n")
    section_scalar = write(tmp, "section.toml", "optim = 3\n")
    nested_unknown = write(tmp, "nested.toml", "[loss]\ntype = 'grpo'\nseq_clip = 1\n")
    binary = tmp / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00bad")
    dup = write(tmp, "dup.toml", "max-steps = 1\nmax_steps = 2\n")
    directory = tmp / "adir.toml"
    directory.mkdir(exist_ok=True)
    cases: list[list[str]] = [
        ["--optim.lrr", "1"],
        ["--optimizer.lr", "1"],
        ["--max-step", "1"],
        ["--max-steps", "x"],
        ["--max-steps", "1.5"],
        ["--max-steps"],
        ["--max-steps", "1", "2"],
        ["--optim.lr", "fast"],
        ["--optim.weight-decay", "-1"],
        ["--optim.betas", "[1, 'a']"],
        ["--optim.betas", "[1, 2"],
        ["--tags", "notadict"],
        ["--tags", "{broken"],
        ["--mode", "medium"],
        ["--loss.type", "ppo"],
        ["--loss.type", "grpo", "--loss.seq-clip", "1"],
        ["--loss.clip-high", "high"],
        ["--bench", "maybe"],
        ["--bench=maybe"],
        ["--no-max-steps"],
        ["--no-bench=1"],
        ["--optim", "3"],
        ["--optim.lr.value", "1"],
        ["--max-steps", "1", "--max-steps", "2"],
        ["--bench", "--no-bench"],
        ["positional"],
        ["-x"],
        ["--"],
        ["--.lr", "1"],
        ["--optim..lr", "1"],
        ["@"],
        ["@", "/nonexistent/file.toml"],
        ["@/nonexistent/file.toml"],
        ["@", broken],
        ["@", unknown],
        ["@", wrong_type],
        ["@", section_scalar],
        ["@", nested_unknown],
        ["@", str(binary)],
        ["@", dup],
        ["@", str(directory)],
        ["--optim", "@", "/nonexistent.toml"],
        ["--max-steps", "@", unknown],
        ["--optim", "@"],
        ["--micro-batch-size", "3", "--batch-size", "4"],
        ["--seed", ""],
    ]
    out: list[tuple[list[str], dict[str, str]]] = [(c, {}) for c in cases]
    out += [
        ([], {"PRIME_MAX_STEPS": "many"}),
        ([], {"PRIME_OPTIM__LR": "fast"}),
        ([], {"PRIME_OPTIM__LRR": "1"}),
        ([], {"PRIME_TAGS": "nodict"}),
        ([], {"PRIME_BENCH": "perhaps"}),
    ]
    return out


def test_fifty_malformed_inputs_give_one_line_errors_and_exit_2(tmp_path):
    cases = malformed_cases(tmp_path)
    assert len(cases) >= 50
    for argv, env in cases:
        err = io.StringIO()
        old = dict(os.environ)
        os.environ.update(env)
        try:
            with redirect_stderr(err), redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as exc:
                parse_cli(Cfg, argv, prog="t")
        finally:
            os.environ.clear()
            os.environ.update(old)
        message = err.getvalue()
        assert exc.value.code == 2, (argv, env, message)
        assert message.startswith("error: ") and message.count("\n") == 1, (argv, env, message)
        assert "Traceback" not in message


def test_malformed_input_in_a_real_process_has_no_traceback(tmp_path):
    code = (
        "from prime_core.config import BaseConfig, parse_cli\n"
        "class C(BaseConfig):\n    steps: int = 1\n    '''Steps.'''\n"
        "parse_cli(C, prog='x')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, "--stepz", "2"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr == "error: CLI --stepz: unknown key 'stepz' (did you mean 'steps'?)\n"


def test_every_config_field_has_a_docstring():
    """Every field of every config class documents itself (it is the --help text and the docs' source)."""
    import importlib
    import inspect
    import pkgutil

    import prime_core.config as config_pkg
    from prime_core.config.base import BaseConfig

    classes = set()
    for info in pkgutil.iter_modules(config_pkg.__path__):
        module = importlib.import_module(f"prime_core.config.{info.name}")
        classes.update(c for _, c in inspect.getmembers(module, inspect.isclass) if issubclass(c, BaseConfig))
    classes.discard(BaseConfig)
    assert len(classes) > 30
    undocumented = sorted(
        f"{c.__name__}.{name}" for c in classes for name, f in c.model_fields.items() if not f.description
    )
    assert undocumented == []


def test_help_types_are_types_a_user_writes():
    """A constrained element type is shown as its type: `--client.base-urls` read
    `list[Annotated[str, AfterValidator(func=<function _http_url at 0x7f...>)]]`, `--optim.betas` a pydantic FieldInfo."""
    from prime_core.config.cli import format_help
    from pydantic import AfterValidator

    class Shown(BaseConfig):
        urls: list[Annotated[str, AfterValidator(str.strip)]] = []
        """URLs."""
        betas: tuple[Annotated[float, Field(ge=0)], Annotated[float, Field(lt=1)]] = (0.9, 0.99)
        """Betas."""
        paths: dict[Literal["a", "b"], Path | None] = {}
        """Paths."""

    text = format_help(Shown, "prog")
    assert "--urls list[str]  " in text and "--betas tuple[float, float]  " in text, text
    assert "--paths dict[a|b, Path | None]  " in text, text
