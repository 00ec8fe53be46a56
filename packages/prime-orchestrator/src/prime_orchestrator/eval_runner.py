"""The ``eval`` process: environments x weights (base and checkpoints) -> JSON results and a table.

Each environment runs in verifiers' env server (as in training); the base weights are restored with
``/reload_weights`` before they are scored, since the server may hold a checkpoint of an earlier sweep.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from prime_core.config import ConfigError
from prime_core.config.orchestrator import EvalConfig
from prime_core.io import (
    SMALL_JSON_BYTES,
    UnreadableFile,
    atomic_write_json,
    atomic_write_text,
    is_stable,
    read_regular,
)
from prime_core.schemas.weights import ChangedWeights, verify_weights

from prime_orchestrator import client as inference
from prime_orchestrator.concurrency import ConcurrencyLimiter
from prime_orchestrator.envs import EnvRunner, server_spec, train_client
from prime_orchestrator.evals import evaluate_env, format_table
from prime_orchestrator.judges import check_judges, judge_endpoint
from prime_orchestrator.liveness import RolloutsFailed

logger = logging.getLogger("prime.eval")


def client_factory(config: EvalConfig) -> Any:
    """Per request index: verifiers' client config (train: token-in with the renderer; eval: OpenAI chat)."""
    from verifiers.v1.configs.client import EvalClientConfig

    from prime_orchestrator.envs import API_KEY_VAR

    urls = config.client.base_urls
    if config.use_chat:
        clients = [EvalClientConfig(base_url=u + "/v1", api_key_var=API_KEY_VAR) for u in urls]
    else:
        clients = [train_client(config.client, config.model.name, u) for u in urls]
    return lambda index: clients[index % len(clients)]


async def _load(config: EvalConfig, label: str, step: int | None) -> None:
    c, key = config.client, config.client.resolved_api_key()
    timeout, retries = c.update_weights_timeout, c.max_retries
    if step is None:
        try:
            await inference.reload_weights(c.base_urls, api_key=key, timeout=timeout, retries=retries)
        except RuntimeError as e:
            raise inference.WeightUpdateError(f"restoring the base weights failed: {e}") from None
    else:
        weight_dir = str(Path(config.weights_dir) / f"step_{step}")
        # Saved weights: what the directory holds, never a broadcast it once announced to a training run's servers.
        await inference.update_weights(
            c.base_urls, weight_dir, step, api_key=key, timeout=timeout, retries=retries, source="filesystem"
        )
    logger.info("scoring %s", label)


WEIGHTS_FILE = "weights.json"
"""``eval/<label>/weights.json``: the model and weights directory whose eval the label's files hold."""


def _labels(c: EvalConfig) -> list[tuple[str, int | None]]:
    return ([("base", None)] if c.eval_base else []) + [(f"step_{s}", s) for s in c.steps]


def _weights_of(c: EvalConfig, step: int | None) -> dict[str, str | None]:
    path, files = model_identity(c.model.name)
    weights = str(Path(c.weights_dir) / f"step_{step}") if step is not None else None
    return {"model": c.model.name, "weights": weights, "model_path": path, "model_files": files}


def model_identity(name: str) -> tuple[str, str | None]:
    """Where model ``name``'s files are, and a fingerprint of them (None where there are none here): a local directory
    resolved (a relative path, a trailing slash, a symlink), a hub id's snapshot in the local cache (the same files as
    that snapshot's path), else the name as given (a model only the server has)."""
    path = Path(name).expanduser()
    if not path.is_dir() and (path := _cached_snapshot(name)) is None:
        return name.rstrip("/") or name, None
    path = path.resolve()
    digest = hashlib.sha256()
    for f in sorted(path.glob("*.safetensors")) + [path / "config.json"]:
        if f.is_file():  # sizes of the weights and the whole config: two checkpoints of one model differ in content
            digest.update(f"{f.name}:{f.stat().st_size}\n".encode())
    if (path / "config.json").is_file():
        digest.update(read_regular(path / "config.json", "a model config", SMALL_JSON_BYTES))
    return str(path), digest.hexdigest()[:16]


def _cached_snapshot(repo_id: str) -> Path | None:
    """The snapshot of hub id ``repo_id``'s ``main`` revision in the local HF cache (what loading it reads), or None."""
    from prime_core.preflight import hf_cache_dir

    repo = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    try:
        commit = read_regular(repo / "refs" / "main", "a hub cache ref", 1024).decode().strip()
    except (OSError, UnreadableFile, UnicodeDecodeError):
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if commit and "/" not in commit and snapshot.is_dir() else None


