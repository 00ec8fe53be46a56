"""The verifiers ``EnvConfig`` an environment runs with: each seat's harness and runtime, and its judges' endpoint.

``harness = "auto"`` and ``runtime = "auto"`` keep what the environment gives each seat, as ``vf-eval`` would run
it: the seat's own pin (an Env's role declared ``vf.AgentConfig(harness=..., runtime=...)``), else the taskset's
bundled harness, else verifiers' ``bash``; a runtime the environment does not declare is ``subprocess`` (verifiers'
default is a hosted sandbox, which an offline host cannot reach). ``max_turns = "auto"`` likewise keeps a seat's
declared turn limit, and none where it declares none (each episode is still bounded by ``rollout_timeout`` and the
model's context, see docs/environments.md). One substitution keeps semantics: a seat played
by verifiers' plain ``null`` chat loop on the local runtime runs that same loop in-process (``prime-chat``), which
saves a Python process per turn and never fetches the program's dependencies.
"""

from __future__ import annotations

import copy
from typing import Any

from prime_core.config.orchestrator import EnvConfig

from prime_orchestrator.env_server import register_project_runtimes
from prime_orchestrator.judges import JudgeEndpoint, env_judges, harden_judges, point_judges

CHAT_HARNESS = "prime-chat"
LOCAL_RUNTIME = "subprocess"


def _seat(env: EnvConfig, declared: Any, role: str) -> dict[str, Any]:
    """The project-level settings of one seat, over what the environment declares for it."""
    seat: dict[str, Any] = {}
    authored = type(declared).model_fields[role].default
    if env.max_turns != "auto":
        seat["max_turns"] = env.max_turns
    if env.harness != "auto":
        seat["harness"] = {"id": env.harness, **env.harness_args}
    elif env.harness_args:
        seat["harness"] = {"id": declared.agent_harnesses()[role].id, **env.harness_args}
    if env.runtime != "auto":
        seat["runtime"] = {"type": env.runtime, **env.runtime_args}
    elif "runtime" in authored.model_fields_set:
        if env.runtime_args:
            seat["runtime"] = {"type": authored.runtime.type, **env.runtime_args}
    else:
        seat["runtime"] = {"type": LOCAL_RUNTIME, **env.runtime_args}
    return seat


def plays_null_loop(harness_id: str) -> bool:
    """Whether a harness is verifiers' ``null`` chat loop unchanged (a taskset may export it under its own name)."""
    from verifiers.v1.harnesses.null import NullHarness
    from verifiers.v1.utils.loaders import harness_class

    cls = harness_class(harness_id)
    return issubclass(cls, NullHarness) and cls.launch is NullHarness.launch and cls.setup is NullHarness.setup


def resolve(data: dict[str, Any]) -> Any:
    """verifiers' ``resolve_env_config`` on a copy: its validators replace nested dicts of their input in place."""
    from verifiers.v1.utils.loaders import resolve_env_config

    return resolve_env_config(copy.deepcopy(data))


def env_config_data(env: EnvConfig, judge: JudgeEndpoint | None = None) -> dict[str, Any]:
    """The verifiers EnvConfig (as JSON data) of one environment; ``env_args`` holds other EnvConfig fields and
    per-seat tables that win over the settings above; ``judge`` is where every judge of it is pointed. verifiers'
    built-in judges are played by prime's hardened plugins (``judges.harden_judges``)."""
    # A project runtime may be named anywhere in the config (a seat's, an isolated verifier's under ``env_args``):
    # verifiers validates every runtime field against its union, which knows the type only once registered.
    register_project_runtimes([{"runtime": {"type": env.runtime}}, env.env_args, env.args])
    from verifiers.v1.configs.agent import agent_config_fields

    data: dict[str, Any] = {**env.env_args, "id": env.env_id, "taskset": {"id": env.id, **env.args}}
    declared = resolve(data)
    roles = list(agent_config_fields(declared))
    for role in roles:
        data[role] = {**_seat(env, declared, role), **env.env_args.get(role, {})}
    config = resolve(data)
    harnesses = config.agent_harnesses()
    for role in roles:
        harness = harnesses[role]
        if getattr(getattr(config, role).runtime, "type", None) == LOCAL_RUNTIME and plays_null_loop(harness.id):
            data[role]["harness"] = {**harness.model_dump(mode="json"), "id": CHAT_HARNESS}
    full = resolve(data).model_dump(mode="json")
    harden_judges(resolve(full), full)
    if judge is not None:
        point_judges(resolve(full), full, judge)
    return resolve(full).model_dump(mode="json")


