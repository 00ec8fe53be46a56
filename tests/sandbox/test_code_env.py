"""The code environment: deterministic tasks, hidden tests judged in the sandbox, reward = fraction passed."""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass

import pytest

pytestmark = pytest.mark.xdist_group("sandbox")


def test_generator_is_deterministic_and_its_references_pass_on_the_host():
    from code_tasks import generate_tasks
    from code_tasks.families import FAMILIES

    tasks = generate_tasks(120, seed=5)
    assert tasks == generate_tasks(120, seed=5) and tasks != generate_tasks(120, seed=6)
    assert {t["family"] for t in tasks} == {f.key for f in FAMILIES}
    assert len({t["prompt"] for t in tasks}) > 100
    for task in tasks:
        assert len(task["tests"]) == 5 and len({t["expr"] for t in task["tests"]}) == 5
        assert not any(t["expr"] in task["prompt"] for t in task["tests"])  # hidden: the prompt shows other calls
        ns: dict = {}
        exec(task["reference"], ns)
        for case in task["tests"]:
            assert eval(case["expr"], copy.copy(ns)) == case["expected"]


def test_extract_code():
    from code_tasks import extract_code

    reply = "Here:\n```python\nimport math\n```\nand\n```python\ndef f(x):\n    return x\n```\nDone."
    assert extract_code(reply) == "def f(x):\n    return x\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("def g():\n    return 2") == "def g():\n    return 2"
    assert extract_code("no code at all") == "" and extract_code("") == ""


@dataclass
class _Trace:
    id: str
    last_reply: str


def _score(task, reply: str, trace_id: str) -> tuple[float, float]:
    async def both():
        trace = _Trace(id=trace_id, last_reply=reply)
        return await task.tests_passed(trace), await task.runs_clean(trace)

    return asyncio.run(both())


def test_taskset_loads_through_verifiers_and_rewards_in_the_sandbox(sandbox):
    import verifiers.v1 as vf
    from code_tasks import generate_tasks
    from verifiers.v1.utils.loaders import resolve_env_config

    config = resolve_env_config({"taskset": {"id": "code-tasks", "num_examples": 12, "seed": 1, "wall_s": 2}})
    assert vf.environment_class("code-tasks").__name__ == "SingleAgentEnv"
    tasks = list(vf.load_taskset(config.taskset))
    refs = generate_tasks(12, seed=1)
    assert [t.data.prompt for t in tasks] == [r["prompt"] for r in refs]
    for i, (task, ref) in enumerate(zip(tasks, refs, strict=True)):
        assert _score(task, f"Sure.\n```python\n{ref['reference']}```", f"ref-{i}") == (1.0, 1.0)
    task, ref = tasks[0], refs[0]
    name = ref["family"]
    assert _score(task, "I cannot do that.", "none") == (0.0, 0.0)
    assert _score(task, f"```python\ndef {name}(*args):\n    return None\n```", "wrong")[0] < 1.0
    hostile = f"```python\nimport os\nopen('/etc/shadow').read()\ndef {name}(*a):\n    while True: pass\n```"
    assert _score(task, hostile, "hostile") == (0.0, 0.0)
    looping = f"```python\ndef {name}(*a):\n    while True:\n        pass\n```"
    assert _score(task, looping, "loop") == (0.0, 0.0)