def _same_weights(held: dict, mine: dict) -> bool:
    """Whether ``held`` (a weights record) names ``mine``'s weights: the same checkpoint directory (resolved now), the
    same model files (a record without ``model_path``, written before it, by its name resolved now) and, where both
    have one, the same fingerprint (a model directory whose weights were replaced is other weights)."""
    resolved = [str(Path(w).resolve()) if w else None for w in (held.get("weights"), mine["weights"])]
    if resolved[0] != resolved[1]:
        return False
    if "model_path" not in held:
        return isinstance(held.get("model"), str) and model_identity(held["model"])[0] == mine["model_path"]
    files = held.get("model_files")
    same_files = files is None or mine["model_files"] is None or files == mine["model_files"]
    return held["model_path"] == mine["model_path"] and same_files


def check_output_dir(c: EvalConfig) -> None:
    """An eval of other weights into a directory that holds one (``--output-dir`` defaults to ``outputs``) would
    overwrite its files under the same labels: a ``ConfigError`` naming the directory and both. The same weights
    again (a re-run) overwrite; a label without a record (written before records existed) is not checked."""
    out_dir = Path(c.output_dir) / "eval"
    for label, step in _labels(c):
        try:
            held = json.loads(
                read_regular(out_dir / label / WEIGHTS_FILE, "an eval's weights record", SMALL_JSON_BYTES)
            )
        except (OSError, UnreadableFile, ValueError):  # none, or not one to compare with
            continue
        if isinstance(held, dict) and not _same_weights(held, mine := _weights_of(c, step)):
            raise ConfigError(
                f"{out_dir / label} holds the eval of {_named(held)}, not {_named(mine)}: its files would be "
                "overwritten; pass another --output-dir (or remove that directory)"
            )


def _named(weights: dict) -> str:
    return f"model {weights.get('model')}" + (f" (weights {weights['weights']})" if weights.get("weights") else "")


async def _load_or_stop(
    c: EvalConfig, labels: list, this: tuple[str, int | None], results: dict, out_dir: Path
) -> None:
    """``_load``; weights that do not load (the server died or refuses them) stop the eval in one line naming the
    weights not scored and those that were (kept in results.json)."""
    try:
        await _load(c, *this)
    except inference.WeightUpdateError as e:
        left = [name for name, _ in labels[labels.index(this) :]]
        done = f"; scored: {', '.join(results)} ({out_dir / 'results.json'})" if results else ""
        raise inference.WeightUpdateError(f"{e}; not scored: {', '.join(left)}{done}") from None


def _write_results(out_dir: Path, results: dict[str, dict[str, dict[str, Any]]]) -> str:
    atomic_write_json(out_dir / "results.json", results)
    table = format_table(results)
    atomic_write_text(out_dir / "results.txt", table + "\n")
    return table


def _check_failed(name: str, label: str, rows: list[dict]) -> str | None:
    """Why an env measured nothing (every rollout failed), or None; some failed (a server that died mid-eval, their
    zeros in the mean) is a warning naming the first error."""
    failed = [r for r in rows if r["failed"]]
    if rows and len(failed) == len(rows):
        return f"env {name} ({label}): all {len(rows)} rollouts failed, e.g. {rows[0]['error']}"
    if failed:
        logger.warning(
            "env %s (%s): %d of %d rollouts failed (scored 0), e.g. %s",
            *(name, label, len(failed), len(rows), failed[0]["error"]),
        )
    return None


class StepsNotReady(inference.WeightUpdateError):
    """A requested checkpoint step without its STABLE marker within ``weights_timeout``, or whose files changed after
    the trainer wrote them: nothing was scored."""


async def wait_for_steps(c: EvalConfig) -> None:
    """Every requested step complete before anything is scored: a checkpoint still being written (renamed into place,
    its STABLE marker not yet written) is waited for, up to ``weights_timeout``. Before, the base model was scored
    first (minutes on a real model) and the eval then failed at that step's load."""
    steps = {s: Path(c.weights_dir) / f"step_{s}" for s in c.steps} if c.weights_dir is not None else {}
    await _wait_stable(c, steps)
    for step, path in steps.items():  # a file changed since the trainer wrote it: refused before anything is scored
        try:
            await asyncio.to_thread(verify_weights, path, step)
        except ChangedWeights as e:
            raise StepsNotReady(f"--steps: {e}; nothing was scored") from None


