"""`rl --resume` with other settings than the stopped run's: ``async_level``, the orchestrator's batch size and the
trainer's world size (CPU trainer processes) all changed at once, each way. The trainer's DCP checkpoint reshards to
the new world size (its RNG state is per rank: not restored, with a warning), the orchestrator's checkpoint holds its
data cursors (per group, so another batch size draws on from where the stopped run was) and the weight steps it may
use are derived from the new ``async_level`` (weights of the checkpoint's step are on disk, and every resumed step may
use them). The run continues to its last step, each resumed step's rollouts sampled within the new staleness bound,
drawn at the new batch size and split over the new ranks."""

from __future__ import annotations

import pytest
from prime_core.schemas import read_microbatches

from tests.e2e.test_reverse_text import metrics, run_rl, without_evals

pytestmark = [
    pytest.mark.slow,
    pytest.mark.integration,
    pytest.mark.xdist_group("multiprocess"),
    pytest.mark.timeout(2400),
]


def settings(async_level: int, batch_size: int, ranks: int) -> list[str]:
    return ["--async-level", str(async_level), "--orchestrator.batch-size", str(batch_size),
            "--devices.num-cpu-trainer-procs", str(ranks), "--ckpt.interval", "1"]  # fmt: skip


@pytest.mark.parametrize(
    ("before", "after"), [((1, 16, 1), (0, 32, 2)), ((0, 32, 2), (2, 16, 1))], ids=["lower-async", "higher-async"]
)
def test_resume_with_other_async_level_batch_size_and_trainer_ranks_continues_within_the_new_bound(
    tmp_path, before, after
):
    out, config = tmp_path / "run", without_evals(tmp_path)
    # Every group trains (none dropped for a zero advantage), so the samples trained count the batch size.
    config.write_text(config.read_text() + "\n[orchestrator.filters]\nzero_advantage_groups = false\n")
    run_rl(out, "--max-steps", "2", *settings(*before), config=config)
    result = run_rl(out, "--max-steps", "4", *settings(*after), "--resume", config=config)
    assert "rl: resuming from step 2" in result.stdout, result.stdout[-2000:]
    assert sorted(metrics(out, "trainer", "loss/mean")) == [0, 1, 2, 3]
    lag = metrics(out, "orchestrator", "off_policy_lag/max")
    assert lag[0] <= before[0] and lag[1] <= before[0], lag
    assert lag[2] <= after[0] and lag[3] <= after[0], lag
    trained = metrics(out, "orchestrator", "samples/trained")
    assert all(0 < trained[s] <= before[1] for s in (0, 1)) and all(0 < trained[s] <= after[1] for s in (2, 3))
    if after[1] > before[1]:
        assert max(trained[2], trained[3]) > before[1], trained
    for step in (2, 3):
        for rank in range(after[2]):
            _, micro_batches = read_microbatches(out / "rollouts" / f"step_{step}" / f"rank_{rank}.safetensors")
            assert sum(int(mb.loss_mask.any(axis=-1).sum()) for mb in micro_batches) > 0
    assert (out / "weights" / "step_4" / "STABLE").exists()
