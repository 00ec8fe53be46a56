"""A broken or hostile inference server: a fake one on 127.0.0.1 answers the token-in route ``/inference/v1/generate``
(and ``/health``, ``/rollout_versions``) the way ``prime_inference.routes.generate`` does, but wrong. Each answer must
end in a failed rollout whose one-line reason names the server and what was wrong, or in a one-line error, within a
bound; the packed micro-batch and the step's metrics never hold such a value.

The rollouts go through the train client's own request code (``renderers.client.generate`` over the HTTP client the
env server's workers use, `prime_orchestrator.http_pool`); a stand-in runner turns the answer into the trained
sequence as verifiers records it (prompt, then the sampled tokens with their log-probs), so the whole orchestrator
side (screening, advantages, packing, metrics) runs as in a real step without an env server."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiohttp import web
from prime_core.config.orchestrator import ClientConfig, OrchestratorConfig
from prime_core.io import one_line
from prime_core.monitor import read_metrics
from prime_core.schemas.microbatch import read_microbatches
from prime_core.schemas.rollout import RolloutResult, TraceResult, TrainedSequence
from prime_orchestrator.metric_keys import MetricKeyCap


@pytest.fixture(autouse=True)
def env_worker_http(monkeypatch):
    """verifiers' clients over the env workers' HTTP client, as `prime_orchestrator.env_server` sets them up."""
    from prime_orchestrator.http_pool import engine_client
    from verifiers.v1.clients import base

    monkeypatch.setattr(base, "build_async_httpx", engine_client)


VOCAB = 100
PROMPT = [1, 2, 3]
MAX_TOKENS = 4


def answer(token_ids: list[Any], logprobs: list[Any] | None = None, finish: str = "stop") -> dict[str, Any]:
    """``/inference/v1/generate``'s body (vLLM 0.26's), with whatever ids and log-probs the test gives."""
    logprobs = [-0.5] * len(token_ids) if logprobs is None else logprobs
    content = [
        {"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": [{"token": f"token_id:{t}", "logprob": lp}]}
        for t, lp in zip(token_ids, logprobs, strict=False)
    ]  # fmt: skip
    return {
        "request_id": "generate-tokens-x",
        "choices": [{"index": 0, "finish_reason": finish, "token_ids": token_ids, "logprobs": {"content": content}}],
        "prompt_token_ids": PROMPT,
    }


class FakeServer:
    """``handler(body) -> web.StreamResponse | dict`` answers generate; ``versions`` (None: 404) the ledger."""

    def __init__(self):
        self.handler = lambda body: answer([5, 6])
        self.versions: dict[str, Any] | None = None
        self.health: Any = {"status": "ok", "weight_step": 0}
        """The /health body, or an async handler of the request."""
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        out = self.handler({**await request.json(), "_request": request})
        if asyncio.iscoroutine(out):
            out = await out
        return web.json_response(out) if isinstance(out, dict) else out

    async def _versions(self, request: web.Request) -> web.StreamResponse:
        if callable(self.versions):
            return await self.versions(request)
        if self.versions is None:
            return web.Response(status=404)
        tags = (await request.json())["tags"]
        return web.json_response({"versions": {t: self.versions for t in tags}})

    async def _health(self, request: web.Request) -> web.StreamResponse:
        if callable(self.health):
            return await self.health(request)
        return web.json_response(self.health)

    async def start(self) -> FakeServer:
        app = web.Application(client_max_size=2**20)
        app.router.add_post("/inference/v1/generate", self._generate)
        app.router.add_post("/rollout_versions", self._versions)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()


class StubRenderer:
    def get_stop_token_ids(self) -> list[int]:
        return [0]

    def parse_response(self, token_ids, **kwargs):
        from renderers.base import ParsedResponse

        return ParsedResponse(content=" ".join(map(str, token_ids)), reasoning_content=None, reasoning_complete=None)


class Runner:
    """A stand-in `EnvRunner`: one turn through the train client's request code; a raise is a failed rollout, as
    `EnvRunner.rollout` makes it."""

    def __init__(self, name: str):
        self.name = name
        self.num_retries = 0
        self.server = type("S", (), {"num_restarts": 0, "num_dropped_fields": 0, "num_unsendable": 0})()
        self.metric_keys = MetricKeyCap()

    async def rollout(self, example: int, *, client: Any, model: str, sampling: dict[str, Any]) -> RolloutResult:
        from renderers.client import generate
        from verifiers.v1.clients.base import build_async_openai

        params = {k: v for k, v in sampling.items() if k != "extra_args"}
        try:
            openai = build_async_openai(client)
            try:
                result = await generate(client=openai, renderer=StubRenderer(), messages=[], model=model,
                                        prompt_ids=PROMPT, sampling_params=params, max_prompt_len=64)  # fmt: skip
            finally:
                await openai.close()
            ids, lps = result["completion_ids"], result["completion_logprobs"]
            seq = TrainedSequence(
                token_ids=PROMPT + ids, loss_mask=[False] * 3 + [True] * len(ids), logprobs=[0.0] * 3 + lps
            )
            trace = TraceResult(seat="a", reward=float(example % 2), sequences=[seq])
            return RolloutResult(
                env=self.name, example=example, traces=[trace], reward=trace.reward, completion_len=len(ids)
            )
        except Exception as e:  # noqa: BLE001 - as EnvRunner.rollout
            return RolloutResult(
                env=self.name, example=example, failed=True, error=one_line(f"{type(e).__name__}: {e}")
            )

    async def close(self) -> None:
        pass


def model_dir(tmp_path):
    path = tmp_path / "model"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return path


def orchestrator(tmp_path, server: FakeServer, **client):
    from prime_core.monitor import build_monitor
    from prime_core.transport import make_sender
    from prime_orchestrator.orchestrator import Orchestrator

    config = OrchestratorConfig.model_validate(
        {"model": {"name": str(model_dir(tmp_path))}, "output_dir": str(tmp_path / "run"), "seq_len": 64,
         "batch_size": 4, "rollouts_per_example": 4, "num_trainer_ranks": 1, "micro_batch_rows": 2,
         "client": {"base_urls": [server.url], "max_concurrent": 4, **client},
         "env": [{"id": "reverse-text"}], "sampling": {"max_tokens": MAX_TOKENS, "temperature": 1.0},
         "filters": {"zero_advantage_groups": False}, "recovery": {"min_ok_fraction": 0.25}}
    )  # fmt: skip
    orch = Orchestrator(config)
    orch.pools = {"reverse-text": Runner("reverse-text")}
    orch.monitor = build_monitor(config.monitor, output_dir=config.output_dir, process="orchestrator", run_config={})
    orch.sender = make_sender(config.transport, orch.run_dir, 1)
    return orch


async def one_step(orch, bad: FakeServer) -> list[RolloutResult]:
    """Step 0 of one group of four rollouts; the 2nd (index 1) gets ``bad``'s answer, the others an honest one."""
    from prime_orchestrator.batch import StepBatch

    honest = bad.handler
    calls = {"n": 0}

    def handler(body):
        calls["n"] += 1
        return honest(body) if calls["n"] == 2 else answer([5, 6])

    bad.handler = handler
    group = await orch._group(0, "reverse-text", 0, 0)
    batch = StepBatch(0, [group], time.perf_counter(), 0.0, finished=time.perf_counter())
    await orch.ship(batch)
    return [r.result for r in group]