async def _wait_stable(c: EvalConfig, steps: dict[int, Path]) -> None:
    pending = [s for s, path in steps.items() if not is_stable(path)]
    if not pending:
        return
    names = ", ".join(f"step_{s}" for s in pending)
    logger.warning("waiting up to %gs (weights_timeout) for the STABLE marker of %s under %s (still being written?)",
                   c.weights_timeout, names, c.weights_dir)  # fmt: skip
    start = said = time.monotonic()
    while pending := [s for s in pending if not is_stable(steps[s])]:
        now = time.monotonic()
        if now - said >= 30:
            said = now
            logger.warning("still waiting for the STABLE marker of %s after %.0fs (weights_timeout %gs)",
                           ", ".join(f"step_{s}" for s in pending), now - start, c.weights_timeout)  # fmt: skip
        if now - start > c.weights_timeout:
            left = ", ".join(f"step_{s}" for s in pending)
            raise StepsNotReady(
                f"--steps: {left} under {c.weights_dir} has no STABLE marker after {c.weights_timeout:g}s "
                "(weights_timeout): a checkpoint still being written, or an incomplete copy; nothing was scored"
            )
        await asyncio.sleep(0.2)


async def run_eval(config: EvalConfig) -> dict[str, dict[str, dict[str, Any]]]:
    c = config
    await wait_for_steps(c)  # before the base model is scored, not after
    key = c.client.resolved_api_key()
    await inference.wait_healthy(c.client.base_urls, api_key=key, timeout=c.client.health_timeout, fail_fast=True)
    envs = c.resolved_envs()
    judge = judge_endpoint(c.judge, c.client, c.model.name)
    runners = {e.resolved_name: EnvRunner(e, server_spec(e, judge=judge), max_retries=1) for e in envs}
    if c.judge.check:
        await check_judges([r.spec for r in runners.values()], c.judge.check_timeout)
    labels = _labels(c)
    results: dict[str, dict[str, dict[str, Any]]] = {}
    dead: dict[str, str] = {}
    out_dir = Path(c.output_dir) / "eval"
    semaphore = ConcurrencyLimiter.from_config(c.client)
    client_for = client_factory(c)
    stopped: BaseException | None = None
    try:
        await asyncio.gather(*(r.start() for r in runners.values()))
        for label, step in labels:
            # An OpenAI server of someone else's (use_chat) has no admin routes unless checkpoints are swept.
            if step is not None or c.steps or not c.use_chat:
                await _load_or_stop(c, labels, (label, step), results, out_dir)
            atomic_write_json(out_dir / label / WEIGHTS_FILE, _weights_of(c, step))
            scores: dict[str, dict[str, Any]] = {}
            for name, runner in runners.items():
                summary, rows = await evaluate_env(
                    runner,
                    client_for=client_for,
                    model=c.model.name,
                    num_examples=c.num_examples,
                    rollouts_per_example=c.rollouts_per_example,
                    sampling=c.sampling,
                    seed=c.seed,
                    semaphore=semaphore,
                )
                scores[name] = summary
                atomic_write_json(out_dir / label / f"{name}.json", {"summary": summary, "rollouts": rows})
                if reason := _check_failed(name, label, rows):
                    dead.setdefault(name, reason)
                logger.info("%s %s: reward %.4f", label, name, summary["reward/mean"])
            results[label] = scores  # only weights with every env scored: results.json never holds half of one
    except BaseException as e:
        stopped = e
        raise
    finally:
        await asyncio.gather(*(r.close() for r in runners.values()), semaphore.aclose(), return_exceptions=True)
        # Also when the eval stops early: the scores so far, never an earlier eval's results left in this directory.
        try:
            table = _write_results(out_dir, results)
        except OSError as e:
            if stopped is None:
                raise
            logger.warning("results of the weights scored so far not written: %s", e)  # what stopped the eval wins
    print(table, flush=True)
    if dead:  # a reward of 0 that measures nothing (a package the taskset imports per rollout is missing)
        raise RolloutsFailed(next(iter(dead.values())))
    return results


__all__ = ["run_eval"]
