"""No default wait longer than the liveness bound without a progress check (issue #38, docs/liveness.md).

A wait of at most ``BOUND_S`` ends, or fails with a line naming what it waited for, before anyone would ask. Every
longer one must run inside a progress activity that the watchdog checks and that logs what it waits for every minute
(``prime_core.progress``), or be a wait of the launcher that says so itself. This test enumerates

- every time field of every config and cross-process schema (pydantic; a name with ``timeout``, ``wait`` or ``grace``,
  or ending in ``_s``): its default is at most ``BOUND_S``, or ``COVERED`` says what covers it and names the source
  line that does;
- every numeric wait written in the packages' code (a ``timeout=``/``wait``/``deadline``... argument, default or
  constant, ``wait_for(..., N)``, ``sleep(N)``, ``join(N)``) over ``BOUND_S``: ``KNOWN_WAITS`` says what covers it;
- the SLURM template's own wait, which says every minute what it waits for.

A new field or wait fails here until it is covered and listed, so none can grow silent unnoticed.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

from prime_core.progress import NOTICE_EVERY_S
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "packages"
BOUND_S = NOTICE_EVERY_S
TIME_FIELD = re.compile(r"timeout|wait|grace|_s$")
NOT_TIME = {"waiting", "scoring_s", "slowest_s", "for_s"}  # counts and measurements, no wait

# field -> (the source file, relative to packages/, and a line of it that shows the cover; why)
COVERED: dict[str, tuple[str, str, str]] = {
    "ClientConfig.timeout": (
        "prime-orchestrator/src/prime_orchestrator/envs.py",
        "async with asyncio.timeout(self.env.rollout_timeout):",
        "one model request inside a rollout, which its rollout_timeout ends (the rollouts lane); inference answers "
        "/health every second",
    ),
    "ClientConfig.health_timeout": (
        "prime-orchestrator/src/prime_orchestrator/orchestrator.py",
        'progress.begin(f"starting env servers and waiting for inference\'s{teachers} /health", waits_for="inference")',
        "an activity waiting on inference, which is watched from its start (its heartbeat)",
    ),
    "ClientConfig.update_weights_timeout": (
        "prime-orchestrator/src/prime_orchestrator/weight_relay.py",
        'with progress.activity(what, lane="relay", limit_s=c.update_weights_timeout, waits_for="inference"):',
        "the relay lane's limit: the watchdog blames inference at the bound plus slack",
    ),
    "JudgeEndpointConfig.timeout": (
        "prime-orchestrator/src/prime_orchestrator/envs.py",
        "async with asyncio.timeout(self.env.rollout_timeout):",
        "a judge request inside a rollout's reward, ended by the rollout's timeout (the rollouts lane)",
    ),
    "TeacherConfig.timeout": (
        "prime-orchestrator/src/prime_orchestrator/distill.py",
        'self.lane = InflightLane("teachers", "scoring with the teachers", limit)',
        "the teachers lane: its clock restarts with each answer, its limit is one request's attempts",
    ),
    "TeacherConfig.health_timeout": (
        "prime-orchestrator/src/prime_orchestrator/orchestrator.py",
        'progress.begin(f"starting env servers and waiting for inference\'s{teachers} /health", waits_for="inference")',
        "the start-up activity, which names the teachers and logs every minute",
    ),
    "ServerConfig.weight_wait_timeout": (
        "prime-orchestrator/src/prime_orchestrator/envs.py",
        "async with asyncio.timeout(self.env.rollout_timeout):",
        "a request held for its weights (dispatch_ahead) belongs to a rollout, which its rollout_timeout ends (the "
        "rollouts lane), while the policy lane waits on the trainer that makes those weights",
    ),
    "EnvConfig.rollout_timeout": (
        "prime-orchestrator/src/prime_orchestrator/liveness.py",
        "self.limit_s = max(env_timeouts) + config.recovery.probe_timeout_s",
        "the rollouts (and evals) lane's limit",
    ),
    "OrchestratorConfig.weights_timeout": (
        "prime-orchestrator/src/prime_orchestrator/weight_relay.py",
        'with progress.activity(waiting, lane="policy", waits_for="trainer"):',
        "the policy lane waits on the trainer, which is watched",
    ),
    "EvalConfig.weights_timeout": (
        "prime-orchestrator/src/prime_orchestrator/eval_runner.py",
        'logger.warning("still waiting for the STABLE marker of %s after %.0fs (weights_timeout %gs)",',
        "eval's wait for a checkpoint still being written, before anything is scored: it says every 30 s what it "
        "waits for",
    ),
    "ParallelConfig.timeout_s": (
        "prime-trainer/src/prime_trainer/rl/train.py",
        'with progress.activity(f"training step {step}", kind="step"):',
        "collectives run inside setup, steps, publishes and checkpoints, each with a learned bound",
    ),
    "RLDataConfig.wait_timeout_s": (
        "prime-trainer/src/prime_trainer/rl/data.py",
        'with progress.activity(waiting, waits_for="orchestrator"):',
        "the trainer's wait on the orchestrator, which is watched",
    ),
    "WeightBroadcastConfig.timeout_s": (
        "prime-trainer/src/prime_trainer/liveness.py",
        'return progress.activity(what, limit_s=2 * c.config.weights.broadcast.timeout_s, waits_for="inference")',
        "the publish activity's limit",
    ),
    "RLConfig.health_timeout": (
        "prime-launch/src/prime_launch/servers.py",
        'say(f"still waiting for {url} after {now - start:.0f} s (health_timeout {timeout:.0f} s)")',
        "rl's own wait: it polls every process (exits and the watchdog) and says every minute what it waits for",
    ),
    "SandboxClientConfig.timeout_s": (
        "prime-orchestrator/src/prime_orchestrator/envs.py",
        "async with asyncio.timeout(self.env.rollout_timeout):",
        "a sandbox node's execution inside a rollout's reward, ended by the rollout's timeout",
    ),
    "EnvServerSpec.start_timeout": (
        "prime-orchestrator/src/prime_orchestrator/orchestrator.py",
        'progress.begin(f"starting env servers and waiting for inference\'s{teachers} /health", waits_for="inference")',
        "inside the start-up activity, which logs every minute what it still waits for",
    ),
    "LivenessConfig.first_timeout_s": (
        "prime-launch/src/prime_launch/watchdog.py",
        "return c.first_timeout_s",
        "the watchdog's own bound of a first step, publish or checkpoint (an activity, logged every minute)",
    ),
}

# (file relative to packages/, name or call) -> why a written wait over BOUND_S is covered
KNOWN_WAITS: dict[tuple[str, str], str] = {
    ("prime-core/src/prime_core/transport_zmq.py", "drain_timeout"): (
        "the orchestrator's close hands the last steps to the trainer inside a ship activity that waits on it"
    ),
    ("prime-trainer/src/prime_trainer/world.py", "timeout_s"): "the default of ParallelConfig.timeout_s (COVERED)",
    ("prime-launch/src/prime_launch/dry_check.py", "CHECK_TIMEOUT_S"): (
        "rl --dry-run's check of the orchestrators' settings, before anything starts: it says every minute what it "
        "waits for (dry_check._wait)"
    ),
    ("prime-orchestrator/src/prime_orchestrator/sandbox/zygotes.py", "timeout"): (
        "a pool's first start compiles its bytecode cache; the pool starts inside a rollout's reward (rollouts lane)"
    ),
}


def config_models() -> list[type[BaseModel]]:
    import prime_core.config as config
    import prime_core.schemas as schemas

    for package in (config, schemas):
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{package.__name__}.{module.name}")
    found, todo = [], [BaseModel]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith(("prime_core.config", "prime_core.schemas")):
                found.append(sub)
    return found


def time_fields() -> dict[str, float | None]:
    fields = {}
    for model in config_models():
        for name, info in model.model_fields.items():
            numeric = any(t in str(info.annotation) for t in ("float", "int"))
            if TIME_FIELD.search(name) and name not in NOT_TIME and numeric:
                default = info.default if isinstance(info.default, int | float) else None
                fields[f"{model.__name__}.{name}"] = default
    return fields


def test_every_long_default_wait_of_a_config_is_covered():
    fields = time_fields()
    assert "EnvConfig.rollout_timeout" in fields and "RLConfig.stop_grace" in fields  # the enumeration works
    uncovered = [
        f"{name} = {d:g}" for name, d in fields.items() if d is not None and d > BOUND_S and name not in COVERED
    ]
    assert uncovered == [], f"default waits over {BOUND_S:g} s without a progress check: {uncovered}"
    stale = [name for name in COVERED if fields.get(name) is None or fields[name] <= BOUND_S]
    assert stale == [], f"COVERED lists fields that are gone or short now: {stale}"
    for name, (path, line, _) in COVERED.items():
        assert line in (SRC / path).read_text(), f"{name}: {path} no longer holds the cover: {line}"


WAIT_NAME = re.compile(r"timeout|wait|deadline|drain|grace|patience")


def _number(node: ast.AST) -> float | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return float(node.value)
    return None


def written_waits(tree: ast.AST) -> list[tuple[str, float]]:
    """(name or call, seconds) of every numeric wait in a module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            found += [
                (k.arg, v) for k in node.keywords if k.arg and WAIT_NAME.search(k.arg) and (v := _number(k.value))
            ]
            last = _number(node.args[-1]) if node.args else None
            positional = len(node.args) > 1 if func == "wait_for" else func in ("sleep", "join", "wait")  # (aw, s)
            if positional and last is not None:
                found.append((func, last))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args.args[len(node.args.args) - len(node.args.defaults) :] + node.args.kwonlyargs
            pairs = zip([a.arg for a in args], [*node.args.defaults, *node.args.kw_defaults], strict=True)
            found += [(n, v) for n, d in pairs if d is not None and WAIT_NAME.search(n) and (v := _number(d))]
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if WAIT_NAME.search(name.lower()) and (v := _number(node.value)) is not None:
                found.append((name, v))
    return found


