"""The code environment through verifiers' own eval against our inference server: a scripted engine answers each
prompt with the task's reference solution (or a wrong one), and the reward comes from the sandbox."""

from __future__ import annotations

import pytest

from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
from tests.fixtures.scripted import ScriptedServer
from tests.fixtures.vf import local_agent, run_vf_eval

# slow: a tiny torch model, an inference server and verifiers' eval (63 s measured on the loaded 2-core CI host)
pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.xdist_group("sandbox"), pytest.mark.timeout(600)]


def test_vf_eval_rewards_reference_solutions_in_the_sandbox(sandbox, tmp_path):
    from code_tasks import generate_tasks

    tasks = generate_tasks(4, seed=3)
    by_prompt = {t["prompt"]: t for t in tasks}

    def script(prompt: str) -> str | None:
        for text, task in by_prompt.items():
            if text in prompt:
                if task is tasks[1]:  # one task answered wrongly: a constant function
                    return f"```python\ndef {task['family']}(*args):\n    return 0\n```"
                return f"Here you go.\n```python\n{task['reference']}```"
        return None

    server = ScriptedServer(save_tiny_model(tmp_path / "model", build_tool_tokenizer()), script)
    try:
        episodes = run_vf_eval(
            "code-tasks",
            server_url=server.url,
            model=server.config.model.name,
            output_dir=tmp_path / "eval",
            taskset={"num_examples": 4, "seed": 3},
            env={"agent": local_agent()},
            max_tokens=512,
            num_tasks=4,
            num_rollouts=1,
        )
    finally:
        server.stop()
    traces = [t for e in episodes for t in e.traces]
    assert all(e.ok for e in episodes), [t.errors for t in traces if t.errors]
    assert len(traces) == 4 and server.engine.scripted_requests == 4
    rewards = sorted(t.rewards["tests_passed"].score for t in traces)
    assert rewards[1:] == [1.0, 1.0, 1.0] and rewards[0] < 1.0
    assert sorted(t.metrics["runs_clean"] for t in traces) == [1.0, 1.0, 1.0, 1.0]
