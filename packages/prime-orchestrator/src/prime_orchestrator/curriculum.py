"""Difficulty curriculum and dynamic sampling: which examples a step draws, and which of its groups train.

Every drawn group is scored into its example's running mean reward (an EMA of group mean rewards), per seat: in a
multi-agent episode each trainable seat has its own (``prime_orchestrator.credit``), since the mean over seats of a
zero-sum game is the same in every episode. A ``difficulty_pool`` sampler draws examples with replacement, each
weighted by the best pool any of its seats falls in (unseen examples get ``unseen_weight``). An advantage-range gate rejects groups without signal; under dynamic
sampling (DAPO) the step then draws more groups until it holds the batch's number of admitted groups, or the cap.
A group is admitted when any seat's advantages leave the gate's range, as credit trains each seat on its own.

Determinism (a resumed run draws what an uninterrupted one would, whatever the timing): the draws of step n,
round k come from an RNG seeded with (seed, n, k), and from the difficulty of exactly the steps <= n - 1 -
async_level, the steps the orchestrator has shipped, hence scored, before it may dispatch step n. Scores of later
steps wait in ``pending`` until then; the checkpoint of step n holds the scores folded through n - 1 - async_level
plus the pending ones of the steps before n.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from prime_core.config.orchestrator import OrchestratorConfig
from prime_core.io import atomic_write_json, read_regular, reading
from prime_core.run_dir import RunDir

from prime_orchestrator.advantages import compute_advantages
from prime_orchestrator.credit import Unit, seat_groups

logger = logging.getLogger("prime.orchestrator.curriculum")

STATE_FILE = "curriculum.json"
# Bounds on the orchestrator checkpoint's files, read back on resume: a file of gigabytes under the name (a sparse
# one, another file copied over it) was read whole into memory before its first byte was parsed.
PROGRESS_BYTES = 1 << 20
"""progress.json: the step, the seed and one cursor per env, under a KiB in real runs."""
STATE_BYTES = 1 << 30
"""curriculum.json: about 90 bytes per scored (env, example, seat); 1 GiB is ten million of them."""


MAX_SEATS = 64
"""Seats scored per env. A seat's name is the env's (verifiers' agent name): an env naming a new seat in every
rollout added an entry per group to the difficulty table, to curriculum.json and to every draw's pass over the table,
for the whole run. Scores of seats past the first 64 an env named are left out (logged once per env); an example
weighs what its known seats say."""


def read_checkpoint_json(path: Path, what: str, limit: int) -> Any:
    """The JSON value of the orchestrator checkpoint's file ``what`` (``"a curriculum checkpoint"``) at ``path``,
    read by `read_regular` with ``limit``; callers parse it inside `reading`, which names the file."""
    return json.loads(read_regular(path, what, limit))


class CurriculumExhausted(RuntimeError):
    """Every example of an env weighs 0 (a policy that solved every example, with the easy pool's weight 0): the run
    ends in one line naming the pools, where it ended in a traceback."""


class _Result(Protocol):
    traces: list
    failed: bool


class GroupRollout(Protocol):
    """What the curriculum reads of a rollout (``prime_orchestrator.orchestrator.Rollout``)."""

    env: str
    example: int
    result: _Result
    train: bool


Group = Sequence[GroupRollout]
RunGroup = Callable[[str, int, int], Awaitable[Group]]
"""Runs one group: (env, example, group index within the step) -> its rollouts."""


class Curriculum:
    """Off (``curriculum.enabled`` false): the plain run's sequential draws, every group trains, no state."""

    def __init__(self, config: OrchestratorConfig, num_examples: dict[str, int] | None = None):
        self.config = config
        self.c = config.curriculum
        self.enabled = self.c.enabled
        self.envs = [e.resolved_name for e in config.env]
        self.ratios = [e.ratio for e in config.env]
        self.num_examples: dict[str, int] = {}
        self.groups_per_step = config.batch_size // config.rollouts_per_example
        self.distilling = {e.resolved_name for e in config.env if e.distill is not None}
        # Pools by threshold; a mean above every threshold belongs to the last one.
        self.pools = sorted(self.c.pools.items(), key=lambda item: item[1].threshold)
        self.difficulty: dict[tuple[str, int, str], tuple[float, int]] = {}
        """(env, example, seat) -> (running mean reward, groups scored), folded through step ``folded_through``."""
        self.folded_through = -1
        self.totals = {"draws": 0, "admitted": 0, "trained": 0}
        self.pending: dict[int, dict[str, Any]] = {}
        """step -> {"scores": [[env, example, seat, mean reward], ...], "draws"/"admitted"/"trained"/"rounds": int}."""
        self.seats: dict[str, set[str]] = {}
        """env -> the seats the difficulty table holds scores of (``MAX_SEATS`` at most, but for a checkpoint's)."""
        self._seats_warned: set[str] = set()
        if num_examples is not None:
            self.start(num_examples)

    def start(self, num_examples: dict[str, int]) -> None:
        """Once the tasksets are loaded: their sizes, and the state of the checkpoint ``ckpt.resume_step``."""
        self.num_examples = num_examples
        unbounded = [name for name, n in num_examples.items() if n <= 0]
        if self.enabled and unbounded:
            raise ValueError(f"curriculum needs finite tasksets; env {unbounded[0]!r} streams an unbounded one")
        if self.enabled and self.config.ckpt.resume_step:
            self.load(RunDir(self.config.output_dir).orchestrator_checkpoint(self.config.ckpt.resume_step))

    # ----- difficulty -----
    def _update(self, old: tuple[float, int] | None, mean: float) -> tuple[float, int]:
        if old is None:
            return mean, 1
        # A convex combination of two finite floats is finite; ``old + ema * (mean - old)`` overflowed on a
        # difference of two huge rewards of opposite signs.
        return (1 - self.c.reward_ema) * old[0] + self.c.reward_ema * mean, old[1] + 1

    def _fold(self, table: dict, through: int, start: int) -> None:
        added: dict[str, set[str]] = {}  # seats new to ``table`` (a view's never reach ``self.seats``)
        for step in sorted(s for s in self.pending if start < s <= through):
            for env, example, seat, mean in self.pending[step]["scores"]:
                if not self._seat_kept(env, seat, added.setdefault(env, set())):
                    continue
                key = (env, int(example), seat)
                table[key] = self._update(table.get(key, self.difficulty.get(key)), mean)
        if table is self.difficulty:
            for env, seats in added.items():
                self.seats.setdefault(env, set()).update(seats)

    def _seat_kept(self, env: str, seat: str, added: set[str]) -> bool:
        """Whether ``seat``'s scores are kept: a known seat, or a new one while ``env`` has fewer than MAX_SEATS.
        Folds run in step order, so a resumed run keeps the seats an uninterrupted one does."""
        known = self.seats.get(env, set())
        if seat in known or seat in added:
            return True
        if len(known) + len(added) >= MAX_SEATS:
            if env not in self._seats_warned:
                self._seats_warned.add(env)
                logger.warning("curriculum: env %s named more than %d seats; scores of the others are left out "
                               "(its examples weigh what their first %d seats say)", env, MAX_SEATS, MAX_SEATS)  # fmt: skip
            return False
        added.add(seat)
        return True

    def pool_of(self, mean: float) -> str:
        return next((name for name, p in self.pools if mean <= p.threshold), self.pools[-1][0])

    def _weights(self, env: str, view: dict) -> list[float]:
        """Per example of ``env``: the weight of the best pool one of its seats is in (an example that any seat still
        learns from is worth drawing), or ``unseen_weight``."""
        seats: dict[int, dict[str, float]] = {}
        for table in (self.difficulty, view):  # the view (scores folded since) wins
            for (e, example, seat), (mean, _) in table.items():
                if e == env:
                    seats.setdefault(example, {})[seat] = mean
        weights = [self.c.unseen_weight] * self.num_examples[env]
        for example, means in seats.items():
            weights[example] = max(self.c.pools[self.pool_of(mean)].weight for mean in means.values())
        return weights

    # ----- draws -----
    def _examples(self, step: int, rnd: int, envs: list[str], cursors: dict[str, int]) -> list[tuple[str, int]]:
        rng = random.Random(f"{self.config.seed}:curriculum:{step}:{rnd}")
        if self.c.sampler == "sequential" and rnd == 0:
            return sequential_plan(envs, cursors)
        if self.c.sampler == "sequential":  # refills of dynamic sampling: uniform over the taskset
            return [(env, rng.randrange(self.num_examples[env])) for env in envs]
        view: dict = {}
        self._fold(view, step - 1 - self.config.async_level, self.folded_through)
        cum_weights = {env: list(itertools.accumulate(self._weights(env, view))) for env in sorted(set(envs))}
        plan = []
        for env in envs:
            if cum_weights[env][-1] <= 0:
                raise CurriculumExhausted(self._exhausted(env))
            plan.append((env, rng.choices(range(self.num_examples[env]), cum_weights=cum_weights[env])[0]))
        return plan

    def _exhausted(self, env: str) -> str:
        zero = [f"curriculum.pools.{name}.weight" for name, p in self.pools if p.weight == 0]
        if self.c.unseen_weight == 0:
            zero.append("curriculum.unseen_weight")
        return f"curriculum: nothing left to draw in env {env!r}: every example weighs 0 ({', '.join(zero)} = 0)"

    def plan(self, step: int, envs: list[str], cursors: dict[str, int]) -> list[tuple[str, int]]:
        """(env, example) of each group of the step's first round; ``envs`` is the orchestrator's env mix."""
        return self._examples(step, 0, envs, cursors) if self.enabled else sequential_plan(envs, cursors)

    def _seats(self, group: Group) -> dict[str, list]:
        """The group's traces by seat, as credit trains them (failed rollouts dropped or scored 0)."""
        if self.config.failed_rollouts == "drop":
            group = [r for r in group if not r.result.failed]
        return seat_groups(group) if group else {}

    def admits(self, group: Group) -> bool:
        """Whether some seat's advantages leave the ``reject_advantage`` range (always, for a distilling env)."""
        if self.c.reject_advantage is None or group[0].env in self.distilling:  # the teacher's signal, always
            return True
        low, high = self.c.reject_advantage
        for units in self._seats(group).values():
            adv = compute_advantages([u.reward for u in units], [u.length for u in units], self.config.advantage)
            if not np.all((adv >= low - 1e-9) & (adv <= high + 1e-9)):
                return True
        return False

    def _scores(self, group: Group) -> list[list]:
        """[env, example, seat, mean reward of the seat's traces] per seat of the group. The mean of finite rewards
        is finite (summed after dividing: four rewards of 1e308 summed to inf, and the example's running mean then
        stayed inf, or NaN, in the last pool forever). A group whose every rollout failed and was dropped scores 0
        for the seat ``agent``, as ``zero_reward`` scores it: unscored, a task that always errors stayed unseen
        and was drawn at ``unseen_weight`` for the whole run, never training a token."""
        env, example = group[0].env, group[0].example
        seats = self._seats(group) or {"agent": [Unit("agent", 0.0, 0, 0, env)]}
        return [[env, example, seat, float(sum(u.reward / len(units) for u in units))] for seat, units in seats.items()]

    async def fill(self, step: int, groups: list[Group], run_group: RunGroup) -> list[Group]:
        """Every group the step drew; those that do not train (rejected, or admitted beyond the batch's number of
        groups) are marked ``train = False``. Dynamic sampling draws until that number is admitted or the cap."""
        if not self.enabled:
            return groups
        drawn, target = list(groups), len(groups)
        admitted = [g for g in drawn if self.admits(g)]
        cap, rounds = math.floor(self.c.max_draws_factor * target), 1
        while self.c.dynamic_sampling and len(admitted) < target and len(drawn) < cap:
            # Oversample by the admission rate seen so far in the step (at least 1/4) to save rounds.
            rate = max(len(admitted) / len(drawn), 0.25)
            k = min(math.ceil((target - len(admitted)) / rate), cap - len(drawn))
            rng = random.Random(f"{self.config.seed}:curriculum-envs:{step}:{rounds}")
            envs = rng.choices(self.envs, weights=self.ratios, k=k)
            plan = self._examples(step, rounds, envs, {})
            new = await asyncio.gather(*(run_group(env, ex, len(drawn) + i) for i, (env, ex) in enumerate(plan)))
            drawn += new
            admitted += [g for g in new if self.admits(g)]
            rounds += 1
        trained = admitted[:target]
        chosen = {id(g) for g in trained}
        for g in drawn:
            for r in g:
                r.train = id(g) in chosen
        self.pending[step] = {
            "scores": [score for g in drawn for score in self._scores(g)],
            "draws": len(drawn),
            "admitted": len(admitted),
            "trained": len(trained),
            "rounds": rounds,
        }
        return drawn

    # ----- shipping, metrics, checkpoints -----
    def metrics(self, step: int) -> dict[str, float]:
        """Metrics of a shipped step, and folds the scores an uninterrupted run has used by the next dispatch."""
        if not self.enabled:
            return {}
        record = self.pending[step]
        g = self.config.rollouts_per_example
        totals = {k: v + sum(p[k] for s, p in self.pending.items() if s <= step) for k, v in self.totals.items()}
        m = {
            "curriculum/draws": record["draws"],
            "curriculum/rollouts": record["draws"] * g,
            "curriculum/admitted": record["admitted"],
            "curriculum/rejected": record["draws"] - record["admitted"],
            "curriculum/rounds": record["rounds"],
            "curriculum/reward/mean": float(np.mean([s[3] for s in record["scores"]])) if record["scores"] else 0.0,
            "curriculum/draws_total": totals["draws"],
            "curriculum/rollouts_total": totals["draws"] * g,
            "curriculum/trained_total": totals["trained"],
        }
        self.commit(step - self.config.async_level)
        if self.c.sampler == "difficulty_pool":
            counts = dict.fromkeys(self.c.pools, 0)
            for mean, _ in self.difficulty.values():
                counts[self.pool_of(mean)] += 1
            m.update({f"curriculum/pool/{name}": n for name, n in counts.items()})
            seen = {(env, example) for env, example, _ in self.difficulty}
            m["curriculum/pool/unseen"] = sum(self.num_examples.values()) - len(seen)
        return m

    def commit(self, through: int) -> None:
        if through <= self.folded_through:
            return
        self._fold(self.difficulty, through, self.folded_through)
        for step in [s for s in self.pending if s <= through]:
            record = self.pending.pop(step)
            for k in self.totals:
                self.totals[k] += record[k]
        self.folded_through = through

    def state_dict(self, next_step: int) -> dict[str, Any]:
        """State an uninterrupted run has when it dispatches ``next_step`` (every step before it shipped)."""
        through = next_step - 1 - self.config.async_level
        self.commit(through)
        return {
            "folded_through": self.folded_through,
            "totals": dict(self.totals),
            "difficulty": [[env, ex, seat, mean, n] for (env, ex, seat), (mean, n) in sorted(self.difficulty.items())],
            "pending": {str(s): p for s, p in sorted(self.pending.items()) if s < next_step},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.folded_through = int(state["folded_through"])
        self.totals = {k: int(state["totals"][k]) for k in self.totals}
        # Entries without a seat come from checkpoints written before scores were per seat: the single seat "agent".
        self.difficulty = {
            (entry[0], int(entry[1]), entry[2] if len(entry) == 5 else "agent"): (float(entry[-2]), int(entry[-1]))
            for entry in state["difficulty"]
            if self._known(entry[0], entry[1], entry[-2])
        }
        self.seats = {}
        for env, _, seat in self.difficulty:
            self.seats.setdefault(env, set()).add(seat)
        self.pending = {int(s): p for s, p in state["pending"].items()}
        for p in self.pending.values():
            scores = [s if len(s) == 4 else [s[0], s[1], "agent", s[2]] for s in p["scores"]]
            p["scores"] = [s for s in scores if self._known(s[0], s[1], s[3])]

    def _known(self, env: Any, example: Any, mean: Any) -> bool:
        """Whether a checkpoint's score applies to this run: an env it no longer draws from, or a mean that is not
        finite (written before means were kept finite), is left out; an example past its env's taskset is refused
        (the taskset changed: the scores are of other examples). Before, example -1 weighted the last example and
        one past the end was an IndexError at the first draw, a traceback in the middle of the run."""
        if env not in self.num_examples or not math.isfinite(float(mean)):
            return False
        n = self.num_examples[env]
        if type(example) is not int or not 0 <= example < n:
            raise ValueError(
                f"example {example!r} of env {env!r} is not one of its {n} examples: the taskset changed since the "
                f"checkpoint (remove {STATE_FILE} to start the curriculum from scratch)"
            )
        return True

    def save(self, directory: Path, next_step: int) -> None:
        if self.enabled:
            atomic_write_json(directory / STATE_FILE, self.state_dict(next_step))

    def load(self, directory: Path) -> None:
        path = directory / STATE_FILE
        if not path.exists():  # a FIFO or a directory there is no reason to start from scratch: it is refused
            logger.warning("no %s in %s: the curriculum starts from scratch", STATE_FILE, directory)
            return
        with reading(path, "curriculum checkpoint"):
            self.load_state_dict(read_checkpoint_json(path, "a curriculum checkpoint", STATE_BYTES))


def sequential_plan(envs: list[str], cursors: dict[str, int]) -> list[tuple[str, int]]:
    """Each env's next examples in order; advances ``cursors``."""
    plan = []
    for env in envs:
        plan.append((env, cursors[env]))
        cursors[env] += 1
    return plan
