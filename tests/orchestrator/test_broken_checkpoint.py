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


def curriculum_resumed_from(tmp_path, difficulty: list) -> tuple[Curriculum | None, str]:
    """A curriculum resumed from a checkpoint whose difficulty table is ``difficulty`` (the taskset of
    ``NUM_EXAMPLES``), and the path of its state file."""
    import json

    c = config(tmp_path, sampler="difficulty_pool")
    orch = Orchestrator(c)
    orch.curriculum.start(NUM_EXAMPLES)
    orch._save_checkpoint(1)
    path = orch.run_dir.orchestrator_checkpoint(1) / "curriculum.json"
    state = json.loads(path.read_text())
    path.write_text(json.dumps({**state, "difficulty": difficulty}))
    resumed = c.model_copy(update={"ckpt": c.ckpt.model_copy(update={"resume_step": 1})})
    return Curriculum(resumed, NUM_EXAMPLES), str(path)


@pytest.mark.parametrize("example", [40, -1])
def test_a_curriculum_state_of_examples_past_the_taskset_is_one_line_naming_it(tmp_path, example):
    """A taskset that shrank since the checkpoint (40 examples here): example 40 was an IndexError at the first draw,
    a traceback mid-run; example -1 silently weighted the last example."""
    path = tmp_path / "checkpoints" / "step_1" / "orchestrator" / "curriculum.json"
    with pytest.raises(UnreadableFile) as e:
        curriculum_resumed_from(tmp_path, [["easy", 3, "agent", 0.5, 1], ["easy", example, "agent", 0.5, 1]])
    assert str(e.value) == (
        f"{path}: unreadable curriculum checkpoint (ValueError: example {example} of env 'easy' is not one of its 40 "
        "examples: the taskset changed since the checkpoint (remove curriculum.json to start the curriculum from "
        "scratch))"
    )


def test_scores_of_envs_no_longer_drawn_and_non_finite_means_are_left_out_on_resume(tmp_path):
    """A NaN mean (as runs before the finite means wrote) pinned its example to the last pool for the rest of the run;
    an env dropped from the mix counted its examples as seen in ``curriculum/pool/unseen``."""
    cur, _ = curriculum_resumed_from(tmp_path, [["easy", 3, "agent", 0.5, 2], ["easy", 4, "agent", float("nan"), 2],
                                                ["gone", 99, "agent", 0.5, 1]])  # fmt: skip
    assert cur.difficulty == {("easy", 3, "agent"): (0.5, 2)}
