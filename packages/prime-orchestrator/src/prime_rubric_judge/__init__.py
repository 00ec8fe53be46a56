"""``prime-rubric-judge``: verifiers' ``rubric`` judge with the response held in its place in the prompt
(``prime_orchestrator.judge_guard``). The orchestrator plugs it in place of ``rubric`` (same config, same reward
name). Its verdicts stay verifiers' JSON object, which raises (the rollout fails, scoring 0) when malformed."""

from __future__ import annotations

from typing import Any

from prime_orchestrator.judge_guard import RUBRIC_PROMPT, guarded_fields
from verifiers.v1.judges.rubric import RubricJudge, RubricJudgeConfig


class PrimeRubricJudge(RubricJudge):
    prompt = RUBRIC_PROMPT  # a config ``prompt`` file still wins (verifiers' Judge.__init__)

    def build_messages(self, **fields: Any):
        return super().build_messages(**guarded_fields(fields))


__all__ = ["PrimeRubricJudge", "RubricJudgeConfig"]
