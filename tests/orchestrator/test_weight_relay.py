"""The orchestrator relays weights by the manifest's retry semantics: what a directory holds is retried, a one-time
transfer it announces is asked for once (the sender sends once; a retried request would wait for nothing)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from prime_core.io import mark_stable
from prime_core.schemas.weights import BroadcastManifest, write_manifest
from prime_orchestrator import client


async def _failing_server(seen: list[dict]) -> tuple[web.AppRunner, str]:
    async def update(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"error": {"message": "busy"}}, status=503)

    return await _update_server(update)


async def _update_server(update) -> tuple[web.AppRunner, str]:
    """A stand-in inference server answering /update_weights with ``update``; (its runner, its URL)."""
    app = web.Application()
    app.router.add_post("/update_weights", update)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


def _relay(weight_dir, source: str = "auto") -> list[dict]:
    async def main() -> list[dict]:
        seen: list[dict] = []
        runner, url = await _failing_server(seen)
        try:
            with pytest.raises(client.WeightUpdateError, match=f"inference server {url} failed to load weights step 4"):
                await client.update_weights(
                    [url], str(weight_dir), 4, api_key=None, timeout=5, retries=2, source=source
                )
        finally:
            await runner.cleanup()
        return seen

    return asyncio.run(main())


def test_files_are_retried_and_a_broadcast_is_asked_for_once(tmp_path):
    files, broadcast = tmp_path / "files", tmp_path / "broadcast"
    files.mkdir()
    broadcast.mkdir()
    write_manifest(broadcast, BroadcastManifest(step=4, host="h", port=1, world_size=2, backend="gloo", timeout_s=1))
    for d in (files, broadcast):
        mark_stable(d)
    assert len(_relay(files)) == 3
    assert len(_relay(broadcast)) == 1
    # Re-serving a checkpoint step from its files (resume) may be retried again.
    seen = _relay(broadcast, source="filesystem")
    assert len(seen) == 3 and {s["source"] for s in seen} == {"filesystem"}


def test_a_permanent_fault_is_not_retried_and_a_busy_server_is(tmp_path):
    """A 503 the server marks permanent (its engine died: nothing changes until a restart) ends the relay at the
    first answer; a plain 503 (busy, not ready) is still retried. Before, both were asked 4 times over 3.5 s."""
    from prime_core.schemas.errors import PERMANENT, PERMANENT_FAULT_HEADER

    async def main(permanent: bool) -> tuple[list[dict], str]:
        seen: list[dict] = []

        async def update(request: web.Request) -> web.Response:
            seen.append(await request.json())
            if not permanent and len(seen) == 3:
                return web.json_response({"status": "ok", "weight_step": 4})
            headers = {PERMANENT_FAULT_HEADER: PERMANENT} if permanent else {}
            return web.json_response({"error": {"message": "engine 0 died"}}, status=503, headers=headers)

        runner, url = await _update_server(update)
        try:
            await client.update_weights([url], str(tmp_path), 4, api_key=None, timeout=5, retries=3)
        except client.WeightUpdateError as e:
            return seen, str(e)
        finally:
            await runner.cleanup()
        return seen, ""

    mark_stable(tmp_path)
    seen, error = asyncio.run(main(permanent=True))
    assert len(seen) == 1 and error.endswith("/update_weights -> 503: engine 0 died (permanent: not retried)")
    seen, error = asyncio.run(main(permanent=False))
    assert len(seen) == 3 and error == ""


def test_a_bad_manifest_fails_before_any_request(tmp_path):
    (tmp_path / "broadcast.json").write_text("{")
    with pytest.raises(client.WeightUpdateError, match="weights step 4 .* cannot be relayed: .*broadcast.json"):
        asyncio.run(client.update_weights(["http://127.0.0.1:9"], str(tmp_path), 4, api_key=None, timeout=1, retries=2))


def test_a_policy_wait_cancelled_as_its_weights_arrive_is_cancelled(tmp_path):
    """Python 3.11's wait_for returned the served version instead of raising when the cancel met weights that had
    just arrived: a rollout loop waiting for them swallowed its cancel and lived on (the continuous one forever,
    waiting for groups nobody dispatched, so asyncio.run never exited). Every turn of that window is tried."""
    from prime_core.config.orchestrator import OrchestratorConfig
    from prime_core.run_dir import RunDir
    from prime_orchestrator.weight_relay import Policy

    async def main():
        policy = Policy(OrchestratorConfig(), RunDir(tmp_path))
        for turns in range(6):
            waiter = asyncio.create_task(policy.wait_for(policy.version + 1, 5))
            await asyncio.sleep(0.01)
            async with policy._changed:  # what `load` does once inference serves the new weights
                policy.version += 1
                policy._changed.notify_all()
            for _ in range(turns):
                await asyncio.sleep(0)
            if not waiter.cancel():
                continue  # it had returned already: nothing to swallow
            done, _ = await asyncio.wait({waiter}, timeout=2)
            assert done == {waiter}
            assert waiter.cancelled(), f"the cancel {turns} turn(s) after the weights arrived was swallowed"

    asyncio.run(main())


def test_the_continuous_loop_ends_when_cancelled_as_the_weights_it_waits_for_arrive(tmp_path):
    """What the swallowed cancel did: the loop went on to form the batch, the dispatcher (cancelled only by the
    loop's own finally) started groups for it, and the loop waited for them forever."""
    from prime_core.run_dir import RunDir
    from prime_orchestrator.continuous import Continuous
    from prime_orchestrator.weight_relay import Policy

    from tests.orchestrator.test_continuous import ScriptedOrchestrator

    async def main():
        orch = ScriptedOrchestrator()
        orch.start_step = 2  # a resumed run: batch 2 waits for weights 1 (async_level 1)
        orch.policy = Policy(orch.config, RunDir(tmp_path))
        cont = orch.cont = Continuous(orch)
        loop = asyncio.create_task(cont.rollout_loop(asyncio.Queue()))
        await asyncio.sleep(0.05)
        async with orch.policy._changed:  # what `load` does once inference serves weights 1
            orch.policy.version = 1
            orch.policy._changed.notify_all()
        for listener in orch.policy.listeners:
            listener()
        loop.cancel()
        done, _ = await asyncio.wait({loop}, timeout=2)
        assert done == {loop} and loop.cancelled(), "the rollout loop swallowed its cancel and lives on"
        await asyncio.sleep(0)  # its finally cancelled the dispatcher and the groups
        assert cont.dispatcher.done() and all(r.task.done() for r in cont.running.values())

    asyncio.run(main())


def test_a_server_that_answers_another_step_than_asked_fails_the_update(tmp_path):
    """The relay counts rollouts' versions from what the servers serve: an answer naming another step (an engine that
    ignored the step, a stale proxy) is a failure naming the server and both steps, not a silent success."""

    async def main():
        async def update(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "weight_step": 0})

        runner, url = await _update_server(update)
        try:
            with pytest.raises(client.WeightUpdateError, match=f"inference server {url} serves weights step 0 after "
                               "loading step 4"):  # fmt: skip
                await client.update_weights([url], str(tmp_path), 4, api_key=None, timeout=5, retries=2)
        finally:
            await runner.cleanup()

    mark_stable(tmp_path)
    asyncio.run(main())


