"""A symlink where a run publishes a directory (``weights/step_N``), planted by someone who can write to a shared run
directory or copied along with a run: publishing over it, or deleting it as an old step, must act on the link, never
on what it points at outside the run."""

from prime_core.io import atomic_dir, is_stable, remove_published


def _victim(tmp_path):
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    (victim / "STABLE").write_text("theirs\n")
    (victim / "precious").write_text("keep")
    return victim


def _untouched(victim):
    assert sorted(p.name for p in victim.iterdir()) == ["STABLE", "precious"]
    assert (victim / "STABLE").read_text() == "theirs\n" and (victim / "precious").read_text() == "keep"


def test_publishing_over_a_planted_link_replaces_the_link_and_leaves_its_target(tmp_path):
    victim = _victim(tmp_path)
    step = tmp_path / "run" / "weights" / "step_1"
    step.parent.mkdir(parents=True)
    step.symlink_to(victim)
    with atomic_dir(step) as tmp:
        (tmp / "model.safetensors").write_text("new")
    assert not step.is_symlink() and is_stable(step) and (step / "model.safetensors").read_text() == "new"
    _untouched(victim)


def test_publishing_over_a_dangling_link_replaces_it(tmp_path):
    step = tmp_path / "step_1"
    step.symlink_to(tmp_path / "nowhere")
    with atomic_dir(step) as tmp:
        (tmp / "x").write_text("new")
    assert not step.is_symlink() and (step / "x").read_text() == "new"
    assert not (tmp_path / "nowhere").exists()


def test_removing_an_old_step_that_is_a_link_removes_the_link_alone(tmp_path):
    victim = _victim(tmp_path)
    step = tmp_path / "step_0"
    step.symlink_to(victim)
    remove_published(step)
    assert not step.exists() and not step.is_symlink()
    _untouched(victim)
