"""On-policy distillation: a frozen teacher scores the tokens the student sampled.

For every trained sequence of an environment with ``distill`` set, the teacher's log-prob of each token given the
tokens before it comes from one prefill on the token-in route (``/inference/v1/generate`` with ``max_tokens = 1``,
``prompt_logprobs = 0``): the student's own context, no re-tokenization. On a sampled token t the per-token reverse
KL estimate is k_t = log p_student(t) - log p_teacher(t) (the student's log-prob is the one it sampled with), and
the token's advantage is ``reward_weight * A + kl_weight * (-k_t)``: the trainer's policy-gradient loss then
minimizes the reverse KL to the teacher, mixed with the task reward. It rides the existing per-token advantages
array, so the trainer and its losses are unchanged.

Teacher and student must share a tokenizer (the teacher scores the student's token ids); ``start`` checks it.

Self-distillation (``opsd``): with a ``privileged_prompt`` the teacher scores ``prompt + the student's tokens`` and the
log-probs of the student's tokens are read after the prompt, so the teacher (for instance the frozen initial policy
that ``rl`` serves from ``[teacher]`` without a model) conditions on context the student never sees.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prime_core import progress
from prime_core.config.distill import DistillConfig, TeacherConfig
from prime_core.config.orchestrator import OrchestratorConfig
from prime_core.schemas.rollout import TrainedSequence

from prime_orchestrator.client import NoAnswer, headers, post_json, wait_healthy
from prime_orchestrator.liveness import InflightLane
from prime_orchestrator.sample_checks import MAX_LOGPROB

logger = logging.getLogger("prime.orchestrator.distill")

SCORE_ROUTE = "/inference/v1/generate"
# Probe texts of the tokenizer check through a server's /tokenize: words, digits, whitespace, punctuation, scripts.
PROBES = (
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = \\boxed{42}",
    "  leading spaces,\ttabs\nand new lines\n\n  ",
    "Ünïcödé: naïve café, 你好世界, Привет, مرحبا, 🙂👍",
    '<think>reasoning</think> {"name": "f", "arguments": {"x": 1}} <answer>7</answer>',
)


class TeacherError(RuntimeError):
    """The teacher cannot serve this run (unreachable, failing, another tokenizer): one line naming it."""


class TokenizerMismatch(TeacherError, ValueError):
    pass


def unserved(env: str, teacher: TeacherConfig) -> str | None:
    """Why an env's teacher cannot be asked (``rl`` fills both fields from ``[teacher]``), or None."""
    for name, value in (("base_url", teacher.base_url), ("model", teacher.model)):
        if value is None:
            return (
                f"env {env!r}: distill.teacher.{name} is unset (rl fills it from [teacher]; a standalone orchestrator "
                "needs the teacher server's)"
            )
    return None


def _load_tokenizer(name: str) -> Any:
    """A ``tokenizers`` tokenizer from a model directory, a ``tokenizer.json``, or a hub id (its cache)."""
    from tokenizers import Tokenizer

    path = Path(name)
    if path.is_dir():
        path = path / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else Tokenizer.from_pretrained(name)


def _vocab_mismatch(student: Any, teacher: Any) -> str | None:
    a, b = student.get_vocab(with_added_tokens=True), teacher.get_vocab(with_added_tokens=True)
    if a == b:
        return None
    differ = sum(a.get(t) != i for t, i in b.items()) + sum(t not in b for t in a)
    return f"vocabularies of {len(a):,} and {len(b):,} tokens, {differ:,} entries differ"


async def check_tokenizer(student_dir: str, teacher: TeacherConfig, client: httpx.AsyncClient) -> None:
    """A one-line ``TokenizerMismatch`` unless the teacher tokenizes as the student: the same vocabulary (given
    ``teacher.tokenizer``), else the same ids from the server's ``/tokenize`` on the probes and special tokens."""
    student = await asyncio.to_thread(_load_tokenizer, student_dir)
    what = f"the teacher {teacher.model!r} at {teacher.base_url} and the student {student_dir!r}"
    if teacher.tokenizer is not None:
        problem = _vocab_mismatch(student, await asyncio.to_thread(_load_tokenizer, teacher.tokenizer))
        if problem:
            raise TokenizerMismatch(f"{what} must share a tokenizer: {problem} (distill.teacher.tokenizer)")
        return
    specials = [t.content for t in student.get_added_tokens_decoder().values() if t.special]
    for text in (*PROBES, " ".join(specials)):
        want = student.encode(text, add_special_tokens=False).ids
        body = {"model": teacher.model, "prompt": text, "add_special_tokens": False}
        try:
            got = (await post_json(client, f"{teacher.base_url}/tokenize", body, timeout=30, retries=1))["tokens"]
        except (RuntimeError, KeyError, TypeError) as e:
            reason = str(e).splitlines()[0][:200]
            raise TokenizerMismatch(
                f"cannot check the tokenizer of {what} ({reason}): set distill.teacher.tokenizer"
            ) from None
        if got != want:
            raise TokenizerMismatch(f"{what} must share a tokenizer: {text[:30]!r} is {got[:8]}... vs {want[:8]}...")


