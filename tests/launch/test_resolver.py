"""The run resolver: a pure function of the user's config and the host's facts; validators leave the sections as the
user gave them; what the user set is read once from the input; each derived value follows what it depends on."""

import tomllib
from pathlib import Path

import pytest
from prime_core.config import load_config
from prime_core.config.orchestrator import ClientConfig
from prime_core.config.rl import RLConfig
from prime_launch.host import ClusterFacts, HostFacts
from prime_launch.resolver import resolve

from tests.launch.launch_fakes import HERE
from tests.launch.test_slurm import render

BIN = {name: f"/venv/bin/{name}" for name in ("inference", "orchestrator", "trainer", "torchrun")}


def facts(*gpus: int, **more) -> HostFacts:
    return HostFacts(gpus=gpus, cores=8, executables=BIN, run_id="r1", **more)


def rl(*args: str, engine: str = "auto") -> RLConfig:
    return load_config(RLConfig, ["--output-dir", "/data/exp", "--inference.engine", engine, *args])


def test_resolve_reads_nothing_but_its_arguments(monkeypatch):
    def no_io(*args, **kwargs):
        raise AssertionError("the resolver touched the host")

    cfg = rl("--trainer.weights.broadcast.type", "nccl", "--resume", "--devices.colocate", "true")
    for target in ("subprocess.run", "subprocess.Popen", "shutil.which", "os.listdir", "builtins.open"):
        monkeypatch.setattr(target, no_io)
    monkeypatch.setattr(Path, "is_dir", no_io)
    monkeypatch.setattr(Path, "iterdir", no_io)
    resolved = resolve(cfg, facts(0, 1, checkpoint_steps=(2, 4)))
    monkeypatch.undo()
    assert resolved.resume_step == 4 and resolved.configs["trainer"].ckpt.resume_step == 4
    assert [s.cmd[0] for s in resolved.specs] == [BIN["inference"], BIN["orchestrator"], BIN["trainer"]]
    assert resolved.specs[1].cmd[-2:] == ["--client.server-run-id", "r1"]


def test_validators_leave_each_section_as_the_user_gave_it():
    cfg = rl(
        "--runs", '[{"name": "a"}, {"name": "b"}]', "--model.lora.rank", "8", "--inference.lora.max-cpu-loras", "9"
    )
    assert cfg.runs[0].output_dir is None and cfg.inference.lora.max_loras == 8
    tp2 = ("--inference.vllm.tensor-parallel-size", "2", "--devices.num-inference-gpus", "2")
    nccl = rl("--trainer.weights.broadcast.type", "nccl", *tp2)
    assert not nccl.orchestrator.weights_broadcast and nccl.trainer.weights.broadcast.inference_workers == 1
    resolved = resolve(nccl, facts(0, 1, 2))
    assert resolved.configs["orchestrator"].weights_broadcast
    assert resolved.configs["trainer"].weights.broadcast.inference_workers == 2  # tensor parallel over 2 GPUs


def test_broadcast_workers_follow_the_data_parallel_size_the_placement_chose():
    # Two inference GPUs at tensor parallel 1: vLLM runs data parallel 2, so two workers join the broadcast (the
    # validator used to count them before the launcher chose data parallelism: 1).
    cfg = rl("--trainer.weights.broadcast.type", "nccl", "--devices.num-inference-gpus", "2")
    resolved = resolve(cfg, facts(0, 1, 2))
    assert resolved.configs["inference"].vllm.data_parallel_size == 2
    assert resolved.configs["trainer"].weights.broadcast.inference_workers == 2
    # A count the user set is checked against it rather than replaced.
    wrong = rl("--trainer.weights.broadcast.type", "nccl", "--devices.num-inference-gpus", "2",
               "--trainer.weights.broadcast.inference-workers", "1")  # fmt: skip
    with pytest.raises(ValueError, match=r"inference_workers \(1\) != the inference servers' workers \(2"):
        resolve(wrong, facts(0, 1, 2))
    # Over SLURM nodes: every inference node's GPUs.
    cluster = ClusterFacts(Path("/data/exp"), 2, 1, gpus_per_node=4, procs_per_node=4, inference_port=8000)
    resolved = resolve(rl("--trainer.weights.broadcast.type", "nccl"), cluster)
    assert resolved.configs["trainer"].weights.broadcast.inference_workers == 8
    assert resolved.configs["orchestrator"].num_trainer_ranks == 4 and resolved.specs == []


def test_weight_relay_follows_the_trainers_final_transport():
    # Colocated on one GPU, the trainer's NCCL broadcast becomes CUDA IPC, a one-time transfer the orchestrator relays
    # every step; a user's files stay files, which it does not (derived once from the trainer's final transport,
    # where a validator used to set it and the plan to undo it).
    cfg = rl("--trainer.weights.broadcast.type", "nccl", engine="vllm")
    one_gpu = resolve(cfg, facts(0))
    assert one_gpu.configs["trainer"].weights.broadcast.type == "cuda_ipc"
    assert one_gpu.configs["orchestrator"].weights_broadcast
    files = resolve(rl("--trainer.weights.broadcast.type", "filesystem", engine="vllm"), facts(0))
    assert files.configs["trainer"].weights.broadcast.type == "filesystem"
    assert not files.configs["orchestrator"].weights_broadcast
    assert resolve(cfg, facts(0, 1)).configs["orchestrator"].weights_broadcast
    stale = rl("--orchestrator.weights-broadcast", "true")  # e.g. a resolved orchestrator.toml fed back
    assert not resolve(stale, facts()).configs["orchestrator"].weights_broadcast


