"""``answer_cap`` in-process: an episode head past the bound fails its rollout in one line naming the env and the
size, one within it passes unchanged (the 100 MB ``info`` and the unpackable trace run a real env server:
tests/orchestrator/test_answer_cap.py)."""

from __future__ import annotations

import asyncio

import pytest


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


def _serve(monkeypatch, play, max_bytes: int = 2_000_000):
    """A rollout whose trace ``play(trace)`` fills, served through ``answer_cap``'s wrappers of verifiers' streamer and
    run: ``(response, deltas sent, bytes sent, the trace the orchestrator assembles or None)``."""
    from prime_orchestrator.answer_cap import install
    from verifiers.v1.configs.agent import AgentConfig
    from verifiers.v1.serve import delta, server
    from verifiers.v1.serve.types import RunResponse
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask

    trace = Trace(task=TraceTask(type="T", data={"q": "x"}), agent=AgentInfo(config=AgentConfig()))
    sent: list[dict] = []

    async def send(d):
        sent.append(delta.unpack(delta.pack(d)))

    async def fake_run(self, req, client_id, request_id):
        async with delta.DeltaStreamer(lambda: [trace], send) as streamer:
            streamer.watch(trace)
            await streamer.flush()
            play(trace)
            trace.notify()
        return RunResponse(head={"id": "e", "ok": True}, traces=[])

    monkeypatch.setattr(server.EnvServer, "_run", fake_run)  # undone after the test, with what install wraps
    monkeypatch.setattr(delta.DeltaStreamer, "diff", delta.DeltaStreamer.diff)
    install(max_bytes, "vf-big")
    response = asyncio.run(server.EnvServer._run(None, None, b"", b""))
    assembly = delta.EpisodeAssembly()
    for d in sent:
        assembly.apply(d)
    assembled = Trace.model_validate(assembly.traces[trace.id]) if response.success else None
    return response, sent, sum(len(delta.pack(d)) for d in sent), assembled


def test_errors_past_the_bound_are_dropped_in_the_env_server_and_counted(monkeypatch, caplog):
    """A reward that records 5 MB of errors (50 of 100 KB): they crossed the wire whole; now what fits 2 MB is sent,
    one marker stands for the rest, and the orchestrator counts it; the rollout is scored as played."""
    import logging

    from prime_core.schemas.rollout import EnvServerSpec
    from prime_orchestrator.env_server import EnvServer
    from verifiers.v1.trace import Error, Reward

    def play(trace):
        trace.rewards["correct"] = Reward(score=1.0)
        for i in range(50):
            trace.errors.append(Error(type="ValueError", message=f"{i} " + "e" * 100_000))

    response, _, size, trace = _serve(monkeypatch, play)
    print(f"bytes sent: {size}")
    assert response.success and size < 2_200_000, size  # 5_105_xxx before
    env_server = EnvServer(EnvServerSpec(name="vf-big", env_config={}, max_answer_bytes=2_000_000))
    with caplog.at_level(logging.WARNING, logger="prime.orchestrator.env"):
        env_server._note_dropped(type("Episode", (), {"traces": [trace]})())
    assert env_server.num_dropped_fields == 1 and trace.reward == 1.0
    assert 0 < len(trace.errors) < 20 and all(e.type == "ValueError" for e in trace.errors)
    assert "env vf-big: a trace's errors of 5.0 MB was dropped" in caplog.text


from verifiers.v1.trace import InterceptRecord  # noqa: E402


@pytest.mark.parametrize(
    "field, play",
    [
        ("rewards", lambda t: t.rewards.update({f"r{i:06d}": {"score": 1.0} for i in range(100_000)})),
        ("stop_condition", lambda t: setattr(t, "stop_condition", "s" * 3_000_000)),
        ("response_rewrites", lambda t: t.response_rewrites.extend([InterceptRecord(handler="h" * 1000)] * 3000)),
    ],
)
def test_a_field_that_scores_or_shapes_the_rollout_past_the_bound_fails_it_in_one_line(monkeypatch, field, play):
    """100,000 reward names (3 MB) or a 3 MB stop condition crossed whole; dropped, the rollout would train on a
    wrong reward (or mask): it fails, naming the env, the field and the size, and the field never leaves."""
    from verifiers.v1.trace import Reward

    def fill(trace):
        trace.rewards["correct"] = Reward(score=1.0)
        play(trace)

    response, _, size, _ = _serve(monkeypatch, fill)
    print(f"bytes sent: {size}")
    assert not response.success and size < 100_000, size
    assert response.error.startswith(f"env vf-big: the rollout's trace {field} is ")
    assert response.error.endswith(" MB, over recovery.max_answer_mb = 2 MB"), response.error