def test_nan_weights_fail_the_relay_in_one_line_and_the_server_keeps_step_0(tmp_path, tiny_model, torch_server):
    """Weights with NaN were served (every sampled token 0, /health at the new step) and the relay reported success;
    now the update fails at once (a 400 is not retried) in one line naming the server, the step and the tensor, and
    the server still serves and reports the step it served before."""
    import time

    import httpx
    import torch
    from prime_core.config.orchestrator import OrchestratorConfig
    from prime_core.run_dir import RunDir
    from prime_orchestrator.weight_relay import Policy
    from safetensors.torch import load_file, save_file

    from tests.orchestrator.conftest import publish_weights

    publish_weights(tmp_path, 1, tiny_model)
    step_dir = tmp_path / "weights" / "step_1"
    file = next(step_dir.glob("*.safetensors"))
    state = load_file(file)
    state["lm_head.weight"] = torch.full_like(state["lm_head.weight"], float("nan"))
    save_file(state, file, metadata={"format": "pt"})
    config = OrchestratorConfig.model_validate(
        {"output_dir": str(tmp_path), "client": {"base_urls": [torch_server.url], "max_retries": 3}}
    )
    policy = Policy(config, RunDir(tmp_path))
    served = httpx.get(f"{torch_server.url}/health").json()["weight_step"]  # the shared server: another test's step
    t0 = time.monotonic()
    with pytest.raises(client.WeightUpdateError) as failed:
        asyncio.run(policy.load(1))
    line = str(failed.value)
    assert "\n" not in line and time.monotonic() - t0 < 10
    assert f"inference server {torch_server.url} failed to load weights step 1" in line
    assert "lm_head.weight holds NaN or infinite values" in line
    assert policy.version == 0 and httpx.get(f"{torch_server.url}/health").json()["weight_step"] == served