def test_what_the_user_set_is_read_from_the_input_once():
    cfg = rl("--inference.vllm.gpu-memory-utilization", "0.9", "--devices.gpu-memory-gib", "80")
    assert cfg.user_set("inference.vllm.gpu_memory_utilization")
    assert not cfg.user_set("inference.vllm.tensor_parallel_size")
    assert cfg.user_set("trainer.output_dir")  # a shared field counts for every section it fills
    notes = resolve(cfg, facts(0)).notes
    assert any("gpu_memory_utilization 0.45 instead of 0.9" in n for n in notes)
    # The default 0.9 is not the user's: no note, although the resolved section (re-validated) marks it set.
    assert not any("instead of" in n for n in resolve(rl("--devices.gpu-memory-gib", "80"), facts(0)).notes)
    assert rl("--orchestrator.client.base-url", "http://h:1").base_urls_given and not cfg.base_urls_given


def test_user_input_reproduces_the_config():
    cfg = rl("@", str(HERE / "rl_example.toml"), "--orchestrator.client.base-url", "http://10.0.0.5:8000/v1")
    data = cfg.user_input()
    assert data["orchestrator"]["client"] == {"base_url": "http://10.0.0.5:8000/v1"}
    assert "weights_broadcast" not in data["orchestrator"]
    again = RLConfig.model_validate(data)
    assert again == cfg and again.base_urls_given


def test_derive_checks_field_names_and_revalidates():
    client = ClientConfig()
    assert client.derive(base_urls=["http://h:1/v1"]).base_urls == ["http://h:1"]
    with pytest.raises(TypeError, match="ClientConfig has no field base_ulrs"):
        client.derive(base_ulrs=["http://h:1"])
    with pytest.raises(ValueError, match="client.base_urls is empty"):
        client.derive(base_urls=[])


def test_one_node_slurm_job_resolves_the_users_port(tmp_path):
    # The job's rl.toml carries what the user set, nothing a validator wrote: the launcher on the node wires the
    # orchestrator to port 9000 (a base URL of the default port written into rl.toml used to make it refuse).
    result = render(tmp_path, "rl", "@", str(HERE / "rl_example.toml"), "--inference.server.port", "9000")
    assert result.returncode == 0, result.stderr
    rl_toml = tmp_path / "run" / "slurm" / "rl.toml"
    data = tomllib.loads(rl_toml.read_text())
    assert "base_urls" not in data["orchestrator"].get("client", {})
    cfg = load_config(RLConfig, ["@", str(rl_toml)])
    resolved = resolve(cfg, facts(0, 1))
    assert resolved.configs["orchestrator"].client.base_urls == ["http://127.0.0.1:9000"]


def test_continuous_rollouts_update_the_server_in_flight_unless_the_user_chose():
    plain = resolve(rl(), facts(0, 1))
    assert plain.configs["inference"].weight_update == "drain"
    assert plain.configs["orchestrator"].max_off_policy_steps is None
    continuous = resolve(rl("--max-off-policy-steps", "2"), facts(0, 1))
    assert continuous.configs["orchestrator"].max_off_policy_steps == 2  # the shared field fills the orchestrator
    assert continuous.configs["inference"].weight_update == "in_flight"
    kept = resolve(rl("--max-off-policy-steps", "2", "--inference.weight-update", "drain"), facts(0, 1))
    assert kept.configs["inference"].weight_update == "drain"
    with pytest.raises(ValueError, match=r"max_off_policy_steps \(0\) < async_level \(1\)"):
        rl("--max-off-policy-steps", "0", "--async-level", "1")


def test_continuous_rollouts_dispatch_as_far_ahead_as_the_bound_allows_unless_the_user_chose():
    """A long-tailed rollout outlives several steps: K = 4 at async_level 3 met issue 42's targets where K = 2 at 1
    did not (docs/benchmarks.md), so async_level follows K - 1 when the user set no async_level anywhere."""
    levels = {k: rl("--max-off-policy-steps", str(k)).orchestrator.async_level for k in (0, 1, 2, 3, 4, 6)}
    assert levels == {0: 0, 1: 1, 2: 1, 3: 2, 4: 3, 6: 5}
    assert rl("--max-off-policy-steps", "4").trainer.async_level == 3  # both processes: they must agree
    assert (
        rl().orchestrator.async_level == 1
        and rl("--max-off-policy-steps", "4", "--async-level", "1").trainer.async_level == 1
    )
    chosen = rl("--max-off-policy-steps", "4", "--orchestrator.async-level", "2", "--trainer.async-level", "2")
    assert chosen.orchestrator.async_level == 2
    with pytest.raises(ValueError, match="curriculum .* unset max_off_policy_steps"):
        rl("--max-off-policy-steps", "1", "--orchestrator.curriculum.dynamic-sampling", "true")


def test_a_servers_key_variable_reaches_the_orchestrator_and_the_launchers_probes():
    """``inference.server.api_key_var``: the orchestrator reads the same variable (no key in its config file), and
    the launcher's own health probes and weight resets carry the key from the environment rl started in."""
    resolved = resolve(rl("--inference.server.api-key-var", "RUN_KEY"), facts(0, 1, environ={"RUN_KEY": "k9"}))
    client = resolved.configs["orchestrator"].client
    assert client.api_key is None and client.api_key_var == "RUN_KEY"
    assert resolved.api_key == "k9"
