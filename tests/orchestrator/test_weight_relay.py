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


def test_a_bad_manifest_fails_before_any_request(tmp_path):
    (tmp_path / "broadcast.json").write_text("{")
    with pytest.raises(client.WeightUpdateError, match="weights step 4 .* cannot be relayed: .*broadcast.json"):
        asyncio.run(client.update_weights(["http://127.0.0.1:9"], str(tmp_path), 4, api_key=None, timeout=1, retries=2))
