"""``prime-reference-judge``: verifiers' ``reference`` judge with the response held in its place in the prompt and
the verdict read strictly (``prime_orchestrator.judge_guard``). The orchestrator plugs it in place of ``reference``
(same config, same reward name); an unparseable verdict scores 0 and is counted as ``<name>/unparsed``."""

from __future__ import annotations

from typing import Any

from prime_orchestrator.judge_guard import (
    REFERENCE_PROMPT,
    guarded_fields,
    score_or_unparsed,
    strict_choice,
)
from verifiers.v1.judge import JudgeResponse
from verifiers.v1.judges.reference import ReferenceJudge, ReferenceJudgeConfig


class PrimeReferenceJudge(ReferenceJudge):
    prompt = REFERENCE_PROMPT  # a config ``prompt`` file still wins (verifiers' Judge.__init__)

    def build_messages(self, **fields: Any):
        return super().build_messages(**guarded_fields(fields))

    def parse(self, response: JudgeResponse[float]) -> float:
        return float(strict_choice(response.text, self.config.choices) == self.config.choices[0])

    async def score(self, task, trace) -> float:
        return await score_or_unparsed(super().score(task, trace), trace, self.reward_name)


__all__ = ["PrimeReferenceJudge", "ReferenceJudgeConfig"]
