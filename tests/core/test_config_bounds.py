"""Numbers no run can use: an lr of 1e300, a temperature of 1e9, a batch of 10**12, a clip range past float32, a
warmup longer than the run. Each used to parse and break the run late (a NaN step, an allocation that fails, a step
that never fills) or silently (a schedule that never reaches its rate); each is now one line at parse that names the
field, exit 2. The values a real run uses (temperature 0, the examples) still parse."""

from __future__ import annotations

import pytest
from prime_core.config import parse_cli
from prime_core.config.inference import InferenceConfig
from prime_core.config.orchestrator import EvalConfig, OrchestratorConfig
from prime_core.config.rl import RLConfig
from prime_core.config.trainer import SFTConfig, TrainerConfig

from tests.core.test_bad_input import EXAMPLE, MODEL, REPO, error_line

SFT_EXAMPLE = REPO / "examples" / "reverse_text" / "sft.toml"
M = ["--model.name", str(MODEL)]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)


LE = "Input should be less than or equal to"
BOUNDS = [
    # rl: the shared file, every sub-config reached through it
    (RLConfig, ["@", str(EXAMPLE)], "--trainer.optim.lr", "1e300", f"{LE} 1"),
    (RLConfig, ["@", str(EXAMPLE)], "--trainer.optim.weight-decay", "1e6", f"{LE} 1"),
    (RLConfig, ["@", str(EXAMPLE)], "--trainer.loss.kl-coef", "1e300", f"{LE} 100"),
    (RLConfig, ["@", str(EXAMPLE)], "--trainer.loss.clip-high", "1e40", f"{LE} 100"),
    (RLConfig, ["@", str(EXAMPLE)], "--orchestrator.sampling.temperature", "1e9", f"{LE} 10"),
    (RLConfig, ["@", str(EXAMPLE)], "--orchestrator.sampling.top-p", "1.5", f"{LE} 1"),
    (RLConfig, ["@", str(EXAMPLE)], "--orchestrator.batch-size", str(10**12), f"{LE} 1048576"),
    (RLConfig, ["@", str(EXAMPLE)], "--orchestrator.client.max-retries", str(10**9), f"{LE} 100"),
    (RLConfig, ["@", str(EXAMPLE)], "--orchestrator.eval.temperatures", "[1.0, 1e9]", "values in [0, 10]"),
    (RLConfig, ["@", str(EXAMPLE)], "--trainer.optim.max-norm", "0", "Input should be greater than 0"),
    (RLConfig, ["@", str(EXAMPLE)], "--devices.num-cpu-trainer-procs", str(10**6), f"{LE} 1024"),
    # trainer alone
    (TrainerConfig, M, "--optim.lr", "1e300", f"{LE} 1"),
    (TrainerConfig, M, "--optim.eps", "5", f"{LE} 1"),
    (TrainerConfig, [*M, "--loss.type", "grpo"], "--loss.mask-low", "1.5", "Input should be less than 1"),
    (TrainerConfig, [*M, "--loss.type", "grpo"], "--loss.entropy-coef", "1e300", f"{LE} 100"),
    (TrainerConfig, M, "--parallel.dp-shard", "0", "0 shards over no rank"),
    (TrainerConfig, M, "--perf.peak-tflops", "-5", "Input should be greater than 0"),
    (TrainerConfig, M, "--model.lora.rank", str(10**9), f"{LE} 4096"),
    (TrainerConfig, M, "--weights.broadcast.bucket-mb", str(10**9), f"{LE} 65536"),
    # orchestrator alone
    (OrchestratorConfig, M, "--sampling.temperature", "1e9", f"{LE} 10"),
    (OrchestratorConfig, M, "--rollouts-per-example", str(10**12), f"{LE} 1048576"),
    (OrchestratorConfig, M, "--micro-batch-rows", str(10**12), f"{LE} 1048576"),
    (OrchestratorConfig, M, "--curriculum.max-draws-factor", "1e12", f"{LE} 100"),
    # sft
    (SFTConfig, ["@", str(SFT_EXAMPLE)], "--optim.lr", "1e300", f"{LE} 1"),
    (SFTConfig, ["@", str(SFT_EXAMPLE)], "--data.batch-size", str(10**12), f"{LE} 1048576"),
    # eval
    (EvalConfig, M, "--sampling.temperature", "1e9", f"{LE} 10"),
    (EvalConfig, M, "--sampling.max-tokens", "-3", "Input should be greater than or equal to 1"),
    (EvalConfig, M, "--sampling.max-tokens", str(10**12), f"{LE} 16777216"),
    (EvalConfig, M, "--num-examples", str(10**12), f"{LE} 1048576"),
    # inference
    (InferenceConfig, M, "--max-batch-size", str(10**12), f"{LE} 1048576"),
]


@pytest.mark.parametrize(
    ("model", "base", "flag", "value", "why"), BOUNDS, ids=[f"{b[0].__name__}{b[2]}" for b in BOUNDS]
)
def test_a_value_no_run_can_use_is_one_line_naming_the_field(capsys, model, base, flag, value, why):
    err = error_line(capsys, model, *base, flag, value)
    assert err.startswith(f"error: CLI {flag}: {flag[2:]}: "), err
    assert why in err, err


def test_a_warmup_past_the_last_step_and_a_min_lr_above_lr_are_refused(capsys):
    """Both parsed: the rate of a 5-step run with 100 warmup steps never passed 5% of optim.lr, and a cosine schedule
    to a min_lr above optim.lr raised the rate every step."""
    err = error_line(capsys, RLConfig, "@", str(EXAMPLE), "--trainer.scheduler.warmup-steps", "100", "--max-steps", "5")
    assert err.endswith("scheduler.warmup_steps (100) > max_steps (5): the learning rate would never reach optim.lr")
    err = error_line(capsys, SFTConfig, "@", str(SFT_EXAMPLE), "--scheduler.min-lr", "0.5", "--optim.lr", "1e-3")
    assert err.endswith("scheduler.min_lr (0.5) > optim.lr (0.001): the cosine schedule decays from optim.lr down to "
                        "min_lr")  # fmt: skip


def test_the_values_at_the_bounds_still_parse():
    """Greedy sampling, the largest bounded values and a warmup as long as the run are real settings."""
    rl = parse_cli(RLConfig, ["@", str(EXAMPLE), "--orchestrator.sampling.temperature", "0", "--trainer.optim.lr", "1",
                              "--trainer.scheduler.warmup-steps", "60", "--trainer.loss.kl-coef", "100",
                              "--orchestrator.eval.temperatures", "[0, 10]"], prog="rl", network=False)  # fmt: skip
    assert rl.orchestrator.sampling.temperature == 0 and rl.trainer.optim.lr == 1
    assert rl.trainer.scheduler.warmup_steps == rl.trainer.max_steps == 60
    ev = parse_cli(EvalConfig, [*M, "--sampling.temperature", "0"], prog="eval", network=False)
    assert ev.sampling.temperature == 0
