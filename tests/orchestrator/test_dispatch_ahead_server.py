"""``dispatch_ahead`` sends step n's requests before weights n - async_level serve and relies on the inference server
to hold each one until they do (``extra_args.prime_min_weight_step``, prime's server). A server that ignores the field
samples at once with older weights; without a version ledger nothing says so, and the rollout was counted as sampled
with the weights it asked for: the off-policy bound sidestepped, unseen."""

from __future__ import annotations

import asyncio

import pytest
from prime_core.io import one_line

from tests.orchestrator import test_hostile_inference as hostile
from tests.orchestrator.test_hostile_inference import FakeServer, env_worker_http  # noqa: F401


def orchestrator(tmp_path, server: FakeServer, **config):
    """The hostile-inference tests' orchestrator (async_level 1) with these top-level config fields."""
    orch = hostile.orchestrator(tmp_path, server)
    from prime_orchestrator.orchestrator import Orchestrator

    pools, monitor, sender = orch.pools, orch.monitor, orch.sender
    orch = Orchestrator(orch.config.model_copy(update=config))
    orch.pools, orch.monitor, orch.sender = pools, monitor, sender
    return orch


def test_a_server_without_a_version_ledger_under_dispatch_ahead_ends_the_run_naming_it(tmp_path):
    """Before: the server answered at once with weights step 0 for a rollout held for step 1; the rollout was recorded
    as sampled with step 1 (``weight_step`` 1, versions 1..0) and trained one step past ``async_level``."""
    from prime_orchestrator.client import WeightUpdateError

    async def main():
        server = await FakeServer().start()  # versions None: /rollout_versions is a 404, as on a non-prime server
        orch = orchestrator(tmp_path, server, dispatch_ahead=True)
        try:
            return await orch._rollout(2, "reverse-text", 0, 0, 0)  # step 2 waits for weights 1; 0 serve
        finally:
            await orch.versions.close()
            await server.stop()

    with pytest.raises(WeightUpdateError) as e:
        asyncio.run(main())
    message = str(e.value)
    assert message.startswith("inference server http://127.0.0.1:")
    assert one_line(message) == message and "dispatch_ahead" in message and "keeps no version record" in message


def test_a_server_without_a_version_ledger_is_still_served_without_dispatch_ahead(tmp_path):
    """Without dispatch_ahead a request goes out on the served weights: the relay's bounds hold (a warning says so)."""

    async def main():
        server = await FakeServer().start()
        orch = orchestrator(tmp_path, server)
        try:
            return await orch._rollout(1, "reverse-text", 0, 0, 0)
        finally:
            await orch.versions.close()
            await server.stop()

    rollout = asyncio.run(main())
    assert not rollout.result.failed and rollout.weight_step == 0
    assert (rollout.result.versions.first, rollout.result.versions.exact) == (0, False)
