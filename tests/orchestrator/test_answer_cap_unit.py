"""``answer_cap`` in-process: an episode head past the bound fails its rollout in one line naming the env and the
size, one within it passes unchanged (the 100 MB ``info`` and the unpackable trace run a real env server:
tests/orchestrator/test_answer_cap.py)."""

from __future__ import annotations

import asyncio


def test_an_episode_head_past_the_bound_fails_the_rollout_in_one_line(monkeypatch):
    from prime_orchestrator.answer_cap import install
    from verifiers.v1.serve import delta, server
    from verifiers.v1.serve.types import RunResponse

    heads = {"small": {"task": "t" * 100}, "big": {"task": "t" * 3_000_000}}

    async def fake_run(self, req, client_id, request_id):
        return RunResponse(head=heads[req])

    monkeypatch.setattr(server.EnvServer, "_run", fake_run)  # undone after the test, with what install wraps
    monkeypatch.setattr(delta.DeltaStreamer, "diff", delta.DeltaStreamer.diff)
    install(2_000_000, "vf-big")
    small = asyncio.run(server.EnvServer._run(None, "small", b"", b""))
    big = asyncio.run(server.EnvServer._run(None, "big", b"", b""))
    assert small.success and small.head == heads["small"]
    assert not big.success and big.head is None
    assert big.error == "env vf-big: the rollout's episode head is 3.0 MB, over recovery.max_answer_mb = 2 MB"
