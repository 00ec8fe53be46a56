"""A checkpoint's progress.json that prime did not write as it is (edited, another tool's, a shared checkpoint): the
parse-time resume check names what it records instead of raising out of the CLI with a traceback."""

import json

import pytest
from prime_core.config.shared import LoRAConfig
from prime_core.preflight import check_resume_step
from prime_core.run_dir import RunDir

LORA = LoRAConfig(rank=8, alpha=16.0)


def _checkpoint(tmp_path, lora_record):
    path = RunDir(tmp_path).trainer_checkpoint(1)
    path.mkdir(parents=True)
    (path / "STABLE").write_text("0\n")
    progress = {"step": 1, "world_size": 1, "process": "trainer", "lora": lora_record}
    (path / "progress.json").write_text(json.dumps(progress))


@pytest.mark.parametrize("lora", [None, LORA], ids=["run_without_lora", "run_with_lora"])
def test_a_lora_record_that_is_not_an_object_is_named(tmp_path, lora):
    _checkpoint(tmp_path, "r8")
    why = check_resume_step(tmp_path, 1, "trainer", lora)
    assert why == (f"checkpoint step 1 in {tmp_path} records model.lora as 'r8', which is not a LoRA record "
                   "(progress.json edited, or not prime's?): resume with the checkpoint's LoRA settings, or start "
                   "afresh in another --output-dir")  # fmt: skip


def test_a_lora_record_with_the_same_settings_and_a_key_more_is_named(tmp_path):
    record = {"rank": 8, "alpha": 16.0, "target_modules": sorted(LORA.target_modules), "dora": True}
    _checkpoint(tmp_path, record)
    why = check_resume_step(tmp_path, 1, "trainer", LORA)
    assert why is not None and why.startswith(f"checkpoint step 1 in {tmp_path} records model.lora as {record!r}")