class Teacher:
    """One teacher endpoint: scoring requests with a concurrency bound and retries."""

    def __init__(self, env: str, config: DistillConfig):
        self.env = env
        self.config = config
        t = config.teacher
        key = os.environ.get(t.api_key_var) if t.api_key_var else None
        self.key = key
        self.client = httpx.AsyncClient(headers=headers(key), timeout=t.timeout)
        self.semaphore = asyncio.Semaphore(t.max_concurrent)
        self.prefix: list[int] = []
        """The privileged prompt's token ids (self-distillation), before every scored sequence."""
        self._outage: asyncio.Future | None = None
        """The wait for the teacher to answer again, shared by every request that found it gone."""

    async def start(self, student_dir: str) -> None:
        t = self.config.teacher
        if problem := unserved(self.env, t):
            raise TeacherError(problem)
        try:
            await wait_healthy([t.base_url], api_key=self.key, timeout=t.health_timeout)
        except TimeoutError:
            # Said as "inference server <url> not healthy", it read as the policy's server, whose wait runs beside it.
            raise TeacherError(
                f"teacher of env {self.env!r} at {t.base_url}: not healthy after {t.health_timeout:g}s "
                "(distill.teacher.health_timeout)"
            ) from None
        await check_tokenizer(student_dir, t, self.client)
        if self.config.privileged_prompt:
            student = await asyncio.to_thread(_load_tokenizer, student_dir)
            self.prefix = student.encode(self.config.privileged_prompt, add_special_tokens=False).ids
            logger.info("env %s: the teacher reads a privileged prompt of %d tokens", self.env, len(self.prefix))

    async def logprobs(self, token_ids: list[int]) -> list[float]:
        """The teacher's log-prob of every token given the ones before it (and the privileged prompt); 0.0 at
        position 0 without one."""
        t = self.config.teacher
        body = {
            "model": t.model,
            "token_ids": self.prefix + token_ids,
            "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0},
        }
        async with self.semaphore:
            try:
                out = await self._post(body)
            except NoAnswer as e:  # down or restarting: wait for it (bounded), then ask once more
                await self._wait_back(str(e).splitlines()[0])
                try:
                    out = await self._post(body)
                except NoAnswer as again:
                    raise TeacherError(
                        f"teacher of env {self.env!r} at {t.base_url}: {str(again).splitlines()[0]} (after its "
                        "/health answered again)"
                    ) from None
        problem, scores = read_scores(out, self.prefix + token_ids)
        if problem is not None:
            raise TeacherError(f"teacher of env {self.env!r} at {t.base_url} answered {problem}")
        return scores[len(self.prefix) :]

    async def _post(self, body: dict[str, Any]) -> Any:
        t = self.config.teacher
        try:
            return await post_json(
                self.client, t.base_url + SCORE_ROUTE, body, timeout=t.timeout, retries=t.max_retries
            )
        except NoAnswer:
            raise
        except RuntimeError as e:
            raise TeacherError(f"teacher of env {self.env!r} at {t.base_url}: {str(e).splitlines()[0]}") from None

    async def _wait_back(self, reason: str) -> None:
        """A teacher that stopped answering (a restart of its server: seconds to minutes of loading) gets as long to
        answer ``/health`` again as it had to start, ``health_timeout``; ended its retries (~3.5 s by default), an
        unattended run died at a blip. Requests that find it gone together share one wait."""
        if self._outage is None or self._outage.done():
            self._outage = asyncio.ensure_future(self._wait_healthy_again(reason))
        await asyncio.shield(self._outage)

    async def _wait_healthy_again(self, reason: str) -> None:
        t = self.config.teacher
        what = f"teacher of env {self.env!r} at {t.base_url}"
        bound = f"{t.health_timeout:g}s (distill.teacher.health_timeout)"
        logger.warning("%s does not answer (%s); waiting up to %s for its /health to answer again", what, reason, bound)
        t0 = time.monotonic()
        waiting = f"waiting up to {bound} for the {what} to answer /health again"
        with progress.activity(waiting, lane=f"teacher_{self.env}", limit_s=t.health_timeout, waits_for="teacher"):
            try:
                await wait_healthy([t.base_url], api_key=self.key, timeout=t.health_timeout)
            except TimeoutError:
                raise TeacherError(
                    f"{what}: does not answer ({reason}), and its /health did not answer again within {bound}"
                ) from None
        logger.warning("%s answers /health again after %.1fs; scoring goes on", what, time.monotonic() - t0)

    def advantages(self, seq: TrainedSequence, advantage: float) -> list[float]:
        """Per token: reward_weight * A + kl_weight * (log p_teacher - log p_student) on sampled tokens, else 0."""
        c = self.config
        mask = np.asarray(seq.loss_mask, np.bool_)
        signal = np.asarray(seq.teacher_logprobs, np.float64) - np.asarray(seq.logprobs, np.float64)
        return np.where(mask, c.reward_weight * advantage + c.kl_weight * signal, 0.0).tolist()