def env_config_problem(env: EnvConfig) -> str | None:
    """Why verifiers refuses an environment's settings (a misspelt ``args`` key, a wrong type), in one line naming
    the key, or None. Cheap (no dataset is built), so entry points check every environment before they start."""
    import difflib

    from pydantic import ValidationError

    try:
        env_config_data(env)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(p) for p in first["loc"]]
        in_args = bool(loc) and loc[0] == "taskset"
        key = ".".join(["args", *loc[1:]] if in_args else ["env_args", *loc])
        hint = ""
        if in_args and first["type"] == "extra_forbidden" and len(loc) == 2:
            from verifiers.v1.utils.loaders import taskset_config_type

            close = difflib.get_close_matches(loc[1], list(taskset_config_type(env.id).model_fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"{key}: {first['msg']}{hint}"
    except (ValueError, TypeError, KeyError, ImportError) as e:
        # ImportError: a taskset whose optional dependencies are missing (verifiers' textarena without
        # ``verifiers[ta]``) fails its import with the install hint as the message's first line.
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def check_envs(named: dict[str, list[EnvConfig]]) -> None:
    """Exit 2 with one line at the first environment verifiers refuses (``named``: config key -> environments)."""
    import sys

    for key, envs in named.items():
        for i, env in enumerate(envs):
            if problem := env_config_problem(env):
                print(f"error: {key}.{i} ({env.id}): {problem}", file=sys.stderr, flush=True)
                raise SystemExit(2)


def policy_judge_problem(config: Any) -> str | None:
    """Why an RL run's training environments would be judged by the policy being trained (one line naming
    ``orchestrator.judge.base_url``), or None: a fixed judge endpoint, a LoRA run's base model, the opt-in
    ``judge.allow_policy_judge``, or no judge in any training environment."""
    j = config.judge
    if not j.enabled or j.allow_policy_judge:
        return None
    policy_urls = {u.rstrip("/").removesuffix("/v1") for u in config.client.base_urls}
    if j.base_url is not None and str(j.base_url).rstrip("/").removesuffix("/v1") not in policy_urls:
        return None
    if config.model.lora is not None and (j.model or config.model.name) == config.model.name:
        return None  # the base model's name is served without the adapter: a frozen judge
    for env in config.env:
        if found := env_judges(env_config_data(env)):
            return (
                f"orchestrator.judge.base_url: env {env.resolved_name} is judged ({found[0][0]}) by the policy being "
                "trained, which would be optimised against its own verdicts; point judge.base_url and judge.model "
                "at a fixed judge model, or set judge.allow_policy_judge = true"
            )
    return None


def host_commands_problem(config: Any) -> str | None:
    """Why an RL run's environment would let the policy run commands on this host (one line naming the environment,
    its seat and harness), or None: a seat whose harness is not a chat loop (verifiers' ``bash``, a coding agent) on
    the ``subprocess`` runtime, without the environment's ``allow_host_commands``. Training environments and the
    run's own evals (``eval.envs``) alike: an eval during the run samples the policy being trained, unattended, and
    whatever that policy learned to try against its training environments it tries there on the host."""
    from verifiers.v1.configs.agent import agent_config_fields

    named = [(f"env.{i}", env) for i, env in enumerate(config.env)]
    named += [(f"eval.envs.{i}", env) for i, env in enumerate(config.eval.envs)]
    for key, env in named:
        if env.allow_host_commands:
            continue
        resolved = resolve(env_config_data(env))
        harnesses = resolved.agent_harnesses()
        for role in agent_config_fields(resolved):
            runtime = getattr(getattr(resolved, role).runtime, "type", None)
            harness = harnesses[role].id
            if runtime == LOCAL_RUNTIME and harness != CHAT_HARNESS and not plays_null_loop(harness):
                what = "would be trained against" if key.startswith("env.") else "being trained would act on"
                return (
                    f"{key} ({env.resolved_name}): seat {role!r} plays harness {harness!r}, which runs the model's "
                    f"commands, on this host (runtime {LOCAL_RUNTIME!r}{' by default' if env.runtime == 'auto' else ''}"
                    f"): the policy {what} the host's files, network and processes; set runtime = "
                    '"sandbox_pool" (isolated, offline; or docker, podman, prime), harness = "null" for a chat seat, '
                    "or allow_host_commands = true"
                )
    return None


def check_training_envs(config: Any) -> None:
    """Exit 2 with one line when ``policy_judge_problem`` or ``host_commands_problem`` finds one (the
    ``orchestrator`` entry point and its dry run, before anything starts)."""
    import sys

    if problem := policy_judge_problem(config) or host_commands_problem(config):
        print(f"error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)