# ----- answers the train client lets through: the orchestrator must screen them -----
LET_THROUGH = {
    "positive log-prob": (answer([5, 6], [-0.1, 0.7]), "log-prob 0.7"),
    "negative token id": (answer([5, -3]), "token id -3"),
    "token id past the vocabulary": (answer([5, VOCAB + 7]), f"token id {VOCAB + 7}"),
    "empty completion cut at length": (answer([], finish="length"), "no sampled token in trace 0"),
}


@pytest.mark.parametrize("case", list(LET_THROUGH))
def test_values_no_policy_samples_fail_the_rollout_and_never_reach_the_micro_batch(tmp_path, case):
    body, reason = LET_THROUGH[case]

    async def main():
        server = await FakeServer().start()
        orch = orchestrator(tmp_path, server)
        server.handler = lambda b: body
        try:
            return server.url, await one_step(orch, server), orch
        finally:
            await orch.close()
            await server.stop()

    url, results, orch = asyncio.run(main())
    failed = [r for r in results if r.failed]
    assert len(failed) == 1, [r.error for r in results]
    assert failed[0].error.startswith(f"inference server {url} answered ") and reason in failed[0].error
    assert "\n" not in failed[0].error
    _, micro_batches = read_microbatches(orch.run_dir.rollout_file(0, 0))
    tokens = [t for mb in micro_batches for t in mb.input_ids.ravel().tolist()]
    logprobs = [x for mb in micro_batches for x in mb.inference_logprobs.ravel().tolist()]
    assert tokens and all(0 <= t < VOCAB for t in tokens) and all(x <= 0 for x in logprobs)
    assert 10 not in tokens and 9 not in tokens  # the long turn's tokens
    (metrics,) = [m.values for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "failed/rollouts" in m.values]
    assert metrics["failed/rollouts"] == 1 and metrics["completion_len/mean"] <= MAX_TOKENS