def test_every_long_wait_written_in_the_code_is_covered():
    long_ones = {}
    for path in sorted(SRC.glob("*/src/**/*.py")):
        rel = str(path.relative_to(SRC))
        for name, seconds in written_waits(ast.parse(path.read_text())):
            if seconds > BOUND_S:
                long_ones[(rel, name)] = seconds
    assert ("prime-core/src/prime_core/transport_zmq.py", "drain_timeout") in long_ones  # the scan works
    uncovered = {f"{rel}: {name} {s:g} s" for (rel, name), s in long_ones.items() if (rel, name) not in KNOWN_WAITS}
    assert uncovered == set(), f"waits over {BOUND_S:g} s without a progress check: {sorted(uncovered)}"
    stale = [key for key in KNOWN_WAITS if key not in long_ones]
    assert stale == [], f"KNOWN_WAITS lists waits that are gone or short now: {stale}"


def test_the_slurm_jobs_wait_for_inference_says_what_it_waits_for_every_minute():
    template = (SRC / "prime-launch/src/prime_launch/templates/multi_node_rl.sbatch.j2").read_text()
    # Each probe is bounded (``healthy`` is one curl with --max-time, carrying the servers' key).
    assert all("curl -sf --max-time 5" in line for line in template.splitlines() if line.startswith("healthy() {"))
    loop = template[template.index('until healthy "http://$host') :]
    loop = loop[: loop.index("done")]
    assert "job: still waiting for inference on $host to answer /health after" in loop
    assert "note=$((SECONDS + 60))" in loop and "(( SECONDS > deadline ))" in loop
