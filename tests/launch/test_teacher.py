"""The distillation teacher rl starts from ``[teacher]``: one more inference process with its own devices, port, log,
run subdirectory and frozen weights; every distilling env without a teacher URL is pointed at it, and nothing that
sends weights ever is."""

from pathlib import Path

import pytest
from prime_core.config import load_config
from prime_core.config.rl import RLConfig
from prime_launch.host import ClusterFacts, HostFacts
from prime_launch.resolver import resolve
from prime_launch.watchdog import progress_files

BIN = {name: f"/venv/bin/{name}" for name in ("inference", "orchestrator", "trainer", "torchrun")}
ENV = '[{"id": "reverse-text", "distill": {}}, {"id": "arithmetic"}]'


def facts(*gpus: int, cores: int = 8) -> HostFacts:
    return HostFacts(gpus=gpus, cores=cores, executables=BIN, run_id="r1")


def rl(*args: str, env: str = ENV, cpu: bool = False) -> RLConfig:
    base = ["--output-dir", "/data/exp", "--orchestrator.env", env, "--model.name", "Qwen/Qwen3-0.6B"]
    base += ["--trainer.device", "cpu", "--inference.engine", "torch"] if cpu else ["--inference.engine", "auto"]
    return load_config(RLConfig, [*base, *args])


def test_cpu_teacher_is_a_fourth_process_the_distilling_env_scores_with():
    cfg = rl("--teacher.model.name", "/models/teacher", cpu=True, env=ENV)
    plan = resolve(cfg, facts(cores=4))
    assert list(plan.configs) == ["inference", "teacher", "orchestrator", "trainer"]
    spec = next(s for s in plan.specs if s.name == "teacher")
    assert spec.cmd[:3] == [BIN["inference"], "@", "/data/exp/configs/teacher.toml"]
    assert spec.log_file == Path("/data/exp/logs/teacher.log")
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "" and spec.env["OMP_NUM_THREADS"] == "1"
    teacher = plan.configs["teacher"]
    assert teacher.engine == "torch" and teacher.model.name == "/models/teacher" and teacher.server.port == 8001
    assert teacher.server.frozen and teacher.output_dir == Path("/data/exp/teacher")
    assert plan.teacher_health_url == "http://127.0.0.1:8001/health"
    assert plan.devices["teacher"] == "CPU (torch engine), 1 thread"
    orch = plan.configs["orchestrator"]
    distilling, plain = orch.env
    assert distilling.distill.teacher.base_url == "http://127.0.0.1:8001"
    assert distilling.distill.teacher.model == "/models/teacher"
    assert distilling.distill.teacher.health_timeout == cfg.health_timeout  # it loads while the orchestrator starts
    assert plain.distill is None
    # Weights go to the policy's server only: the orchestrator relays to its client URLs, the launcher probes them.
    assert orch.client.base_urls == ["http://127.0.0.1:8000"] and plan.health_urls == ["http://127.0.0.1:8000/health"]
    # Its heartbeat is an inference process's, in its own run subdirectory (not the policy server's file).
    assert progress_files(plan)["teacher"] == [Path("/data/exp/teacher/progress/inference.json")]


def test_self_distillation_serves_the_students_initial_weights():
    env = '[{"id": "reverse-text", "distill": {"privileged_prompt": "<|im_start|>system\\nhint<|im_end|>\\n"}}]'
    plan = resolve(rl("--teacher.engine", "torch", cpu=True, env=env), facts())
    assert plan.configs["teacher"].model.name == "Qwen/Qwen3-0.6B"
    assert plan.configs["orchestrator"].env[0].distill.teacher.model == "Qwen/Qwen3-0.6B"
    # A LoRA student: the teacher is its frozen base, never an adapter.
    lora = resolve(rl("--teacher.engine", "torch", "--model.lora.rank", "8", cpu=True, env=env), facts())
    assert lora.configs["teacher"].model.lora is None


