"""A reward that puts 100 MB in ``trace.info`` (``vf-faults``' ``blob``): the env server drops that field past
``recovery.max_answer_mb`` before it sends it, so it never reaches the orchestrator; the rollout is scored as played,
the drop is counted and logged once per env server."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.fixtures.models import build_tool_tokenizer, save_tiny_model
from tests.fixtures.scripted import ScriptedServer
from tests.fixtures.vf import use_vf_envs
from tests.orchestrator.test_hostile_tool_output import PeakRss, rss_mib, started_runner

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = save_tiny_model(tmp_path_factory.mktemp("blob_model"), build_tool_tokenizer())
    srv = ScriptedServer(model, lambda prompt: "done")
    yield srv
    srv.stop()


async def _run(server, faults: str, examples: int):
    import os

    env = {"id": "vf-faults", "args": {"faults": faults, "every": 2}}
    async with started_runner(server, env, max_tokens=8) as (runner, rollout):
        await rollout(1)  # a plain task: loads what any first rollout costs
        base = rss_mib(os.getpid())
        with PeakRss(os.getpid()) as rss:
            results = await asyncio.gather(*(rollout(2 * i) for i in range(examples)))  # every one a blob
        return results, base, rss.peak, runner.server


def test_100_mb_in_a_traces_info_is_dropped_in_the_env_server_and_counted(server, monkeypatch, caplog):
    use_vf_envs(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="prime.orchestrator.env"):
        results, base, peak, env_server = asyncio.run(_run(server, "blob", 4))
    print(f"orchestrator RSS {base} MiB -> peak {peak} MiB with 4 rollouts of 100 MB info in flight")
    assert [r.failed for r in results] == [False] * 4, [r.error for r in results]
    assert env_server.num_dropped_fields == 4
    # unbounded, each 100 MB info crossed whole: the orchestrator's peak rose by 382 MiB for four of them (956 -> 1338)
    assert peak - base < 100, (base, peak)
    lines = [r.getMessage() for r in caplog.records if "was dropped" in r.getMessage()]
    assert len(lines) == 1 and "env vf-faults: a trace's info of 100.0 MB was dropped" in lines[0], lines


def test_a_trace_that_cannot_be_serialised_fails_its_rollout_in_one_line_per_cause(server, monkeypatch, capfd):
    """A lock in ``trace.info`` (``vf-faults``' ``unserial``): before, each such rollout put two or three tracebacks in
    the env server's log (6 for 3 rollouts); now the first is one line, the rest are counted."""
    from multiprocessing import forkserver

    use_vf_envs(monkeypatch)
    # The env server writes to the stderr of the forkserver it forks from: one started under this test's capture.
    forkserver._forkserver._stop()
    results, _, _, env_server = asyncio.run(_run(server, "unserial", 3))
    out = capfd.readouterr()
    log = out.out + out.err
    assert [r.failed for r in results] == [True] * 3
    cause = "env vf-faults: the rollout's answer cannot be sent: PydanticSerializationError: Unable to serialize"
    assert all(cause in r.error for r in results), [r.error for r in results]
    assert log.count("Traceback") == 0, log
    assert sum(cause in line and "later rollouts failing so" in line for line in log.splitlines()) == 1, log
    assert env_server.num_unsendable == 3
