"""A broken or hostile distillation teacher: a fake one on 127.0.0.1 answers the scoring route
``/inference/v1/generate`` the way ``prime_inference`` does (``prompt_logprobs``: None at position 0, then
``{token id: {"logprob": ...}}``), but wrong. Every answer must end in a one-line `TeacherError` naming the teacher
and what was wrong (the run's cause), never in a value that trains as the per-token signal, a traceback, or a wait
past the teacher's ``timeout``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from aiohttp import web
from prime_core.config.distill import DistillConfig, TeacherConfig
from prime_orchestrator.distill import Teacher, TeacherError

from tests.fixtures.fake_http import serving

TOKENS = [3, 4, 5, 6]


def scores(*logprobs, first=None) -> dict:
    return {
        "prompt_logprobs": [first] + [{str(t): {"logprob": lp}} for t, lp in zip(TOKENS[1:], logprobs, strict=True)]
    }


def raw(text: str, status: int = 200):
    return lambda request: web.Response(status=status, text=text, content_type="application/json")


async def trickled(request: web.Request) -> web.StreamResponse:
    """An honest answer sent a byte every 0.2 s: every read gets bytes within httpx's read timeout (30 s in all)."""
    data = json.dumps(scores(-0.5, -0.5, -0.5)).encode()
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.content_length = len(data)
    await response.prepare(request)
    try:
        for i in range(len(data)):
            await response.write(data[i : i + 1])
            await asyncio.sleep(0.2)
        await response.write_eof()
    except ConnectionResetError:  # the client hung up
        pass
    return response


async def score(handler, timeout: float = 30.0) -> list[float]:
    async def generate(request: web.Request) -> web.StreamResponse:
        await request.json()
        out = handler(request)
        out = await out if asyncio.iscoroutine(out) else out
        return out if isinstance(out, web.StreamResponse) else web.json_response(out)

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    async with serving(app) as url:
        # health_timeout: a 5xx is an outage the teacher is waited out of (300 s by default)
        config = TeacherConfig(base_url=url, model="teacher", timeout=timeout, max_retries=0, health_timeout=1)
        teacher = Teacher("math", DistillConfig(teacher=config))
        try:
            return await teacher.logprobs(TOKENS)
        finally:
            await teacher.client.aclose()


def test_an_honest_answer_is_read_as_the_log_probs_of_the_tokens():
    assert asyncio.run(score(lambda r: scores(-0.5, -1.0, -2.0))) == [0.0, -0.5, -1.0, -2.0]


