"""``prime-rubric-judge``: verifiers' ``rubric`` judge with the response held in its place in the prompt and the
judge's own verdicts read (``prime_orchestrator.judge_guard``). The orchestrator plugs it in place of ``rubric`` (same
config, same reward name).

verifiers reads the first JSON object of the judge's reply that has a ``verdicts`` key, so a response that writes one
(every criterion at its best choice) chose the verdict of a judge that quotes the response before answering. Here a
verdicts object the response holds does not count, and the judge's own must agree; otherwise the reply is unparsed:
it scores 0 and is counted as ``<name>/unparsed``, as the reference judge's. A reply with no verdicts object at all,
or a malformed one, stays verifiers' judge failure (the rollout fails)."""

from __future__ import annotations

import json
from contextvars import ContextVar
from typing import Any

from prime_orchestrator.judge_guard import (
    RUBRIC_PROMPT,
    guarded_fields,
    own_verdicts,
    score_or_unparsed,
)
from verifiers.v1.judge import JudgeResponse, judge_response
from verifiers.v1.judges.rubric import RubricJudge, RubricJudgeConfig

# The response a batch is graded on, for the reply of its judge call (set per grading task: batches run concurrently).
_GRADED: ContextVar[str | None] = ContextVar("prime_rubric_graded", default=None)


class PrimeRubricJudge(RubricJudge):
    prompt = RUBRIC_PROMPT  # a config ``prompt`` file still wins (verifiers' Judge.__init__)

    def build_messages(self, **fields: Any):
        return super().build_messages(**guarded_fields(fields))

    async def grade_batch(self, task, trace, batch) -> dict[str, float]:
        token = _GRADED.set(judge_response(trace, self.config.view))
        try:
            return await super().grade_batch(task, trace, batch)
        finally:
            _GRADED.reset(token)

    async def complete(self, messages, **kwargs: Any) -> JudgeResponse[Any]:
        response = await super().complete(messages, **kwargs)
        graded = _GRADED.get()
        if graded is None or kwargs.get("schema") is not None:  # structured output: the reply is the object
            return response
        own = own_verdicts(response.text, graded)
        return response if own is None else response.model_copy(update={"text": json.dumps(own)})

    async def score(self, task, trace) -> float:
        return await score_or_unparsed(super().score(task, trace), trace, self.reward_name)


__all__ = ["PrimeRubricJudge", "RubricJudgeConfig"]