def test_teacher_gpus_follow_inference_and_trainer():
    plan = resolve(rl("--teacher.model.name", "/models/t", "--teacher.num-gpus", "2"), facts(0, 1, 2, 3))
    spec = {s.name: s for s in plan.specs}
    assert spec["inference"].env["CUDA_VISIBLE_DEVICES"] == "0" and spec["trainer"].env["CUDA_VISIBLE_DEVICES"] == "1"
    assert spec["teacher"].env["CUDA_VISIBLE_DEVICES"] == "2,3" and plan.devices["teacher"] == "GPU 2,3"
    assert plan.configs["teacher"].vllm.data_parallel_size == 2
    # The trainer's broadcast counts the policy's workers only.
    assert plan.configs["trainer"].weights.broadcast.inference_workers == 1
    with pytest.raises(ValueError, match=r"teacher.num_gpus \(1\): only 0 GPU\(s\) left.*teacher.gpu_ids"):
        resolve(rl("--teacher.model.name", "/models/t"), facts(0, 1))
    with pytest.raises(ValueError, match=r"teacher.gpu_ids shares GPU \[0\].*gpu_memory_utilization"):
        resolve(rl("--teacher.model.name", "/models/t", "--teacher.gpu-ids", "[0]"), facts(0))
    one_gpu = ("--teacher.model.name", "/models/t", "--teacher.gpu-ids", "[0]",
               "--teacher.vllm.gpu-memory-utilization", "0.15")  # fmt: skip
    # One GPU, colocated: vLLM 0.45 and the trainer's default cap of what vLLM leaves (0.55) leave the teacher nothing.
    with pytest.raises(ValueError, match=r"GPU 0 is over-committed \(teacher.vllm.gpu_memory_utilization 0.15 \+ "
                       r"devices.inference_memory_fraction 0.45 \+ devices.trainer_memory_fraction 0.55 > 1\)"):  # fmt: skip
        resolve(rl(*one_gpu), facts(0))
    plan = resolve(rl(*one_gpu, "--devices.trainer-memory-fraction", "0.4"), facts(0))
    assert {s.name: s.env["CUDA_VISIBLE_DEVICES"] for s in plan.specs if s.name != "orchestrator"} == {
        "inference": "0", "teacher": "0", "trainer": "0"
    }  # fmt: skip
    assert plan.configs["teacher"].vllm.gpu_memory_utilization == 0.15
    # Beside a policy server on a GPU of its own: the two vLLM shares; never on the uncapped trainer's GPU.
    two = ("--teacher.model.name", "/models/t", "--teacher.vllm.gpu-memory-utilization", "0.3")
    with pytest.raises(ValueError, match=r"inference.vllm.gpu_memory_utilization 0.9 > 1"):
        resolve(rl(*two, "--teacher.gpu-ids", "[0]"), facts(0, 1))
    plan = resolve(rl(*two, "--teacher.gpu-ids", "[0]", "--inference.vllm.gpu-memory-utilization", "0.6"), facts(0, 1))
    assert plan.devices["teacher"] == "GPU 0 shared, vLLM 0.3 of its memory" and plan.teacher_after_inference
    with pytest.raises(ValueError, match="GPU 1 is the trainer's, which takes its memory uncapped"):
        resolve(rl(*two, "--teacher.gpu-ids", "[1]"), facts(0, 1))


def test_teacher_mistakes_are_one_line():
    with pytest.raises(ValueError, match=r"orchestrator.env.0.distill.teacher.base_url is unset: add a \[teacher\]"):
        rl(cpu=True)
    with pytest.raises(ValueError, match=r"\[teacher\] is set but no env distills"):
        rl("--teacher.engine", "torch", cpu=True, env='[{"id": "arithmetic"}]')
    with pytest.raises(ValueError, match="teacher.port \\(8000\\) is the inference server's port"):
        rl("--teacher.port", "8000", cpu=True)
    with pytest.raises(ValueError, match="teacher.engine = vllm needs a GPU"):
        resolve(rl("--teacher.engine", "vllm", cpu=True), facts())
    cluster = ClusterFacts(Path("/data/exp"), 1, 1, gpus_per_node=8, procs_per_node=8, inference_port=8000)
    with pytest.raises(ValueError, match=r"\[teacher\] starts on one node only"):
        resolve(rl("--teacher.model.name", "/models/t"), cluster)


def test_env_with_its_own_teacher_url_keeps_it():
    env = (
        '[{"id": "a", "distill": {"teacher": {"base_url": "http://h:9/v1", "model": "m"}}}, {"id": "b", "distill": {}}]'
    )
    plan = resolve(rl("--teacher.engine", "torch", cpu=True, env=env), facts())
    a, b = plan.configs["orchestrator"].env
    assert (a.distill.teacher.base_url, a.distill.teacher.model) == ("http://h:9", "m")
    assert b.distill.teacher.base_url == "http://127.0.0.1:8001"
    # Without [teacher] an env with its own URL needs nothing started.
    alone = resolve(rl(cpu=True, env=env.replace(', {"id": "b", "distill": {}}', "")), facts())
    assert "teacher" not in alone.configs and alone.teacher_health_url is None


def test_runs_envs_are_pointed_at_the_teacher_too():
    runs = '[{"name": "x", "env": [{"id": "reverse-text", "distill": {}}]}, {"name": "y"}]'
    cfg = rl("--teacher.engine", "torch", "--runs", runs, "--model.lora.rank", "8", cpu=True)
    plan = resolve(cfg, facts())
    for name in ("orchestrator-x", "orchestrator-y"):
        assert plan.configs[name].env[0].distill.teacher.base_url == "http://127.0.0.1:8001"
