"""One-GPU runs: inference and trainer colocated on GPU 0, memory shares, the fit check, weights through the GPU's
memory (CUDA IPC) on one GPU and by files over several."""

import io
import json
import struct
from pathlib import Path

import pytest
from prime_core.config import ConfigError, load_config
from prime_core.config.rl import RLConfig
from prime_launch.colocate import activation_bytes, config_params, gpu_memory_of
from prime_launch.host import count_params, gpu_memory, safetensors_params
from prime_launch.launcher import dry_run, resolve_here

ONE_GPU = {"CUDA_VISIBLE_DEVICES": "0", "PATH": "/usr/bin"}
TWO_GPUS = {"CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/usr/bin"}
# Qwen3-0.6B's shape: 596M parameters, ~10 GiB of trainer states at 18 bytes each, and ~3 GiB of activations for a
# micro-batch of one 2048-token row without activation checkpointing.
QWEN3_06B = {
    "model_type": "qwen3",
    "hidden_size": 1024,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 3072,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "qwen3-0.6b-shape"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(QWEN3_06B))
    return path


def rl_config(model_dir: Path, tmp_path: Path, *args: str, broadcast: str | None = "nccl") -> RLConfig:
    base = ["--model.name", str(model_dir), "--output-dir", str(tmp_path / "out"), "--inference.engine", "vllm"]
    transport = ["--trainer.weights.broadcast.type", broadcast] if broadcast is not None else []
    return load_config(RLConfig, [*base, *transport, *args])


def envs(plan) -> dict[str, dict[str, str]]:
    return {spec.name: spec.env for spec in plan.specs}