BAD = {
    "nan": (raw('{"prompt_logprobs": [null, {"4": {"logprob": NaN}}, {"5": {"logprob": -1}}, {"6": {"logprob": -1}}]}'),
            "prompt_logprobs[1] = nan for token 4"),
    "-inf": (raw('{"prompt_logprobs": [null, {"4": {"logprob": -1}}, {"5": {"logprob": -Infinity}}, {"6": {"logprob": -1}}]}'),
             "prompt_logprobs[2] = -inf for token 5"),
    "positive": (lambda r: scores(-0.5, 3.0, -0.5), "prompt_logprobs[2] = 3.0 for token 5"),
    "null past the first": (lambda r: {"prompt_logprobs": [None, None, {"5": {"logprob": -1}}, {"6": {"logprob": -1}}]},
                            "prompt_logprobs[1] without a log-prob of token 4"),
    "another token": (lambda r: {"prompt_logprobs": [None, {"99": {"logprob": -1}}, {"5": {"logprob": -1}}, {"6": {"logprob": -1}}]},
                      "prompt_logprobs[1] without a log-prob of token 4"),
    "a string": (lambda r: scores("-0.5", -0.5, -0.5), "prompt_logprobs[1] without a log-prob of token 4"),
    "entries not dicts": (lambda r: {"prompt_logprobs": [None, 1, 2, 3]}, "prompt_logprobs[1] without a log-prob"),
    "too few": (lambda r: {"prompt_logprobs": [None, {"4": {"logprob": -1}}]}, "2 prompt_logprobs for 4 tokens"),
    "not a list": (lambda r: {"prompt_logprobs": "abcd"}, "no prompt_logprobs list"),
    "a list body": (lambda r: [1, 2], "no prompt_logprobs list"),
    "truncated": (raw('{"prompt_logprobs": [null, {"4": {"lo'), "200: not JSON"),
    "html": (lambda r: web.Response(text="<html>oops</html>", content_type="text/html"), "200: not JSON"),
    "4xx": (raw('{"error": {"message": "prompt too long"}}', status=400), "400: prompt too long"),
    "5xx": (raw("boom", status=503), "failed after 1 attempts: 503: boom"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_bad_answer_is_one_line_naming_the_teacher_and_the_field(case):
    """Before, NaN, -inf, a positive log-prob and a null past position 0 (read as 0.0) came back as scores and trained
    as the per-token advantage; a missing token, a non-number, a non-dict, a list body and a body that is not JSON
    were a KeyError, ValueError, TypeError, AttributeError or JSONDecodeError traceback that named no teacher."""
    handler, reason = BAD[case]
    with pytest.raises(TeacherError) as e:
        asyncio.run(score(handler))
    message = str(e.value)
    assert "\n" not in message and message.startswith("teacher of env 'math' at http://127.0.0.1:")
    assert reason in message


def test_a_trickled_answer_is_cut_at_the_teachers_timeout():
    """httpx's read timeout restarts at every chunk: an answer trickled over 30 s came back with ``timeout = 1``
    (a hostile teacher held the step for as long as it liked)."""
    with pytest.raises(TeacherError, match="no complete answer after 1s"):
        asyncio.run(score(trickled, timeout=1.0))


def test_the_edge_values_a_real_teacher_sends_are_accepted():
    """-9999 is the server's clamp of -inf; a float32 log-softmax rounds a near-certain token a hair above 0."""
    assert asyncio.run(score(lambda r: scores(-0.0, -9999.0, 0.0005))) == [0.0, -0.0, -9999.0, 0.0005]


def test_an_answer_past_the_size_cap_is_cut_naming_the_teacher(monkeypatch):
    """A teacher's answer was read whole into the orchestrator's memory, however large (the cap here is 1 MiB, the
    answer 3 MiB)."""
    from prime_orchestrator import client

    monkeypatch.setattr(client, "MAX_ANSWER_BYTES", 2**20)
    huge = {"prompt_logprobs": scores(-0.5, -0.5, -0.5)["prompt_logprobs"], "padding": "x" * 3 * 2**20}
    with pytest.raises(TeacherError, match=r"at http://127\.0\.0\.1:\d+: POST .* -> 200: an answer over 1048576 bytes"):
        asyncio.run(score(lambda r: huge))


def test_a_group_with_images_is_one_line_not_scored_as_text():
    """The scoring route serves text prompts only: a vision-language student's sequences went to the teacher as bare
    token ids (each image a run of placeholder tokens read as text), and its log-probs of the student's tokens, given
    no image, trained as the per-token signal."""
    from prime_core.config.orchestrator import OrchestratorConfig
    from prime_core.schemas.rollout import RolloutResult, TraceResult, TrainedSequence
    from prime_orchestrator.distill import Teachers
    from prime_orchestrator.orchestrator import Rollout

    async def main(url: str):
        distill = DistillConfig(teacher=TeacherConfig(base_url=url, model="teacher", max_retries=0)).model_dump()
        teachers = Teachers(OrchestratorConfig(env=[{"id": "charts", "distill": distill}]))
        q = TrainedSequence(token_ids=TOKENS, loss_mask=[False, False, True, True], logprobs=[0.0, 0.0, -0.5, -0.5],
                            images=["data:image/png;base64,AAAA"])  # fmt: skip
        result = RolloutResult(env="charts", example=0, traces=[TraceResult(sequences=[q])])
        try:
            await teachers.score(0, "charts", [Rollout("charts", 0, 0, 0, result)])
        finally:
            await teachers.close()
        return q.teacher_logprobs

    async def served() -> list[float] | None:
        async def generate(request: web.Request) -> web.StreamResponse:
            return web.json_response(scores(-0.5, -0.5, -0.5))

        app = web.Application()
        app.router.add_post("/inference/v1/generate", generate)
        async with serving(app) as url:
            return await main(url)

    with pytest.raises(TeacherError) as e:
        asyncio.run(served())
    message = str(e.value)
    assert "\n" not in message and message.startswith("env 'charts' distils from http://127.0.0.1:")
    assert "carry images (1 in this group)" in message


def test_a_compressed_answer_is_read_and_its_other_headers_kept():
    """The capped read hands on the decoded body: a gzip answer parses, and headers other than the body's (a server's
    marks on its answer) reach the caller."""
    import gzip

    from prime_orchestrator.client import _post

    async def main() -> tuple[Any, str]:
        async def generate(request: web.Request) -> web.StreamResponse:
            body = gzip.compress(json.dumps(scores(-0.5, -1.0, -2.0)).encode())
            return web.Response(body=body, headers={"Content-Encoding": "gzip", "Content-Type": "application/json",
                                                    "X-Mark": "1"})  # fmt: skip

        app = web.Application()
        app.router.add_post("/inference/v1/generate", generate)
        async with serving(app) as url, httpx.AsyncClient() as client:
            resp = await _post(client, f"{url}/inference/v1/generate", {}, 30.0)
            return resp.json(), resp.headers.get("x-mark")

    out, mark = asyncio.run(main())
    assert out == scores(-0.5, -1.0, -2.0) and mark == "1"


def test_a_teacher_that_never_gets_healthy_is_named_as_the_teacher():
    """The wait ended as ``inference server <url> not healthy after 1s``: beside the policy's own wait at start, it
    read as the policy's server, and named no setting to raise."""

    async def main():
        async def health(request: web.Request) -> web.StreamResponse:
            return web.Response(status=503, text="loading")

        app = web.Application()
        app.router.add_get("/health", health)
        async with serving(app) as url:
            teacher = Teacher("math", DistillConfig(teacher=TeacherConfig(base_url=url, model="t", health_timeout=1)))
            try:
                await teacher.start("unused: the wait ends first")
            finally:
                await teacher.client.aclose()

    with pytest.raises(TeacherError) as e:
        asyncio.run(main())
    assert str(e.value).endswith(": not healthy after 1s (distill.teacher.health_timeout)")
    assert str(e.value).startswith("teacher of env 'math' at http://127.0.0.1:")
