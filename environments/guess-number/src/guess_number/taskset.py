"""The guess-number game as verifiers' own multi-turn form: a Taskset of secrets and the ``vf.Env`` that plays it.

The env is exported next to the taskset, so wherever verifiers loads ``guess-number`` (its own eval, an env server,
prime's orchestrator) an episode is the game: the model's reply is a guess, the env answers ``higher``/``lower`` as
the next user turn, until the secret is found or ``max_guesses`` is spent.
"""

from __future__ import annotations

from collections.abc import Iterable

import verifiers.v1 as vf

from guess_number.data import feedback, game_reward, generate_examples, parse_guess


class GuessNumberData(vf.TaskData):
    secret: int
    """The number to find."""
    high: int
    """Upper end of the range."""
    max_guesses: int = 6
    """Guesses allowed."""


class GuessNumberTask(vf.Task[GuessNumberData]):
    pass


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


class GuessNumberEnvConfig(vf.EnvConfig):
    # A pure chat game: the tool-less `null` harness, on the local subprocess runtime (it runs no model code).
    player: vf.AgentConfig = vf.AgentConfig(harness={"id": "null"}, runtime={"type": "subprocess"})


class GuessNumberEnv(vf.Env[GuessNumberEnvConfig]):
    async def run(self, task, agents):
        data = task.data
        guesses, solved = 0, False
        async with agents.player.interaction(task) as interaction:
            segment = await interaction.turn()
            while not segment.terminated:
                guesses += 1
                answer = feedback(parse_guess(segment.last_reply), data.secret)
                solved = answer == "correct"
                if solved or guesses >= data.max_guesses:
                    break
                segment = await interaction.turn(answer)
        trace = interaction.trace
        trace.record_reward("win", game_reward(solved, guesses, data.max_guesses), 1.0)
        trace.record_metric("num_guesses", float(guesses))
        trace.record_metric("solved", float(solved))
