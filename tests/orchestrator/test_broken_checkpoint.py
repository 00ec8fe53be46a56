"""The orchestrator's part of a complete checkpoint that does not read back (cut short, edited by hand): one line
naming the file, not a traceback from the JSON parser, and never a resume from a guessed state."""

import pytest
from prime_core.io import UnreadableFile
from prime_orchestrator.curriculum import Curriculum
from prime_orchestrator.orchestrator import Orchestrator

from tests.orchestrator.test_curriculum import NUM_EXAMPLES, config

BREAKS = {
    "cut short": ('{"step": 2, "cur', "JSONDecodeError: "),
    "another schema": ('{"step": 2}', "KeyError: missing 'cursors'"),
    "a step that is not a number": ('{"step": "two", "cursors": {}}', "ValueError: invalid literal"),
}


@pytest.mark.parametrize("case", list(BREAKS))
def test_a_broken_orchestrator_checkpoint_is_one_line_naming_it(tmp_path, case):
    orch = Orchestrator(config(tmp_path, sampler="difficulty_pool"))
    orch.curriculum.start(NUM_EXAMPLES)
    orch._save_checkpoint(2)
    path = orch.run_dir.orchestrator_checkpoint(2) / "progress.json"
    text, reason = BREAKS[case]
    path.write_text(text)
    with pytest.raises(UnreadableFile) as e:
        orch._load_checkpoint(2)
    assert str(e.value).startswith(f"{path}: unreadable orchestrator checkpoint ({reason}"), str(e.value)
    assert "\n" not in str(e.value) and orch.start_step == 0


def test_a_broken_curriculum_state_is_one_line_naming_it(tmp_path):
    c = config(tmp_path, sampler="difficulty_pool")
    orch = Orchestrator(c)
    orch.curriculum.start(NUM_EXAMPLES)
    orch._save_checkpoint(1)
    path = orch.run_dir.orchestrator_checkpoint(1) / "curriculum.json"
    path.write_text(path.read_text()[:40])
    resumed = c.model_copy(update={"ckpt": c.ckpt.model_copy(update={"resume_step": 1})})
    with pytest.raises(UnreadableFile, match=rf"^{path}: unreadable curriculum checkpoint \(JSONDecodeError: "):
        Curriculum(resumed, NUM_EXAMPLES)


@pytest.mark.integration
def test_a_start_that_fails_after_the_env_servers_are_up_stops_them(tmp_path, tiny_model, torch_server):
    """The orchestrator's start-up failing once its env servers run (here: its checkpoint does not read back; under
    `rl`, weights of the resume step that inference refused) used to leave them running: the process said its one
    line, then waited at exit for them forever, its heartbeat still beating, and `rl` with it."""
    import asyncio
    import multiprocessing

    from prime_core.io import mark_stable
    from prime_core.run_dir import RunDir

    from tests.orchestrator.test_integration import make_config

    config = make_config(tmp_path, tiny_model, torch_server, max_steps=3, ckpt={"interval": 1, "resume_step": 2})
    broken = RunDir(tmp_path).orchestrator_checkpoint(2)
    broken.mkdir(parents=True)
    (broken / "progress.json").write_text("{")
    mark_stable(broken)
    before = set(multiprocessing.active_children())
    orch = Orchestrator(config)
    try:
        with pytest.raises(UnreadableFile, match="unreadable orchestrator checkpoint"):
            asyncio.run(orch.run())
        left = set(multiprocessing.active_children()) - before
    finally:
        for child in set(multiprocessing.active_children()) - before:
            child.kill()  # what the fix does not stop would hold this test process at its exit
    assert left == set()