def test_one_visible_gpu_colocates_with_memory_shares_and_ipc_weights(model_dir, tmp_path):
    cfg = rl_config(model_dir, tmp_path, "--devices.gpu-memory-gib", "80")
    plan = resolve_here(cfg, ONE_GPU, cores=4)
    env = envs(plan)
    assert env["inference"]["CUDA_VISIBLE_DEVICES"] == env["trainer"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["orchestrator"]["CUDA_VISIBLE_DEVICES"] == ""
    inference, trainer, orchestrator = (plan.configs[n] for n in ("inference", "trainer", "orchestrator"))
    assert inference.vllm.gpu_memory_utilization == 0.45 and trainer.gpu_memory_fraction == 0.55
    # nccl cannot hold two ranks on one GPU: the weights go through its memory instead, every step relayed.
    assert trainer.weights.broadcast.type == "cuda_ipc" and orchestrator.weights_broadcast
    assert trainer.weights.broadcast.inference_workers == 1
    assert trainer.device == "cuda"
    assert plan.devices["inference"] == "GPU 0 shared, vLLM 0.45 of its memory (36.0 of 80.0 GiB)"
    assert plan.devices["trainer"] == "GPU 0 shared, 0.55 of its memory (44.0 of 80.0 GiB; needs ~12.2 GiB)"
    assert "weights: through the GPU's memory (CUDA IPC handles, no files), as an NCCL broadcast cannot hold " in (
        "\n".join(plan.notes)
    )
    assert not any("gpu_memory_utilization" in note for note in plan.notes)  # the default was not the user's


def test_cuda_ipc_is_the_default_on_one_gpu_and_a_users_files_stay(model_dir, tmp_path):
    more = ["--devices.gpu-memory-gib", "80"]
    plan = resolve_here(rl_config(model_dir, tmp_path, *more, broadcast=None), ONE_GPU, cores=4)
    assert (
        plan.configs["trainer"].weights.broadcast.type == "cuda_ipc" and plan.configs["orchestrator"].weights_broadcast
    )
    assert any(note.endswith("(CUDA IPC handles, no files), as they share it") for note in plan.notes)
    plan = resolve_here(rl_config(model_dir, tmp_path, *more, broadcast="filesystem"), ONE_GPU, cores=4)
    assert plan.configs["trainer"].weights.broadcast.type == "filesystem"
    assert not plan.configs["orchestrator"].weights_broadcast and not any("weights:" in n for n in plan.notes)


def test_a_lora_run_on_vllm_keeps_adapters_on_files_and_refuses_cuda_ipc(model_dir, tmp_path):
    """vLLM does not take adapters over CUDA IPC yet (tests/inference/test_weight_transports_gpu.py)."""
    more = ["--devices.gpu-memory-gib", "80", "--model.lora.rank", "8"]
    plan = resolve_here(rl_config(model_dir, tmp_path, *more, broadcast=None), ONE_GPU, cores=4)
    assert plan.configs["trainer"].weights.broadcast.type == "filesystem"
    with pytest.raises(ValueError, match="adapters over CUDA IPC are not supported by vLLM"):
        resolve_here(rl_config(model_dir, tmp_path, *more, broadcast="cuda_ipc"), ONE_GPU, cores=4)


def test_cuda_ipc_keeps_weights_on_the_shared_gpu(model_dir, tmp_path):
    """cuda_ipc is the one-time transport that works on a shared GPU: kept, its workers counted, every step relayed."""
    cfg = rl_config(model_dir, tmp_path, "--devices.gpu-memory-gib", "80", broadcast="cuda_ipc")
    plan = resolve_here(cfg, ONE_GPU, cores=4)
    trainer, orchestrator = plan.configs["trainer"], plan.configs["orchestrator"]
    assert trainer.weights.broadcast.type == "cuda_ipc" and trainer.weights.broadcast.inference_workers == 1
    assert orchestrator.weights_broadcast
    assert not any("weights: by files" in note for note in plan.notes)


def test_colocated_fraction_replaces_a_configured_one_with_a_note(model_dir, tmp_path):
    cfg = rl_config(
        model_dir,
        tmp_path,
        "--inference.vllm.gpu-memory-utilization",
        "0.85",
        "--devices.inference-memory-fraction",
        "0.3",
        "--devices.trainer-memory-fraction",
        "0.6",
        "--devices.gpu-memory-gib",
        "40",
    )
    plan = resolve_here(cfg, ONE_GPU, cores=4)
    assert plan.configs["inference"].vllm.gpu_memory_utilization == 0.3
    assert "gpu_memory_utilization 0.3 instead of 0.85" in " ".join(plan.notes)
    assert "0.6 of its memory (24.0 of 40.0 GiB" in plan.devices["trainer"]


def test_too_big_a_model_is_a_one_line_error_naming_the_fields(model_dir, tmp_path):
    cfg = rl_config(model_dir, tmp_path, "--devices.gpu-memory-gib", "16")
    with pytest.raises(ValueError, match="does not fit beside vLLM on GPU 0") as err:
        resolve_here(cfg, ONE_GPU, cores=4)
    message = str(err.value)
    assert "\n" not in message
    assert "596.0M parameters x 18 bytes" in message and "gets 8.8 GiB of 16.0 GiB" in message
    for name in ("devices.inference_memory_fraction", "devices.trainer_memory_fraction", "trainer_memory_margin"):
        assert name in message
    # A LoRA keeps no gradients or Adam moments for the base: 6 bytes per parameter fit.
    lora = rl_config(
        model_dir, tmp_path, "--devices.gpu-memory-gib", "16", "--model.lora.rank", "8", broadcast="filesystem"
    )
    assert "needs ~5.5 GiB" in resolve_here(lora, ONE_GPU, cores=4).devices["trainer"]


def test_micro_batch_activations_count_in_the_fit(model_dir, tmp_path):
    # 8 rows of 2048 tokens per forward (the GPU configs' setting): ~23.6 GiB of activations without checkpointing;
    # one H100 measured a 34.5 GiB peak for this shape, the estimate says 35.6 with the 2 GiB margin.
    rows8 = ("--orchestrator.micro-batch-rows", "8")
    none = ("--trainer.parallel.ac", "none")
    plan = resolve_here(
        rl_config(model_dir, tmp_path, *rows8, *none, "--devices.gpu-memory-gib", "80"), ONE_GPU, cores=4
    )
    assert "needs ~35.6 GiB" in plan.devices["trainer"]
    with pytest.raises(ValueError, match="23.6 GiB of activations for 16384 tokens a micro-batch") as err:
        resolve_here(rl_config(model_dir, tmp_path, *rows8, *none, "--devices.gpu-memory-gib", "48"), ONE_GPU, cores=4)
    assert "lower orchestrator.micro_batch_rows or set trainer.parallel.ac" in str(err.value)
    # Full checkpointing keeps a layer's input per layer (plus one layer being recomputed): it fits on 48 GB. So does
    # the default, `auto`, which the fit check counts as full (the trainer checkpoints as much as its share needs).
    full = rl_config(model_dir, tmp_path, *rows8, "--trainer.parallel.ac", "full", "--devices.gpu-memory-gib", "48")
    assert "needs ~13.7 GiB" in resolve_here(full, ONE_GPU, cores=4).devices["trainer"]
    auto = rl_config(model_dir, tmp_path, *rows8, "--devices.gpu-memory-gib", "48")
    assert "needs ~13.7 GiB" in resolve_here(auto, ONE_GPU, cores=4).devices["trainer"]


def test_activation_estimate_by_checkpointing_and_moe(model_dir, tmp_path):
    def estimate(config: dict, *args: str) -> float:
        trainer = rl_config(model_dir, tmp_path, *args).trainer
        return activation_bytes(config, trainer, 1000) / 1000

    none, full = (
        estimate(QWEN3_06B, "--trainer.parallel.ac", "none"),
        estimate(QWEN3_06B, "--trainer.parallel.ac", "full"),
    )
    assert estimate(QWEN3_06B) == full  # auto
    assert none == 28 * 2 * (12 * 1024 + 5 * 3072)
    assert full == 28 * 2 * 1024 + none / 28
    half = estimate(QWEN3_06B, "--trainer.parallel.ac", "selective", "--trainer.parallel.ac-every", "2")
    assert full < half < none
    # An MoE keeps its routed experts' width (top-k x expert width), not every expert's.
    moe = {**QWEN3_06B, "num_experts": 64, "num_experts_per_tok": 4, "moe_intermediate_size": 768}
    assert estimate(moe, "--trainer.parallel.ac", "none") == none
    assert estimate({"text_config": QWEN3_06B}, "--trainer.parallel.ac", "none") == none  # a VLM's text decoder


def test_vllm_share_must_hold_the_weights(model_dir, tmp_path):
    cfg = rl_config(
        model_dir, tmp_path, "--devices.gpu-memory-gib", "80", "--devices.inference-memory-fraction", "0.01"
    )
    with pytest.raises(ValueError, match=r"devices.inference_memory_fraction 0.01 = 0.8 GiB\) cannot hold"):
        resolve_here(cfg, ONE_GPU, cores=4)


def test_memory_unknown_or_model_unsized_leaves_a_note(model_dir, tmp_path):
    plan = resolve_here(rl_config(model_dir, tmp_path), ONE_GPU, cores=4)  # no nvidia-smi on PATH
    assert plan.devices["trainer"] == "GPU 0 shared, 0.55 of its memory (needs ~12.2 GiB)"
    assert any("set devices.gpu_memory_gib" in note for note in plan.notes)
    missing = rl_config(tmp_path / "nowhere", tmp_path, "--devices.gpu-memory-gib", "80")
    plan = resolve_here(missing, {**ONE_GPU, "HF_HUB_CACHE": str(tmp_path / "cache")}, cores=4)
    assert any("no weights or config.json" in note for note in plan.notes)


def test_two_gpus_keep_their_own_roles(model_dir, tmp_path):
    cfg = rl_config(model_dir, tmp_path, "--inference.vllm.gpu-memory-utilization", "0.85")
    plan = resolve_here(cfg, TWO_GPUS, cores=4)
    env = envs(plan)
    assert env["inference"]["CUDA_VISIBLE_DEVICES"] == "0" and env["trainer"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert plan.devices["inference"] == "GPU 0" and plan.devices["trainer"] == "GPU 1"
    assert plan.configs["inference"].vllm.gpu_memory_utilization == 0.85
    assert plan.configs["trainer"].weights.broadcast.type == "nccl" and plan.configs["orchestrator"].weights_broadcast
    assert plan.notes == []


def test_colocate_on_request_shares_every_gpu(model_dir, tmp_path):
    cfg = rl_config(
        model_dir, tmp_path, "--devices.colocate", "true", "--devices.num-inference-gpus", "2",
        "--devices.num-trainer-gpus", "2", "--devices.gpu-memory-gib", "80",
    )  # fmt: skip
    plan = resolve_here(cfg, TWO_GPUS, cores=4)
    env = envs(plan)
    assert env["inference"]["CUDA_VISIBLE_DEVICES"] == env["trainer"]["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert plan.configs["inference"].vllm.data_parallel_size == 2
    # Several shared GPUs: CUDA IPC would reach only GPU 0's worker, NCCL none: weights by files.
    assert plan.configs["trainer"].weights.broadcast.type == "filesystem"
    assert any(note.startswith("weights: by files") for note in plan.notes)
    assert "needs ~7.2 GiB" in plan.devices["trainer"]  # states sharded over the 2 ranks
    trainer_cmd = next(spec.cmd for spec in plan.specs if spec.name == "trainer")
    assert trainer_cmd[trainer_cmd.index("--nproc-per-node") + 1] == "2"
    with pytest.raises(ValueError, match="devices.colocate: 1 inference and 3 trainer GPUs"):
        resolve_here(rl_config(model_dir, tmp_path, "--devices.colocate", "true", "--devices.num-trainer-gpus", "3"),
                   TWO_GPUS)  # fmt: skip


def test_colocate_false_on_one_gpu_is_the_old_error(model_dir, tmp_path):
    cfg = rl_config(model_dir, tmp_path, "--devices.colocate", "false")
    with pytest.raises(ValueError, match="only 1 available .*devices.colocate = true"):
        resolve_here(cfg, ONE_GPU)


def test_without_an_inference_server_the_trainer_has_the_gpu(model_dir, tmp_path):
    cfg = load_config(
        RLConfig, ["--model.name", str(model_dir), "--orchestrator.client.base-urls", "http://10.0.0.5:8000"]
    )
    plan = resolve_here(cfg, ONE_GPU, cores=4)
    assert plan.devices["trainer"] == "GPU 0" and plan.notes == []


def test_memory_shares_cannot_exceed_the_gpu():
    with pytest.raises(ConfigError, match="devices.trainer_memory_fraction .* exceed 1"):
        load_config(
            RLConfig, ["--devices.inference-memory-fraction", "0.5", "--devices.trainer-memory-fraction", "0.6"]
        )


def test_dry_run_shows_both_roles_on_gpu_0(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    # The model directory holds a shape only (no tokenizer): the orchestrator's own check would refuse it.
    monkeypatch.setattr("prime_launch.launcher.check_orchestrators", lambda specs: None)
    out = io.StringIO()
    dry_run(rl_config(model_dir, tmp_path, "--devices.gpu-memory-gib", "80"), out)
    text = out.getvalue()
    assert "(GPU 0 shared, vLLM 0.45 of its memory (36.0 of 80.0 GiB))" in text
    assert "(GPU 0 shared, 0.55 of its memory (44.0 of 80.0 GiB; needs ~12.2 GiB))" in text
    assert "note: weights: through the GPU's memory" in text


def test_parameter_counts(tmp_path, model_dir):
    assert config_params(QWEN3_06B) == 595_984_384  # Qwen3-0.6B has 596_049_920 with its norms
    header = {"a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}, "__metadata__": {"format": "pt"}}
    raw = json.dumps(header).encode()
    (model_dir / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(48))
    assert safetensors_params(model_dir) == 12
    cfg = load_config(RLConfig, ["--model.name", str(model_dir)])
    assert count_params(cfg.trainer, {}) == 12  # the weights' own count
    cfg = load_config(RLConfig, ["--model.name", str(model_dir), "--trainer.init.random", "true"])
    assert count_params(cfg.trainer, {}) == 595_984_384  # a random init is sized from config.json


def test_gpu_memory_from_nvidia_smi(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho '0, 81559'\necho '1, 24576'\n")
    smi.chmod(0o755)
    memory = gpu_memory({"PATH": str(tmp_path)})
    assert memory == {0: 81559 * 1024**2, 1: 24576 * 1024**2}
    assert gpu_memory_of([0], memory) == 81559 * 1024**2
    assert gpu_memory_of([7], memory) == 24576 * 1024**2  # unknown id: the smallest GPU
    assert gpu_memory({"PATH": str(tmp_path / "none")}) == {} and gpu_memory_of([0], {}) is None


def test_several_vllm_engines_on_one_gpu_take_the_weights_each_and_refuse_nccl(model_dir, tmp_path):
    """``inference.vllm.engines = 2``: both engines' workers take each step's tensors (the trainer waits for two),
    and an NCCL broadcast, which cannot hold two ranks on one GPU, is refused in one line."""
    more = ["--devices.gpu-memory-gib", "80", "--inference.vllm.engines", "2"]
    plan = resolve_here(rl_config(model_dir, tmp_path, *more, broadcast=None), ONE_GPU, cores=4)
    trainer = plan.configs["trainer"]
    assert trainer.weights.broadcast.type == "cuda_ipc" and trainer.weights.broadcast.inference_workers == 2
    assert plan.configs["inference"].vllm.engines == 2
    with pytest.raises(ValueError, match=r"engines = 2 puts several vLLM workers on one GPU.*cuda_ipc.*filesystem"):
        resolve_here(rl_config(model_dir, tmp_path, *more, broadcast="nccl"), TWO_GPUS, cores=4)
