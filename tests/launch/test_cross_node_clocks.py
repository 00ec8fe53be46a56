"""A process on another node whose wall clock disagrees with the launcher's (no NTP, a VM resumed, an admin's
`date -s` there): its heartbeats carry that node's monotonic time and boot id, and the watchdog measures their age on
both nodes' monotonic clocks, so an hour of skew neither kills a healthy run nor hides a stopped process."""

from __future__ import annotations

import pytest
from prime_core.config.liveness import LivenessConfig
from prime_core.schemas.progress import Activity, Progress
from prime_launch.watchdog import ProcessStuck, Watchdog

SLACK = 10.0


class Clocks:
    """The launcher's wall and monotonic clocks, and the other node's, which runs ``skew`` seconds off in wall time
    and counts its monotonic time from its own boot."""

    def __init__(self, skew: float):
        self.skew = skew
        self.steady_now = 100.0  # the launcher's monotonic clock
        self.wall_now = 1_000_000.0
        self.remote_started = self.wall_now + skew - 5.0  # the writer's start, on its own wall clock

    def wall(self) -> float:
        return self.wall_now

    def steady(self) -> float:
        return self.steady_now

    def advance(self, seconds: float) -> None:
        self.steady_now += seconds
        self.wall_now += seconds

    def remote(self) -> tuple[float, float]:
        """(wall, monotonic) on the other node now."""
        return self.wall_now + self.skew, self.steady_now + 7_000.0


def heartbeat(path, clocks: Clocks, process: str = "trainer", activities: list[Activity] = ()) -> None:
    wall, mono = clocks.remote()
    record = Progress(process=process, pid=4242, host="node-2", started=clocks.remote_started, time=wall, monotonic=mono,
                      boot_id="boot-of-node-2", run_id="run", activities=list(activities))  # fmt: skip
    path.write_text(record.model_dump_json())


def launcher(tmp_path, clocks: Clocks) -> Watchdog:
    config = LivenessConfig(slack_s=SLACK, startup_s=30)
    dog = Watchdog(config, run_id="run", clock=clocks.wall, steady=clocks.steady)
    dog.watch("trainer", [tmp_path / "trainer.json"], tmp_path / "trainer.log")
    return dog


def check(dog: Watchdog) -> None:
    dog._last_check = None
    dog.check()


@pytest.mark.parametrize("skew", [-3600.0, -45.0, 45.0, 3600.0])
def test_a_healthy_process_on_a_skewed_node_runs_on_and_a_stopped_one_is_named_after_the_slack(tmp_path, skew):
    clocks = Clocks(skew)
    dog = launcher(tmp_path, clocks)
    for _ in range(120):  # two minutes of heartbeats a second, longer than the start-up allowance and the slack
        heartbeat(tmp_path / "trainer.json", clocks)
        check(dog)
        clocks.advance(1.0)
    # The trainer stops writing (SIGSTOP, a hung node): named one slack later, whichever way its clock is off.
    clocks.advance(SLACK - 2)
    check(dog)
    clocks.advance(2.5)
    with pytest.raises(ProcessStuck, match=r"trainer sent no heartbeat for 1[12] s \(pid 4242 on node-2\)"):
        check(dog)


@pytest.mark.parametrize("skew", [-3600.0, 3600.0])
def test_an_activity_on_a_skewed_node_is_timed_on_its_own_clock(tmp_path, skew):
    clocks = Clocks(skew)
    dog = launcher(tmp_path, clocks)
    for second in range(60):
        step = Activity(what="computing step 3", kind="step", since=clocks.remote()[0] - second, limit_s=40.0,
                        for_s=float(second))  # fmt: skip
        heartbeat(tmp_path / "trainer.json", clocks, activities=[step])
        if second <= 40 + SLACK:
            check(dog)
        else:
            with pytest.raises(ProcessStuck, match=r"has been computing step 3 for 5[1-9] s, past its bound of 40 s"):
                check(dog)
            return
        clocks.advance(1.0)
    raise AssertionError("the overdue step was never named")


@pytest.mark.parametrize("skew", [-3600.0, 3600.0])
def test_a_process_already_stopped_when_the_watch_begins_is_named_within_the_startup_allowance(tmp_path, skew):
    """`prime-launch watch` started beside a run whose trainer stopped long ago: a record from a node whose clock
    disagrees tells neither its age nor whether an earlier launch left it, until its writer writes again; a writer that
    never does is named by the start-up allowance at the latest."""
    clocks = Clocks(skew)
    heartbeat(tmp_path / "trainer.json", clocks)
    clocks.advance(500.0)
    dog = launcher(tmp_path, clocks)
    check(dog)
    clocks.advance(31.0)
    with pytest.raises(ProcessStuck, match="trainer (sent no heartbeat for 31 s|is stuck: it wrote no heartbeat to)"):
        check(dog)
