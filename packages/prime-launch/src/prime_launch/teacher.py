"""The distillation teacher ``rl`` starts from ``[teacher]``: its inference config (engine and GPUs as placed, its own
port, frozen weights, its own run subdirectory) and the distilling environments pointed at it. Pure, like the
resolver that calls it."""

from __future__ import annotations

from prime_core.config.inference import InferenceConfig, ServerConfig
from prime_core.config.orchestrator import EnvConfig
from prime_core.config.rl import RLConfig
from prime_core.run_dir import RunDir

from prime_launch.placement import Placement

TEACHER = "teacher"
"""The teacher's process name: ``logs/teacher.log``, ``configs/teacher.toml``, its devices line."""


def teacher_config(rl: RLConfig, place: Placement, run_dir: RunDir) -> InferenceConfig | None:
    """The teacher server's ``inference`` config. Its run directory is ``<output_dir>/teacher`` (an inference process
    writes its own config and heartbeat there, which must not be the policy server's); ``server.frozen`` makes it
    refuse every weight change, whatever sends one."""
    t = rl.teacher
    if t is None:
        return None
    # Unset: the student's starting weights (self-distillation); the base of a LoRA student, never its adapter.
    model = t.model or rl.orchestrator.model.derive(lora=None)
    vllm = t.vllm
    if place.teacher_data_parallel is not None:
        vllm = vllm.derive(data_parallel_size=place.teacher_data_parallel)
    log = rl.inference.log if rl.inference is not None else rl.orchestrator.log
    return InferenceConfig(
        model=model,
        engine=place.teacher_engine or t.engine,
        server=ServerConfig(port=t.port, frozen=True),
        max_model_len=t.max_model_len,
        max_batch_size=t.max_batch_size,
        output_dir=run_dir.root / TEACHER,
        log=log,
        torch=t.torch,
        vllm=vllm,
    )


def teacher_url(teacher: InferenceConfig) -> str:
    return f"http://127.0.0.1:{teacher.server.port}"


def with_teacher(envs: list[EnvConfig], teacher: InferenceConfig | None, health_timeout: float) -> list[EnvConfig]:
    """Each distilling env without a teacher URL scores with the started teacher: its URL, its served model unless
    the env names one, and a health wait as long as rl's (the teacher loads while the orchestrator starts)."""
    if teacher is None:
        return envs
    out = []
    for env in envs:
        distill = env.distill
        if distill is None or distill.teacher.base_url is not None:
            out.append(env)
            continue
        t = distill.teacher
        t = t.derive(
            base_url=teacher_url(teacher),
            model=t.model or teacher.served_model_name,
            health_timeout=max(t.health_timeout, health_timeout),
        )
        out.append(env.derive(distill=distill.derive(teacher=t)))
    return out
