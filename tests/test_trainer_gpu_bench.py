"""benchmarks/trainer_gpu.py's one-call suite (issue 43) fails on the GPU host for no silly reason: every job's
command parses as the trainer / baseline parse it, caps and flags reach the command, records carry the targets, and
(slow) its jobs run end to end on CPU with a tiny model."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from prime_core.config import load_config
from prime_core.config.trainer import TrainerConfig

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    """A benchmark module by file, registered under its bare name as the scripts import each other (benchmarks/ is
    no package; dataclasses look their module up in sys.modules)."""
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module


@pytest.fixture(scope="module")
def bench():
    return load("trainer_gpu")


@pytest.fixture(scope="module")
def suite():
    return load("trainer_gpu_suite")


def trainer_argv(cmd: list[str]) -> list[str]:
    """The trainer's own arguments of a job's command (`-m prime_trainer...` or `trainer_gpu.py --profile ... --`)."""
    return cmd[cmd.index("--") + 1 :] if "--profile" in cmd else cmd[3:]


def test_every_suite_job_parses_and_asks_for_what_its_name_says(bench, suite, tmp_path):
    host = bench.Host(gpu_total_gib=80.0, pythonpath="/tmp/liger")
    configs = {}
    for job, _ in suite.suite_jobs("onegpu", tiny=False):
        cmd, env = bench.job_spec(job, tmp_path, host)
        if job.startswith("base"):
            args = load("baseline_hf").parse_args(cmd[2:])
            assert args.liger and args.ac and args.device == "cuda" and args.seq_len in (16384, 65536)
            assert env["PYTHONPATH"] == "/tmp/liger"
            continue
        configs[job] = load_config(TrainerConfig, trainer_argv(cmd))
    c = configs["profile16k_auto_cap12.5"]
    assert c.parallel.ac == "auto" and c.gpu_memory_fraction == pytest.approx(12.5 / 80, abs=1e-6)
    assert c.data.fake.seq_len == 16384 and c.bench and c.device == "auto"
    assert configs["profile64k_auto"].data.fake.seq_len == 65536 and configs["profile64k_auto"].parallel.ac == "auto"
    one, eight = configs["rl2k_auto_b64_m1_var_s3"], configs["rl2k_auto_b64_m8_var_s3"]
    assert (one.data.fake.batch_size, one.data.fake.micro_batch_size, eight.data.fake.micro_batch_size) == (64, 1, 8)
    assert one.data.fake.variable_lengths and one.max_steps == 3 and one.seq_len == 2048
    assert configs["rl2k_auto_b16_m1_var_s3_fsdp"].parallel.fsdp_one_rank
    assert bench.job_spec("rl2k_auto_b64_m1_var_s3_nocompile", tmp_path, host)[1] == {"PRIME_COMPILE_ELEMENTWISE": "0"}
    assert not one.parallel.fsdp_one_rank and not one.parallel.compile_layers
    assert configs["rl2k_auto_b64_m1_var_s3_compilelayers"].parallel.compile_layers
    assert not one.parallel.cuda_graphs and configs["rl2k_auto_b64_m1_var_s3_cudagraphs"].parallel.cuda_graphs
    both = configs["rl2k_auto_b64_m1_var_s3_cudagraphs_compilelayers"].parallel
    assert both.cuda_graphs and both.compile_layers
    assert configs["rl16k_s4"].parallel.ac == "full" and configs["rl16k_s4"].max_steps == 4
    fa4 = load_config(TrainerConfig, trainer_argv(bench.job_spec("rl64k_auto_cap16_fa4", tmp_path, host)[0]))
    assert fa4.init.attn == "flash_attn4" and fa4.gpu_memory_fraction == pytest.approx(16 / 80, abs=1e-6)
    # The CPU smoke: tiny rows, baselines without liger-kernel.
    tiny = bench.Host(model=suite.tiny_model(tmp_path), device="cpu", tokens_per_k=4)
    jobs = [job for job, _ in suite.suite_jobs("onegpu", tiny=True)]
    assert "base16k_ac" in jobs and not any("liger" in j or "fa4" in j for j in jobs)
    capped = configs["profile64k_auto_cap16"]
    assert capped.parallel.ac == "auto" and capped.gpu_memory_fraction == pytest.approx(16 / 80, abs=1e-6)
    assert configs["rl64k_noac_fa4"].init.attn == "flash_attn4" and configs["rl64k_noac_fa4"].parallel.ac == "none"
    cfg = load_config(TrainerConfig, trainer_argv(bench.job_spec("profile64k_auto", tmp_path, tiny)[0]))
    assert cfg.device == "cpu" and cfg.data.fake.seq_len == 256 and cfg.gpu_memory_fraction is None


def test_records_carry_device_commit_vocabulary_baseline_and_targets(suite, tmp_path):
    def job(tps: float, gib: float, **kw) -> dict:
        return {"rc": 0, "tokens_per_s": tps, "peak_memory_gib": gib, "device_name": "H100", **kw}

    results = {
        "profile16k_auto": job(50000, 30.0, memory_plan="no activation checkpointing", profile={"by_kind_s": {}}),
        "profile16k_auto_cap12.5": job(44000, 12.0),
        "profile64k_auto": job(20500, 15.5),
        "base16k_liger_ac": job(24000, 10.3, status="ok"),
        "rl2k_auto_b64_m8_var_s3": job(60000, 34.0),
        "rl2k_auto_b64_m1_var_s3": job(56000, 14.0),
    }
    meta = {"device": "H100", "commit": "abc1234", "vocab_size": 151936}
    summary = json.loads(suite.write_records("onegpu", False, results, tmp_path, meta).read_text())
    assert summary["commit"] == "abc1234" and summary["vocab_size"] == 151936
    assert summary["targets"]["profile16k_auto_cap12.5"]["met"] is False  # 44k < 45k
    assert summary["targets"]["profile64k_auto"]["met"] is True
    assert summary["targets"]["loop_one_row_vs_eight"] == {"ratio": 56000 / 60000, "target": 0.9, "met": True}
    rec = json.loads((tmp_path / "records/trainer_gpu_onegpu_profile16k_auto.json").read_text())
    assert rec["baseline"]["job"] == "base16k_liger_ac" and rec["ratio_to_baseline"] == pytest.approx(50000 / 24000)
    assert rec["device"] == "H100" and rec["memory_plan"] == "no activation checkpointing" and "profile" in rec
    missing = json.loads((tmp_path / "records/trainer_gpu_onegpu_rl16k_s4.json").read_text())
    assert missing["status"] == "not run" and missing["baseline"]["job"] == "base16k_liger_ac"
    assert json.loads((tmp_path / "records/trainer_gpu_onegpu_profile64k_auto.json").read_text())["baseline"] == {
        "job": None,
        "status": "not run in this call",
    }


def test_liger_kernel_without_a_wheel_is_named_not_fatal(suite, tmp_path):
    path, how = suite.liger_path(tmp_path, tmp_path)
    if how != "installed":  # this workspace has no liger-kernel; a GPU host may
        assert path == "" and how.startswith("missing: no liger_kernel-*.whl in")
        assert "pip download liger-kernel==0.8.5 --no-deps -d .whl" in how


def test_the_command_line_names_what_is_missing():
    script = str(ROOT / "benchmarks/trainer_gpu.py")
    out = subprocess.run([sys.executable, script, "--suite", "onegpu"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--out is required" in out.stderr
    out = subprocess.run([sys.executable, script, "--suite", "nope", "--out", "/tmp/x"], capture_output=True, text=True)
    assert out.returncode != 0 and "known suites ['onegpu']" in out.stderr


@pytest.mark.slow
def test_tiny_suite_jobs_run_on_cpu(bench, suite, tmp_path):
    host = bench.Host(model=suite.tiny_model(tmp_path), device="cpu", tokens_per_k=4)
    jobs = ["profile16k_auto", "rl2k_auto_b16_m1_var_s3_fsdp", "base16k_ac"]
    results = bench.run_jobs(jobs, tmp_path / "out", 900, host)
    for job in jobs:
        assert results[job]["rc"] == 0, results[job].get("log_tail")
        assert results[job]["tokens_per_s"] > 0
    assert results["profile16k_auto"]["profile"]["by_kind_s"]
    assert results["profile16k_auto"]["memory_plan"] == "no activation checkpointing"
    assert results["rl2k_auto_b16_m1_var_s3_fsdp"]["one_rank_path"] == "fsdp"
    assert Path(tmp_path / "out/profile16k_auto.txt").read_text().startswith("step wall")
