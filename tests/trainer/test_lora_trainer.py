"""LoRA in the RL and SFT trainers: only adapters are published, resume is exact, FSDP matches one process."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from prime_core.io import is_stable
from prime_core.run_dir import WEIGHTS_RUN_FILE, RunDir
from prime_core.schemas.adapters import ADAPTER_CONFIG, ADAPTER_INFO, ADAPTER_WEIGHTS
from prime_core.schemas.weights import CHECKSUMS_FILE

from tests.trainer.trainer_utils import TINY_QWEN3, load_weights, read_trainer_metrics, run_cli, write_rollouts

pytestmark = [pytest.mark.integration, pytest.mark.xdist_group("multiprocess")]

COMMON = ["--seq-len", "32", "--optim.lr", "1e-2", "--seed", "3", "--async-level", "1", "--log.level", "warning"]
LORA = ["--model.lora.rank", "4", "--model.lora.alpha", "8"]


def save_base(path):
    """Real (random) base weights on disk: LoRA publishes adapters for inference's copy of this base."""
    from prime_models import load_model, save_hf

    save_hf(load_model(dict(TINY_QWEN3), seed=0), path)
    return path


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_base(tmp_path_factory.mktemp("lora-base"))


def args(base, out, max_steps, *extra):
    return ["--model.name", str(base), "--output-dir", str(out), "--max-steps", str(max_steps), *COMMON, *LORA, *extra]


def adapter(path) -> dict:
    return load_weights(path)


def test_rl_lora_publishes_adapters_resumes_exactly_and_two_process_fsdp_equals_one_process(base_dir, tmp_path):
    """Only the adapters are published and checkpointed, a resumed run equals an uninterrupted one, and FSDP over 2
    processes equals 1 process (steps 0-1, adapters of step 2). One test: the 1-process side of the FSDP check is the
    first part of the resumed run (its step-2 adapters are kept as its checkpoint's window), which spares a trainer
    start of its own."""
    straight, resumed, two = tmp_path / "straight", tmp_path / "resumed", tmp_path / "two"
    for out in (straight, resumed):
        write_rollouts(out, steps=4, num_ranks=1)
    write_rollouts(two, steps=2, num_ranks=2)  # the same global batches as the first 2 steps above
    run_cli(args(base_dir, straight, 4, "--model.lora.name", "tenant-a"))
    run_cli(args(base_dir, resumed, 3, "--model.lora.name", "tenant-a", "--ckpt.interval", "2"))
    m1, w1 = read_trainer_metrics(resumed), adapter(RunDir(resumed).weight_step(2))
    run_cli(args(base_dir, two, 2, "--model.lora.name", "tenant-a", "--ckpt.interval", "2"), nproc=2)
    run_cli(args(base_dir, resumed, 4, "--model.lora.name", "tenant-a", "--ckpt.resume-step", "2"))

    rd = RunDir(straight)
    assert rd.stable_weight_steps() == [3, 4]
    step4 = rd.weight_step(4)
    assert sorted(p.name for p in step4.iterdir()) == sorted(
        [ADAPTER_CONFIG, ADAPTER_WEIGHTS, ADAPTER_INFO, WEIGHTS_RUN_FILE, CHECKSUMS_FILE, "STABLE"]
    )
    info = json.loads((step4 / ADAPTER_INFO).read_text())
    assert info == {"name": "tenant-a", "step": 4, "base_model": str(base_dir)}
    cfg = json.loads((step4 / ADAPTER_CONFIG).read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (4, 8.0, "LORA")
    tensors = adapter(step4)
    # 2 layers x 7 projections x (A, B), nothing else.
    assert len(tensors) == 28 and all(".lora_A." in k or ".lora_B." in k for k in tensors)
    assert any(v.abs().sum() > 0 for k, v in tensors.items() if ".lora_B." in k)

    # The checkpoint holds the adapters and their optimizer state, not the frozen base.
    saved = dcp.FileSystemReader(str(RunDir(resumed).trainer_checkpoint(2))).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    assert len(model_keys) == 28 and all(".lora_A." in k or ".lora_B." in k for k in model_keys)
    a, b = read_trainer_metrics(straight), read_trainer_metrics(resumed)
    assert [a[s]["loss/mean"] for s in range(4)] == [b[s]["loss/mean"] for s in range(4)]
    wb = adapter(RunDir(resumed).weight_step(4))
    assert all(torch.equal(tensors[k], wb[k]) for k in tensors)

    m2, w2 = read_trainer_metrics(two), adapter(RunDir(two).weight_step(2))
    for step in (0, 1):
        for key in ("loss/mean", "grad_norm"):
            assert m2[step][key] == pytest.approx(m1[step][key], abs=1e-6, rel=1e-6), (step, key)
    assert w1.keys() == w2.keys()
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-6
    assert is_stable(RunDir(two).trainer_checkpoint(2))


def test_sft_lora_publishes_only_the_adapter(base_dir, tmp_path):
    run_cli(
        [*args(base_dir, tmp_path, 2), "--data.fake.batch-size", "2"],
        module="prime_trainer.entrypoints.sft",
    )
    final = RunDir(tmp_path).weight_step(2)
    assert is_stable(final) and not list(final.glob("model*.safetensors"))
    assert json.loads((final / ADAPTER_INFO).read_text())["name"] == "r4-a8"