def run_step(tmp_path, handler, **client) -> tuple[str, list[RolloutResult], Any, float]:
    """One step against a server whose 2nd answer is ``handler``'s: its url, the rollouts, the orchestrator, seconds."""

    async def main():
        server = await FakeServer().start()
        orch = orchestrator(tmp_path, server, **client)
        server.handler = handler
        t0 = time.monotonic()
        try:
            results = await one_step(orch, server)
            return server.url, results, orch, time.monotonic() - t0
        finally:
            await orch.close()
            await server.stop()

    return asyncio.run(main())


def assert_clean_step(tmp_path, results: list[RolloutResult]) -> RolloutResult:
    """One rollout failed with a one-line reason; the micro-batch and metrics hold the three honest ones only."""
    failed = [r for r in results if r.failed]
    assert len(failed) == 1, [r.error for r in results]
    assert failed[0].error and "\n" not in failed[0].error and len(failed[0].error) < 600
    _, micro_batches = read_microbatches(tmp_path / "run" / "rollouts" / "step_0" / "rank_0.safetensors")
    sampled = [
        (t, lp)
        for mb in micro_batches
        for t, lp, m in zip(mb.input_ids.ravel(), mb.inference_logprobs.ravel(), mb.loss_mask.ravel(), strict=True)
        if m
    ]
    assert sorted(sampled) == [(5, -0.5)] * 3 + [(6, -0.5)] * 3
    (metrics,) = [m.values for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "failed/rollouts" in m.values]
    assert metrics["failed/rollouts"] == 1
    return failed[0]