def read_scores(out: Any, token_ids: list[int]) -> tuple[str | None, list[float]]:
    """(None, the log-prob of each token) from a scoring answer, or (the first thing wrong with it, []). Only the
    first position may have no entry (nothing precedes it: 0.0). Everything else a real teacher never sends is
    named: it would otherwise train, as it came, as the per-token signal (a NaN poisoned the step's gradient, a
    positive log-prob or a missing entry, read as 0.0, rewarded tokens the teacher never scored)."""
    entries = out.get("prompt_logprobs") if isinstance(out, dict) else None
    if not isinstance(entries, list):
        return f"no prompt_logprobs list (does it serve prompt_logprobs on {SCORE_ROUTE}?)", []
    if len(entries) != len(token_ids):
        return (
            f"{len(entries)} prompt_logprobs for {len(token_ids)} tokens (does it serve prompt_logprobs on "
            f"{SCORE_ROUTE}?)"
        ), []
    scores = []
    for i, (entry, token) in enumerate(zip(entries, token_ids, strict=True)):
        if entry is None and i == 0:
            scores.append(0.0)
            continue
        value = entry.get(str(token)) if isinstance(entry, dict) else None
        logprob = value.get("logprob") if isinstance(value, dict) else None
        if type(logprob) not in (int, float):
            return f"prompt_logprobs[{i}] without a log-prob of token {token} (got {str(entry)[:80]})", []
        if not math.isfinite(logprob) or logprob > MAX_LOGPROB:
            return f"prompt_logprobs[{i}] = {logprob!r} for token {token} (a log-prob is finite and <= 0)", []
        scores.append(float(logprob))
    return None, scores


def _covered(spans: list[tuple[float, float]]) -> float:
    """Length of the union of the intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


class Teachers:
    """The teachers of a run's distilling environments; for the others every call is a no-op."""

    def __init__(self, config: OrchestratorConfig):
        self.student_dir = config.model.name
        self.by_env = {e.resolved_name: Teacher(e.resolved_name, e.distill) for e in config.env if e.distill}
        # One request may take its timeout on every attempt, with the back-off between (post_json).
        teachers = [t.config.teacher for t in self.by_env.values()]
        # A teacher gone away (a restart) adds its wait for /health, and the request is then asked once more.
        limit = max(((t.timeout + 5) * (t.max_retries + 1) * 2 + t.health_timeout for t in teachers), default=0.0)
        self.lane = InflightLane("teachers", "scoring with the teachers", limit)
        self.spans: dict[int, list[tuple[float, float]]] = {}
        """step -> (start, end) of each group's teacher scoring; groups score concurrently, so these overlap."""

    async def start(self) -> None:
        await asyncio.gather(*(t.start(self.student_dir) for t in self.by_env.values()))

    def distils(self, env: str) -> bool:
        return env in self.by_env

    async def score(self, step: int, env: str, rollouts: list) -> list:
        """Attach the teacher's log-probs to every trained sequence of a group's rollouts (no-op for RL envs)."""
        teacher = self.by_env.get(env)
        if teacher is None:
            return rollouts
        t0 = time.perf_counter()
        seqs = [q for r in rollouts for q in r.result.sequences]
        if with_images := sum(len(q.images) for q in seqs):
            # The scoring route serves text prompts only: the teacher would read each image's placeholder tokens as
            # text, and its log-probs of the student's tokens, conditioned on no image, trained as the signal.
            raise TeacherError(
                f"env {env!r} distils from {teacher.config.teacher.base_url}, but its rollouts carry images "
                f"({with_images} in this group) and a teacher scores text prompts only: distil a text-only env"
            )
        scores = await asyncio.gather(*(self.lane.track(teacher.logprobs(q.token_ids)) for q in seqs))
        for q, lps in zip(seqs, scores, strict=True):
            q.teacher_logprobs = lps
        self.spans.setdefault(step, []).append((t0, time.perf_counter()))
        return rollouts

    def advantage(self, env: str, seq: TrainedSequence, advantage: float) -> float | list[float]:
        teacher = self.by_env.get(env)
        return advantage if teacher is None else teacher.advantages(seq, advantage)

    def metrics(self, step: int, groups: list) -> dict[str, float]:
        """Per distilling env: the mean reverse KL per sampled token; the step's teacher scoring time."""
        if not self.by_env:
            return {}
        spans = self.spans.pop(step, [])
        m: dict[str, float] = {
            # Wall time with a scoring request of the step in flight: what to hold against time/rollouts.
            "time/teacher_scoring": _covered(spans),
            "time/teacher_scoring_sum": sum(end - start for start, end in spans),
        }
        for env in self.by_env:
            kl = [
                lp - tlp
                for g in groups
                for r in g
                if r.env == env
                for q in r.result.sequences
                if q.teacher_logprobs is not None
                for lp, tlp, sampled in zip(q.logprobs, q.teacher_logprobs, q.loss_mask, strict=True)
                if sampled
            ]
            if kl:
                m[f"distill/{env}/reverse_kl"] = float(np.mean(kl))
        return m

    async def close(self) -> None:
        await asyncio.gather(*(t.client.aclose() for t in self.by_env.values()), return_exceptions=True)
