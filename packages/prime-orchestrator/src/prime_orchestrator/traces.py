"""A verifiers episode -> the rollout the trainer side sees: per trace (agent run), its seat, its own reward and the
token sequences it trains.

Verifiers records rewards per trace: a two-player game scores each seat's trace, an env that runs a seat several
times scores each attempt, and ``Env.finalize`` may add cross-trace rewards to each. Every trainable trace is
therefore its own unit of credit (``prime_orchestrator.credit``); its branches (verifiers: "each branch becomes one
training sample") all carry its reward. A sampled node that several branches of a trace share trains only in the
first of them, as in prime-rl, so no turn's gradient is counted twice.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

from prime_core.io import one_line
from prime_core.schemas.rollout import RolloutResult, TraceResult, TrainedSequence


def _text(content: Any) -> str:
    from verifiers.v1.types import content_text

    return content_text(content) if content is not None else ""


def _message_text(message: Any) -> str:
    text = _text(getattr(message, "content", None))
    calls = getattr(message, "tool_calls", None) or []
    calls_text = "".join(f"\n[tool_call {c.name}({c.arguments})]" for c in calls)
    return f"[{message.role}] {text}{calls_text}"


def _images(messages: list[Any]) -> list[str]:
    """The image URLs of a branch's messages in prompt order (the order of its placeholder runs)."""
    urls = []
    for message in messages:
        content = getattr(message, "content", None)
        for part in content if isinstance(content, list) else []:
            if getattr(part, "type", None) == "image_url":
                urls.append(part.image_url.url)
    return urls


def _sequences(trace: Any) -> list[TrainedSequence]:
    """Every trainable branch of ``trace`` that samples something new; sampled nodes an earlier branch holds are
    masked (context, not trained, in this one)."""
    sequences = []
    trained: set[int] = set()
    for branch in trace.branches:
        if not branch.trainable:
            continue
        mask, logprobs = branch.sampled_mask, branch.logprobs
        at = 0
        for node in branch.nodes:
            n = len(node.token_ids)
            if node.sampled and id(node) in trained:
                mask[at : at + n] = [False] * n
                logprobs[at : at + n] = [0.0] * n
            elif node.sampled:
                trained.add(id(node))
            at += n
        if not any(mask):
            continue
        images = _images(branch.messages) if branch.mm_token_type_ids else []
        sequences.append(TrainedSequence(token_ids=branch.token_ids, loss_mask=mask, logprobs=logprobs, images=images))
    return sequences


def trace_result(trace: Any, trains: bool) -> TraceResult:
    metrics = {k: float(v) for k, v in trace.metrics.items() if v is not None}
    # Each reward function's own score, unweighted, as verifiers reports it (its weight counts in ``trace.reward``).
    metrics.update({f"reward/{k}": float(r.score) for k, r in trace.rewards.items() if r is not None})
    return TraceResult(
        seat=trace.agent.name,
        trainable=trains,
        reward=float(trace.reward),
        metrics=metrics,
        num_turns=trace.num_turns,
        replaced_replies=len(trace.response_rewrites),
        sequences=_sequences(trace) if trains else [],
    )


def seat_metrics(traces: list[TraceResult]) -> dict[str, float]:
    """Each metric averaged over a seat's traces (its attempts); named ``<seat>/<name>`` when several seats play."""
    per_seat: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for t in traces:
        for k, v in t.metrics.items():
            per_seat[t.seat][k].append(v)
    prefix = len({t.seat for t in traces}) > 1
    return {
        f"{seat}/{k}" if prefix else k: sum(vs) / len(vs)
        for seat, values in per_seat.items()
        for k, vs in values.items()
    }


def summary_metrics(results: list[RolloutResult]) -> dict[str, float]:
    """Each reward's (``reward/<name>``) and metric's mean over the scored traces of ``results`` by its own name,
    seats and attempts pooled, as verifiers summarizes a run (``prime_runs.metrics.from_episodes``, what vf-eval
    pushes); where several seats play, also ``<seat>/<name>`` over that seat's traces (vf-eval's per-role rows)."""
    traces = [t for r in results for t in r.traces]
    several = len({t.seat for t in traces}) > 1
    values: dict[str, list[float]] = defaultdict(list)
    for t in traces:
        for k, v in t.metrics.items():
            values[k].append(v)
    for t in traces if several else []:
        for k, v in t.metrics.items():
            values[f"{t.seat}/{k}"].append(v)
    return {k: sum(vs) / len(vs) for k, vs in values.items()}


def to_result(
    episode: Any, env: str, example: int, latency: float, complete: Callable[[Any], bool] | None = None
) -> RolloutResult:
    """The trained view of an episode: one ``TraceResult`` per trainable trace (agent seats and attempts; a simulated
    user or judge trains nothing), with the tokens, mask and log-probs verifiers recorded. An episode the env does not
    accept (``complete``: the env's ``Env.complete``, by default its ``ok`` stamp) is failed; one that verifiers
    retried to success (``retries``) is not, though it keeps the earlier attempts' errors: "success is the ``ok``
    stamp, never errors-emptiness" (verifiers); nor is one the env accepts though a seat failed in it."""
    done = [t for t in episode.traces if t.branches]
    if not (complete(episode) if complete is not None else episode.ok) or not done:
        error = episode.last_error or next((t.last_error for t in episode.traces if not t.ok and t.errors), None)
        if error is not None:
            message = error.message
        else:
            message = "the episode produced no trace" if not done else "the env marked the episode not ok (no error)"
        # What verifiers scored before the failure (metrics recorded before a reward raised, turns played) stays for
        # the summaries, as vf-eval's counts it; none of it trains.
        recorded = [trace_result(t, trains=False) for t in [t for t in episode.traces if t.agent.trainable] or done]
        return RolloutResult(
            env=env,
            example=example,
            failed=True,
            error=one_line(message),
            traces=recorded,
            metrics=seat_metrics(recorded),
            num_turns=sum(t.num_turns for t in recorded),
        )
    # An env where no seat trains (an eval of a fixed pair of agents) is scored over all of them, as vf-eval does. A
    # seat the env never asked (a hand folded before its turn) has no branch but a reward: verifiers scores it; it
    # made no choice to credit, so it trains nothing and stays out of its seat's baseline (no empty completion).
    trainable = [t for t in episode.traces if t.agent.trainable]
    scored = trainable or episode.traces
    traces = [trace_result(t, trains=bool(trainable) and bool(t.branches)) for t in scored]
    shown = next((t for t in scored if t.branches), done[0]).branches[-1]
    first = next((i for i, n in enumerate(shown.nodes) if n.sampled), len(shown.nodes))
    head = next((t.sequences[0].loss_mask for t in traces if t.sequences), [])
    return RolloutResult(
        env=env,
        example=example,
        traces=traces,
        reward=sum(t.reward for t in traces) / len(traces),
        metrics=seat_metrics(traces),
        num_turns=sum(t.num_turns for t in traces),
        prompt_len=head.index(True) if True in head else len(head),
        completion_len=sum(t.completion_len for t in traces),
        truncated=any(t.is_truncated for t in scored),
        latency=latency,
        scoring_s=sum(t.timing.scoring.duration for t in scored),
        prompt="\n".join(_message_text(m) for m in shown.messages[:first]),
        completion="\n".join(_message_text(m) for m in shown.messages[first:]),
    )
