"""A hostile policy on the code environment (issue #37): its completions cycle through the attacks of
``attacks.py`` while its other samples of the same prompts answer correctly, scored through a sandbox node.

The fast test scores one batch through the taskset's own reward, all rollouts at once; the slow one runs the real
``rl`` (trainer and orchestrator) against a scripted inference server for two training steps. Both assert: every
correct answer still earns 1.0 (no neighbour fails), every attack 0.0, no sandbox error, no zygote replaced, no
process of the node's uids alive afterwards, and no file planted on the host or left in the node's folder."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.sandbox import attacks
from tests.sandbox.conftest import NODE_UID_BASE, assert_no_sandbox_processes, uid_span

pytestmark = [pytest.mark.xdist_group("sandbox"), pytest.mark.skipif(not attacks.X86_64, reason="x86_64 attacks")]

PLANTED = Path("/tmp/prime-hostile-planted")
PLANT = f"for p in ({str(PLANTED)!r}, '/usr/planted', '/.ws/planted'):\n    try:\n        open(p, 'w').write('x')\n    except OSError:\n        pass\n"
DAEMON = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(1000)\n    os._exit(0)\n"
ATTACKS = [
    attacks.CLOSE_PIPES_AND_SLEEP,
    attacks.MEMFD_HOARD,
    attacks.SHM_HOARD,
    attacks.TMPFS_FILL,
    attacks.KERNEL_PROBES,
    attacks.KEYRING_CARRY_WRITE,
    attacks.STACK_SCAN,
    attacks.DEEP_TEST_LINES,
    attacks.ABSTRACT_LISTEN,
    attacks.FORK_BOMB,
    attacks.MEMORY_BOMB,
    attacks.KILL_EVERYTHING,
    PLANT,
    DAEMON,
    attacks.SURROGATE_ANSWERS,
]


def reply(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}```\n"


class HostilePolicy:
    """Each prompt's samples alternate: the reference solution, then the next attack of the cycle."""

    def __init__(self, tasks: list[dict]) -> None:
        self.by_prompt = {t["prompt"]: t for t in tasks}
        self.turns: dict[str, itertools.count] = {}
        self.attacks = itertools.cycle(ATTACKS)
        self.sent = {"reference": 0, "attack": 0}

    def __call__(self, prompt: str) -> str | None:
        task = next((t for text, t in self.by_prompt.items() if text in prompt), None)
        if task is None:
            return None
        if next(self.turns.setdefault(task["prompt"], itertools.count())) % 2 == 0:
            self.sent["reference"] += 1
            return reply(task["reference"])
        self.sent["attack"] += 1
        return reply(next(self.attacks))


def node_health(node) -> dict:
    return httpx.get(node.url + "/health", headers={"Authorization": f"Bearer {node.key}"}, timeout=30).json()


def assert_nothing_left(node) -> None:
    assert_no_sandbox_processes(span=range(NODE_UID_BASE + 1, uid_span(NODE_UID_BASE, 16).stop))
    assert not PLANTED.exists()
    left = [p for p in node.tmp.rglob("*") if p.is_file()]
    assert not left, left


@dataclass
class _Trace:
    id: str
    last_reply: str


def test_hostile_completions_never_fail_their_neighbours(node, monkeypatch):
    import verifiers.v1 as vf
    from code_tasks import generate_tasks
    from verifiers.v1.utils.loaders import resolve_env_config

    monkeypatch.setenv("NODE_KEY", node.key)
    args = {"num_examples": len(ATTACKS), "seed": 7, "wall_s": 2}
    args |= {"sandbox_urls": [node.url], "sandbox_api_key_var": "NODE_KEY"}
    config = resolve_env_config({"taskset": {"id": "code-tasks", **args}})
    tasks = list(vf.load_taskset(config.taskset))
    policy = HostilePolicy(generate_tasks(len(ATTACKS), seed=7))
    before = node_health(node)

    async def score_all() -> list[float]:
        traces = [(t, _Trace(f"hostile-{i}-{k}", policy(t.data.prompt))) for i, t in enumerate(tasks) for k in (0, 1)]
        return await asyncio.gather(*(task.tests_passed(trace) for task, trace in traces))

    rewards = asyncio.run(score_all())
    assert rewards[0::2] == [1.0] * len(tasks), rewards  # every reference, scored beside an attack
    assert rewards[1::2] == [0.0] * len(tasks), rewards
    after = node_health(node)
    assert (
        after["sandbox_errors"] == before["sandbox_errors"] and after["zygotes_replaced"] == before["zygotes_replaced"]
    )
    assert after["executions_completed"] == before["executions_completed"] + 2 * len(tasks)
    assert_nothing_left(node)


def _write_config(path: Path, model: Path, out: Path, node) -> Path:
    env_args = (
        f'{{ num_examples = 200, seed = 0, num_tests = 5, wall_s = 2, sandbox_urls = ["{node.url}"], '
        'sandbox_api_key_var = "NODE_KEY" }'
    )
    path.write_text(
        f"""output_dir = "{out}"
max_steps = 2
seq_len = 4096
async_level = 1
seed = 0

[model]
name = "{model}"

[trainer]
device = "cpu"

[trainer.loss]
type = "grpo"

[orchestrator]
batch_size = {2 * len(ATTACKS)}
rollouts_per_example = 2

[orchestrator.sampling]
temperature = 1.0
max_tokens = 3072

[[orchestrator.env]]
id = "code-tasks"
args = {env_args}

[inference]
engine = "torch"
"""
    )
    return path


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1200)
def test_rl_trains_through_a_hostile_policy(node, tmp_path, monkeypatch):
    """The real ``rl``: two trainer steps on rollouts half of which attack the sandbox; reward 0.5 each step."""
    from code_tasks import generate_tasks

    from tests.e2e.test_reverse_text import RL, ROOT, metrics
    from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
    from tests.fixtures.scripted import ScriptedServer

    monkeypatch.setenv("NODE_KEY", node.key)
    policy = HostilePolicy(generate_tasks(200, seed=0))
    server = ScriptedServer(save_tiny_model(tmp_path / "model", build_tool_tokenizer()), policy)
    out, configs = tmp_path / "run", tmp_path / "configs"
    config = _write_config(tmp_path / "rl.toml", server.config.model.name, out, node)
    before = node_health(node)
    try:
        dry = subprocess.run(
            [str(RL), "@", str(config), "--output-dir", str(configs), "--dry-run"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert dry.returncode == 0, dry.stderr
        argv = [str(RL), "--trainer", "@", str(configs / "configs" / "trainer.toml")]
        argv += ["--orchestrator", "@", str(configs / "configs" / "orchestrator.toml")]
        argv += ["--orchestrator.client.base-urls", server.url, "--trainer.output-dir", str(out)]
        argv += ["--orchestrator.output-dir", str(out), "--console", "quiet"]
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1000)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    finally:
        server.stop()
    assert (out / "weights" / "step_2" / "STABLE").exists()  # both training steps completed
    rewards = metrics(out, "orchestrator", "reward/mean")
    assert sorted(rewards) == [0, 1] and all(r == 0.5 for r in rewards.values()), rewards
    assert all(v == 0 for v in metrics(out, "orchestrator", "failed/rollouts").values())
    assert policy.sent["attack"] >= 2 * len(ATTACKS) // 2, policy.sent
    after = node_health(node)
    assert (
        after["sandbox_errors"] == before["sandbox_errors"] and after["zygotes_replaced"] == before["zygotes_replaced"]
    )
    assert_nothing_left(node)
