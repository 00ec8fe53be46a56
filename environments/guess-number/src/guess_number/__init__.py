"""Multi-turn number guessing: the model guesses, the game answers higher or lower between turns (a ``vf.Env``)."""

from guess_number.data import SYSTEM_PROMPT, feedback, game_reward, generate_examples, parse_guess

__version__ = "0.1.0"
__all__ = ["GuessNumberEnv", "GuessNumberTaskset"]

_LAZY = ("GuessNumberTaskset", "GuessNumberTask", "GuessNumberData", "GuessNumberConfig", "GuessNumberEnv")


def __getattr__(name: str):
    # verifiers is imported on first use, so the generator and reward stay importable without it.
    if name in _LAZY or name == "GuessNumberEnvConfig":
        from guess_number import taskset

        return getattr(taskset, name)
    raise AttributeError(f"module 'guess_number' has no attribute {name!r}")


_ = (SYSTEM_PROMPT, feedback, game_reward, generate_examples, parse_guess)