def trickle(seconds: float):
    """An honest answer, sent a few bytes at a time over ``seconds``: every read gets bytes within any read timeout."""

    async def handler(body):
        data = json.dumps(answer([5, 6])).encode()
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.content_length = len(data)
        await response.prepare(body["_request"])
        step = max(1, len(data) // 40)
        try:
            for i in range(0, len(data), step):
                await response.write(data[i : i + step])
                await asyncio.sleep(seconds / 40)
            await response.write_eof()
        except ConnectionResetError:  # the client hung up
            pass
        return response

    return handler


def test_a_trickling_answer_is_cut_at_the_request_timeout_naming_the_server(tmp_path, caplog):
    """httpx's read timeout restarts at every chunk: an answer trickled over 8 s passed ``client.timeout = 1`` and held
    its rollout (on a real run, up to its rollout timeout) before it trained. Now the whole answer must come within it."""
    # 3 s, not 1: on a loaded 2-core CI machine an honest request's connect alone once took over 1 s.
    url, results, _, elapsed = run_step(tmp_path, trickle(16.0), timeout=3.0)
    assert_clean_step(tmp_path, results)
    assert elapsed < 12.0
    assert any(url.removeprefix("http://") in m and "not complete after 3s" in m for m in caplog.messages)


def test_an_answer_past_the_size_cap_is_cut_naming_the_server(tmp_path, caplog, monkeypatch):
    """A 500 MB answer was read whole into the env worker's memory (the cap here is 1 MiB, the answer 3 MiB)."""
    from prime_orchestrator import http_pool

    monkeypatch.setattr(http_pool, "MAX_RESPONSE_BYTES", 2**20, raising=False)
    url, results, _, _ = run_step(tmp_path, lambda b: {**answer([5, 6]), "pad": "x" * 3 * 2**20})
    assert_clean_step(tmp_path, results)
    assert any(url.removeprefix("http://") in m and f"larger than {2**20} bytes" in m for m in caplog.messages)


def raw(text: str, status: int = 200, content_type: str = "application/json"):
    return lambda b: web.Response(text=text, status=status, content_type=content_type)


def with_logprobs(values: list[Any]) -> dict[str, Any]:
    body = answer([5, 6])
    for entry, value in zip(body["choices"][0]["logprobs"]["content"], values, strict=True):
        entry["logprob"] = value
    return body


# Answers the train client (renderers' response checks, the OpenAI SDK) already refuses: each fails its rollout in one
# line and nothing of it trains. They held before this test was written; it keeps them held.
REFUSED = {
    "fewer log-probs than tokens": lambda b: answer([5, 6], [-0.5]),
    "NaN log-prob": raw(json.dumps(answer([5, 6])).replace('"logprob": -0.5,', '"logprob": NaN,', 1)),
    "+inf log-prob": raw(json.dumps(answer([5, 6])).replace('"logprob": -0.5,', '"logprob": Infinity,', 1)),
    "string log-prob": lambda b: with_logprobs(["-0.5", -0.5]),
    "null log-prob": lambda b: with_logprobs([None, -0.5]),
    "null logprobs": lambda b: {**answer([5, 6]), "choices": [{**answer([5, 6])["choices"][0], "logprobs": None}]},
    "float token id": lambda b: answer([5, 6.5]),
    "not JSON": raw("{choices: nope", content_type="text/plain"),
    "HTML error page": raw("<html><body><h1>502 Bad Gateway</h1></body></html>", 502, "text/html"),
    "200 with an error body": lambda b: {"error": {"message": "engine dead", "code": 500}},
    "500": raw('{"error": {"message": "CUDA error"}}', 500),
    "deeply nested JSON": raw('{"choices": ' + "[" * 100_000 + "]" * 100_000 + "}"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_malformed_answers_fail_their_rollout_in_one_line(tmp_path, case):
    _, results, _, elapsed = run_step(tmp_path, REFUSED[case])
    assert_clean_step(tmp_path, results)
    assert elapsed < 30


# ----- the version ledger -----
@pytest.mark.parametrize(
    ("record", "reason"),
    [
        ({"first": 3, "last": 1, "num_tokens": 2}, "steps 3..1 over 2 tokens"),
        ({"first": 7, "last": 7, "num_tokens": 2}, "weight step 7, newer than any the trainer published (newest: "),
    ],
)
def test_a_ledger_of_steps_never_published_ends_the_run_naming_the_server(tmp_path, record, reason):
    """A server whose version record names a weight step the relay never sent (another run's server, a corrupt
    ledger) would have the rollout counted as sampled by a policy that does not exist: staleness below zero, the
    continuous scheduler's bound computed from it. Before: trained on, ``off_policy/max`` = -7."""
    from prime_orchestrator.versions import ServerWentBack

    async def main():
        server = await FakeServer().start()
        server.versions = record
        orch = orchestrator(tmp_path, server)
        try:
            with pytest.raises(ServerWentBack) as err:
                await one_step(orch, server)
            return server.url, str(err.value)
        finally:
            await orch.close()
            await server.stop()

    url, error = asyncio.run(main())
    assert error.startswith(f"inference server {url}: the version record of rollout ") and reason in error
    assert not (tmp_path / "run" / "rollouts" / "step_0").exists()


def test_a_trickled_version_record_falls_back_to_the_relays_bounds_in_bounded_time(tmp_path, monkeypatch, caplog):
    """A ``/rollout_versions`` answer trickled a byte every 0.2 s passed its 30 s read timeout (restarted at every byte)
    and held every finished rollout's ``take`` behind it for as long as it lasted. Now the whole answer must come
    within it (1 s here); the rollouts get the weight relay's bounds, as from a server without the record."""
    from prime_orchestrator import versions

    monkeypatch.setattr(versions, "TIMEOUT_S", 1.0)

    async def main():
        server = await FakeServer().start()
        server.versions = trickled(0.2, 150)
        orch = orchestrator(tmp_path, server)
        server.handler = lambda b: answer([5, 6])
        t0 = time.monotonic()
        try:
            results = await asyncio.wait_for(one_step(orch, server), 40)
            return server.url, results, time.monotonic() - t0
        finally:
            await orch.close()
            await server.stop()

    url, results, elapsed = asyncio.run(main())
    assert elapsed < 15 and not any(r.failed for r in results)
    assert all(r.versions is not None and not r.versions.exact for r in results)
    assert any(url in m and "no whole answer in 1s" in m for m in caplog.messages)


# ----- /health -----
@pytest.mark.parametrize(
    ("before", "after", "reason"),
    [
        ({"run_id": "mine", "weight_step": 0}, {"run_id": "theirs", "weight_step": 0}, "for run 'theirs', not this"),
        ({"run_id": "mine", "weight_step": 3}, {"run_id": "mine", "weight_step": 1}, "weights step 1 after step 3"),
    ],
)
def test_a_server_that_changes_under_the_run_stops_it_naming_the_server(before, after, reason):
    """The load poll reads every server's /health each second; a server that now answers for another run, or whose
    weight step went back, was polled for its load and sampled on as if it served the relay's policy. Now the next
    rollout that asks for a slot (and every one waiting) gets one line naming the server."""
    from prime_orchestrator.concurrency import ConcurrencyLimiter

    async def main():
        server = await FakeServer().start()
        server.health = {"status": "ok", **before}
        client = ClientConfig(base_urls=[server.url], server_run_id="mine", max_concurrent=1, load_poll_interval=0.1)
        limiter = ConcurrencyLimiter.from_config(client)
        try:
            async with limiter:
                await asyncio.sleep(0.3)
                server.health = {"status": "ok", **after}
                waiting = asyncio.create_task(limiter.__aenter__())
                await asyncio.sleep(2.0)
            with pytest.raises(RuntimeError) as err:
                await asyncio.wait_for(waiting, 5)
            with pytest.raises(RuntimeError) as again:
                await asyncio.wait_for(limiter.__aenter__(), 5)
            return server.url, str(err.value), str(again.value)
        finally:
            await limiter.aclose()
            await server.stop()

    url, error, again = asyncio.run(main())
    assert error == again and error.startswith(f"inference server {url} now ") and reason in error


def test_the_orchestrator_entry_point_ends_on_a_changed_server_in_one_line(capsys, tmp_path):
    """Before: `ServerChanged` was no fault the entry point knew, so the run ended in a traceback (seen when the poll
    saw a restarted server before the weight relay did)."""
    from prime_orchestrator.concurrency import ServerChanged
    from prime_orchestrator.entrypoints.orchestrator import run

    line = "inference server http://127.0.0.1:1 now serves weights step 0 after step 2 (it restarted)"

    class Orch:
        @staticmethod
        async def run():
            raise ServerChanged(line)

    with pytest.raises(SystemExit) as exited:
        run(Orch(), tmp_path)
    assert exited.value.code == 1 and capsys.readouterr().err == f"error: {line}\n"


def trickled(interval: float, count: int = 60):
    """A handler that sends a byte every ``interval`` s, ``count`` times: every read gets a byte within any read
    timeout longer than ``interval``."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        try:
            for _ in range(count):
                await response.write(b" ")
                await asyncio.sleep(interval)
        except ConnectionResetError:
            pass
        return response

    return handler


def test_a_trickling_health_neither_holds_the_start_up_nor_the_load_poll():
    """``wait_healthy`` checked its deadline only between answers and bounded each read to 5 s: a /health trickled a
    byte a second held the start-up for as long as the trickle lasted (a minute here; forever for a hostile server).
    Now each answer is bounded as a whole, and the start-up fails at its deadline naming the server."""
    from prime_orchestrator.client import wait_healthy
    from prime_orchestrator.concurrency import HealthPoller

    async def main():
        server = await FakeServer().start()
        server.health = trickled(1.0)
        poller = HealthPoller(ClientConfig(base_urls=[server.url], load_poll_interval=0.5))
        t0 = time.monotonic()
        try:
            with pytest.raises(TimeoutError) as err:
                await asyncio.wait_for(wait_healthy([server.url], api_key=None, timeout=2.0), 40)
            waited = time.monotonic() - t0
            t0 = time.monotonic()
            answers = await asyncio.wait_for(poller(), 40)
            return server.url, str(err.value), waited, answers, time.monotonic() - t0
        finally:
            await poller.aclose()
            await server.stop()

    url, error, waited, answers, polled = asyncio.run(main())
    assert error == f"inference server {url} not healthy after 2s" and waited < 15
    assert answers == [None] and polled < 5


# ----- finish reasons -----
@pytest.mark.parametrize("finish", ["content_filter", "abort", "banana", None])
def test_a_finish_reason_no_turn_ends_with_fails_the_rollout_naming_the_server_and_the_value(tmp_path, finish):
    """verifiers' train client maps a finish reason it does not know to None, and the turn trained as if the policy
    had ended it: an aborted request's partial completion, a proxy's filtered one, a server's invented one."""
    url, results, _, _ = run_step(tmp_path, lambda b: answer([5, 6], finish=finish))
    failed = assert_clean_step(tmp_path, results)
    assert f"inference server {url} answered finish_reason {finish!r}" in failed.error, failed.error


@pytest.mark.parametrize("finish", ["stop", "length", "tool_calls"])
def test_the_finish_reasons_a_turn_ends_with_train(tmp_path, finish):
    _, results, _, _ = run_step(tmp_path, lambda b: answer([5, 6], finish=finish))
    assert not any(r.failed for r in results), [r.error for r in results]


def test_a_trace_whose_replies_the_env_replaced_is_no_empty_completion():
    # An `@vf.intercept` on the response replaces the reply; verifiers keeps none of its tokens. Such a trace trained
    # nothing and failed its rollout as the server's "empty completion" (tests/environments/test_vf_authored.py).
    from prime_orchestrator.sample_checks import check_sequences

    def result(replaced: int) -> RolloutResult:
        return RolloutResult(env="e", example=0, traces=[TraceResult(reward=1.0, replaced_replies=replaced)])

    assert check_sequences(result(1), vocab=None) is None
    assert check_sequences(result(0), vocab=None) == "no sampled token in trace 0 (an empty completion)"
