"""A synthetic environment with heavy-tailed response lengths, for benchmarks/rl_longtail_gpu.py (not installed: the
benchmark puts benchmarks/envs on PYTHONPATH, so the taskset id ``longtail-text`` imports this module).

Each rollout asks for an exact number of new tokens: its request's ``max_tokens`` with ``ignore_eos``, drawn per
rollout from the request's sampling seed (the orchestrator's per-sample seed, so a run is repeatable): with
probability ``tail_fraction`` ``tail_factor`` times ``median_tokens``, otherwise uniform in [median/2, 3 median/2].
``mean_only`` gives every rollout the distribution's mean instead (the benchmark's reference batch). The reward is a
hash of the reply in [0, 1): a random model's groups keep nonzero advantages, so the trainer trains every step.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Iterable

import verifiers.v1 as vf
from verifiers.v1.harnesses.null import NullHarness

WORDS = ["cat", "dog", "sun", "moon", "tree", "bird", "fish", "rain", "snow", "wind", "star", "leaf", "rock", "sea"]


def response_tokens(data: LongtailData, seed: int) -> int:
    """New tokens of one rollout (its request's seed picks them)."""
    median = data.median_tokens
    if data.mean_only:
        return round(median * (1 - data.tail_fraction) + median * data.tail_factor * data.tail_fraction)
    rng = random.Random(seed)
    if rng.random() < data.tail_fraction:
        return median * data.tail_factor
    return rng.randint(max(1, median // 2), max(1, median * 3 // 2))


class LongtailData(vf.TaskData):
    median_tokens: int
    tail_fraction: float
    tail_factor: int
    mean_only: bool


class LongtailTask(vf.Task[LongtailData]):
    @vf.reward(weight=1.0)
    async def hashed(self, trace: vf.Trace) -> float:
        return zlib.crc32(trace.last_reply.encode()) % 1000 / 1000


class LongtailConfig(vf.TasksetConfig):
    num_examples: int = 4096
    """Prompts generated."""
    seed: int = 0
    """Prompt generator seed."""
    median_tokens: int = 128
    """Median response length in tokens."""
    tail_fraction: float = 0.1
    """Share of rollouts in the tail."""
    tail_factor: int = 8
    """Tail length over the median."""
    mean_only: bool = False
    """Every rollout at the distribution's mean length (the reference batch)."""


class LongtailTaskset(vf.Taskset[LongtailTask, LongtailConfig]):
    def load(self) -> Iterable[LongtailTask]:
        c = self.config
        rng = random.Random(c.seed)
        for _ in range(c.num_examples):
            prompt = "Continue: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
            yield LongtailTask(LongtailData(prompt=prompt, median_tokens=c.median_tokens, tail_fraction=c.tail_fraction,
                                            tail_factor=c.tail_factor, mean_only=c.mean_only))  # fmt: skip


class LongtailHarness(NullHarness):
    """A chat task played by verifiers' tool-less chat loop, as reverse-text's."""


class LongtailEnv(vf.SingleAgentEnv):
    """The single-agent env with each rollout's length set in its sampling (exact: ``ignore_eos``)."""

    async def run_episode(self, task, ctx, **kwargs):
        tokens = response_tokens(task.data, ctx.sampling.seed or 0)
        sampling = vf.SamplingConfig.model_validate(
            {**ctx.sampling.model_dump(exclude_none=True), "max_tokens": tokens, "ignore_eos": True}
        )
        return await super().run_episode(task, dataclasses.replace(ctx, sampling=sampling), **kwargs)


__all__ = ["LongtailEnv", "LongtailHarness", "LongtailTaskset"]
