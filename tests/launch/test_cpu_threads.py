"""How rl splits the CPU cores between the processes it runs on CPU, and which explicit choices it keeps."""

import pytest
from prime_core.config import load_config
from prime_core.config.rl import RLConfig
from prime_launch.cpu_threads import split_cpu_threads
from prime_launch.launcher import resolve_here
from prime_launch.plan import command_line

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin"}


@pytest.mark.parametrize(
    ("cores", "ranks", "inference", "trainer"),
    [
        (2, 1, 1, 1),
        (2, 2, 1, 1),  # fewer cores than compute processes: 1 each
        (4, 1, 2, 2),
        (4, 2, 2, 1),  # ranks stay equal; the remainder goes to inference
        (16, 1, 8, 8),
        (16, 2, 6, 5),
    ],
)
def test_split_between_inference_and_trainer_ranks(cores, ranks, inference, trainer):
    threads = split_cpu_threads(cores, inference=True, trainer_ranks=ranks)
    assert threads == {"orchestrator": 1, "inference": inference, "trainer": trainer}
    assert inference + ranks * trainer <= max(cores, 1 + ranks)


def test_split_without_inference_gives_the_trainer_every_core():
    assert split_cpu_threads(16, inference=False, trainer_ranks=1) == {"orchestrator": 1, "trainer": 16}
    assert split_cpu_threads(16, inference=False, trainer_ranks=2) == {"orchestrator": 1, "trainer": 8}


def test_split_keeps_explicit_counts_and_shares_the_rest():
    assert split_cpu_threads(16, inference=True, trainer_ranks=2, explicit={"trainer": 2}) == {
        "orchestrator": 1,
        "inference": 12,
        "trainer": 2,
    }
    assert split_cpu_threads(4, inference=True, trainer_ranks=1, explicit={"inference": 4, "orchestrator": 2}) == {
        "orchestrator": 2,
        "inference": 4,
        "trainer": 1,
    }


def thread_env(plan) -> dict[str, dict[str, str]]:
    return {s.name: {k: v for k, v in s.env.items() if k.endswith("_NUM_THREADS")} for s in plan.specs}


def test_cpu_plan_sets_threads_per_process_and_shows_them():
    cfg = load_config(RLConfig, ["--inference.engine", "auto", "--devices.num-cpu-trainer-procs", "2"])
    plan = resolve_here(cfg, CPU_ONLY, cores=16)
    assert thread_env(plan) == {
        "inference": {"OMP_NUM_THREADS": "6", "MKL_NUM_THREADS": "6"},
        "orchestrator": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        "trainer": {"OMP_NUM_THREADS": "5", "MKL_NUM_THREADS": "5"},
    }
    assert plan.devices["trainer"] == "CPU x2, 5 threads per rank"
    assert plan.devices["inference"] == "CPU (torch engine), 6 threads"
    trainer = next(s for s in plan.specs if s.name == "trainer")
    assert "OMP_NUM_THREADS=5 " in command_line(trainer)


def test_user_omp_num_threads_is_kept():
    from_env_vars = ["--env-vars", '{"OMP_NUM_THREADS": "3"}']
    for environ, args, env in [
        ({**CPU_ONLY, "OMP_NUM_THREADS": "3"}, [], {}),  # children inherit the launcher's environment
        (CPU_ONLY, from_env_vars, {"OMP_NUM_THREADS": "3"}),
    ]:
        plan = resolve_here(load_config(RLConfig, ["--inference.engine", "auto", *args]), environ, cores=16)
        assert thread_env(plan) == {"inference": env, "orchestrator": env, "trainer": env}
        assert plan.devices["trainer"] == "CPU, OMP_NUM_THREADS=3 (inherited)"
    # devices.cpu_threads names a role: it wins over the inherited value for that role only.
    cfg = load_config(RLConfig, ["--inference.engine", "auto", "--devices.cpu-threads", '{"trainer": 2}'])
    plan = resolve_here(cfg, {**CPU_ONLY, "OMP_NUM_THREADS": "3"}, cores=16)
    assert thread_env(plan)["trainer"]["OMP_NUM_THREADS"] == "2" and thread_env(plan)["inference"] == {}


def test_inference_num_threads_counts_as_explicit():
    cfg = load_config(RLConfig, ["--inference.engine", "auto", "--inference.torch.num-threads", "4"])
    plan = resolve_here(cfg, CPU_ONLY, cores=16)
    assert thread_env(plan)["inference"]["OMP_NUM_THREADS"] == "4"
    assert thread_env(plan)["trainer"]["OMP_NUM_THREADS"] == "12"
    with pytest.raises(ValueError, match="devices.cpu_threads.inference"):
        load_config(
            RLConfig,
            [
                "--inference.engine",
                "auto",
                "--inference.torch.num-threads",
                "4",
                "--devices.cpu-threads",
                '{"inference": 2}',
            ],
        )


def test_gpu_plan_sets_threads_of_the_orchestrator_only():
    cfg = load_config(RLConfig, ["--inference.engine", "auto"])
    plan = resolve_here(cfg, {"CUDA_VISIBLE_DEVICES": "0,1", "PATH": "/usr/bin"}, cores=16)
    assert thread_env(plan) == {
        "inference": {},
        "orchestrator": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        "trainer": {},
    }
