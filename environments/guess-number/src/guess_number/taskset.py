"""The guess-number verifiers Taskset (multi-turn, one tool call per turn)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import verifiers.v1 as vf

from guess_number.data import TOOL_SCHEMA, feedback, game_reward, generate_examples, parse_tool_call


class GuessNumberData(vf.TaskData):
    secret: int
    """The number to find."""
    high: int
    """Upper end of the range."""
    max_guesses: int = 6
    """Guesses allowed."""


class GuessNumberTask(vf.Task[GuessNumberData]):
    tools: ClassVar[list[dict]] = [TOOL_SCHEMA]

    def env_response(self, messages: list[dict[str, Any]], info: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The tool turn answering the last assistant message, or None when the game is over."""
        guess = parse_tool_call(messages[-1]["content"])
        info["num_guesses"] = info.get("num_guesses", 0) + 1
        # A reply without a valid call uses up a guess and gets a reminder, so the game stays multi-turn.
        result = "invalid: call the guess tool" if guess is None else feedback(guess, self.data.secret)
        if result == "correct":
            info["solved"] = True
            return None
        if info["num_guesses"] >= self.data.max_guesses:
            info["stop"] = "max_guesses"
            return None
        return [{"role": "tool", "content": result, "name": "guess"}]

    @vf.reward(weight=1.0)
    async def win(self, trace: vf.Trace) -> float:
        info = trace.info
        return game_reward(bool(info.get("solved")), int(info.get("num_guesses", 0)), self.data.max_guesses)

    @vf.metric
    async def num_guesses(self, trace: vf.Trace) -> float:
        return float(trace.info.get("num_guesses", 0))


class GuessNumberConfig(vf.TasksetConfig):
    num_examples: int = 10_000
    """Games generated."""
    seed: int = 0
    """Generator seed."""
    high: int = 16
    """Secret is in [1, high]."""
    max_guesses: int = 6
    """Guesses allowed per game."""


class GuessNumberTaskset(vf.Taskset[GuessNumberTask, GuessNumberConfig]):
    def load(self) -> Iterable[GuessNumberTask]:
        c = self.config
        for ex in generate_examples(c.num_examples, c.seed, c.high):
            yield GuessNumberTask(
                GuessNumberData(
                    prompt=ex["prompt"],
                    system_prompt=ex["system_prompt"],
                    secret=ex["secret"],
                    high=ex["high"],
                    max_guesses=c.max_guesses,
                )
            )
