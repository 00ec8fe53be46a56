"""The orchestrator: two loops joined by a bounded buffer.

``rollout_loop`` produces step batches: before dispatching step n it waits until inference serves weights
of step >= n - async_level, then schedules the step's groups (each rollout tagged with the weight step
served when it was dispatched) and moves on to step n + 1 while they run, so inference stays busy while
the trainer trains. ``ship_loop`` takes the batches in step order: advantages, filters, packing, transport,
metrics and checkpoints. ``Policy.watch`` relays every new ``weights/step_N`` to inference. Because
weights N + 1 only exist after the trainer consumed step N, step n is never dispatched before the trainer
finished step n - async_level - 1: the orchestrator is at most async_level steps ahead.

With ``max_off_policy_steps`` the rollout side is ``prime_orchestrator.continuous`` instead: groups run back to back
and batches take them in completion order, under an exact bound on each rollout's staleness. Either way every
rollout's requests are tagged and the versions that sampled its tokens read back (``prime_orchestrator.versions``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import time
from typing import Any

import numpy as np
from prime_core import progress
from prime_core.config.orchestrator import EnvConfig, OrchestratorConfig
from prime_core.io import UnreadableFile, atomic_dir, atomic_write_json, is_stable, reading, writing
from prime_core.monitor import build_monitor
from prime_core.run_dir import RunDir
from prime_core.transport import make_sender
from prime_core.vision import VisionSpec

from prime_orchestrator import client as inference
from prime_orchestrator.batch import Rollout, ShippedSteps, StepBatch, rollout_timeline
from prime_orchestrator.concurrency import ConcurrencyLimiter
from prime_orchestrator.continuous import Continuous
from prime_orchestrator.credit import seat_step_metrics, step_samples
from prime_orchestrator.curriculum import PROGRESS_BYTES, Curriculum, read_checkpoint_json
from prime_orchestrator.distill import Teachers
from prime_orchestrator.envs import EnvRunner, request_seed, sampling_args, server_spec, train_client
from prime_orchestrator.evals import evaluate_envs
from prime_orchestrator.judges import check_judges, judge_endpoint
from prime_orchestrator.liveness import (
    InflightLane,
    RolloutsFailed,
    RolloutTracker,
    check_step,
    env_metrics,
    report_env_servers,
    ship_activity,
)
from prime_orchestrator.packing import Sample, pack, seq_len_too_short
from prime_orchestrator.versions import Flight, VersionRecords, bounds, version_metrics
from prime_orchestrator.weight_relay import Policy

logger = logging.getLogger("prime.orchestrator")


class Orchestrator:
    def __init__(self, config: OrchestratorConfig):
        self.config = config
        self.run_dir = RunDir(config.output_dir)
        self.pools: dict[str, EnvRunner] = {}
        self.eval_pools: dict[str, EnvRunner] = {}
        self.envs: dict[str, EnvConfig] = {e.resolved_name: e for e in config.env}
        self.cursors = {name: 0 for name in self.envs}
        self.curriculum = Curriculum(config)
        self.teachers = Teachers(config)
        self.start_step = 0
        self.policy = Policy(config, self.run_dir)
        self.tracker = RolloutTracker(config)
        self.eval_lane = InflightLane("evals", "generating eval rollouts", self.tracker.limit_s)
        self.semaphore = ConcurrencyLimiter.from_config(config.client, None if config.model.lora else self.policy)
        self.versions = VersionRecords(
            config.client, check=config.model.lora is None, held=config.dispatch_ahead, run_dir=self.run_dir
        )
        self.monitor = None
        self.sender = None
        self.shipped = ShippedSteps()
        self.cursor_history: dict[int, dict[str, int]] = {}
        self._eval_tasks: list[asyncio.Task] = []
        self._clients: dict[str, Any] = {}
        self._requests = 0
        # Image preprocessing of a vision-language model (None for text models): packing patchifies rollout images.
        self.vision = VisionSpec.from_model_dir(config.model.name)

    # ----- setup -----
    @property
    def served_model(self) -> str:
        """The model name requests carry: a LoRA run's adapter (the base directory still provides the tokenizer)."""
        c = self.config
        return c.model.lora.adapter_name if c.model.lora is not None else c.model.name

    def url_for(self, index: int) -> str:
        """The server of rollout ``index``: rollouts are spread over the servers round-robin."""
        urls = self.config.client.base_urls
        return urls[index % len(urls)]

    def client_for(self, index: int) -> Any:
        """Verifiers' train client config of request ``index``: requests are spread over the servers round-robin."""
        url = self.url_for(index)
        if url not in self._clients:
            self._clients[url] = train_client(self.config.client, self.config.model.name, url)
        return self._clients[url]

    def _runner(self, env: EnvConfig, name: str) -> EnvRunner:
        # The base model's name: a LoRA run's adapter is loaded only after the start-up check of judge endpoints.
        judge = judge_endpoint(self.config.judge, self.config.client, self.config.model.name)
        spec = server_spec(env, name, judge, recovery=self.config.recovery)
        return EnvRunner(env, spec, max_retries=self.config.max_rollout_retries)

    async def setup(self) -> None:
        c = self.config
        self.policy.refuse_later_weights(c.ckpt.resume_step or 0)  # before any server starts
        self.monitor = build_monitor(
            c.monitor, output_dir=c.output_dir, process="orchestrator", run_config=c.model_dump(mode="json")
        )
        for env in c.env:
            self.pools[env.resolved_name] = self._runner(env, env.resolved_name)
        for env in c.eval.envs:
            self.eval_pools[env.resolved_name] = self._runner(env, f"eval/{env.resolved_name}")
        report_env_servers(self.pools)
        # Env servers start (seconds of imports per worker) while the inference server starts; rl launches the
        # orchestrator beside its own server for this.
        teachers = " and the teachers'" if self.teachers.by_env else ""
        progress.begin(f"starting env servers and waiting for inference's{teachers} /health", waits_for="inference")
        await asyncio.gather(
            inference.wait_healthy(
                c.client.base_urls,
                api_key=c.client.resolved_api_key(),
                timeout=c.client.health_timeout,
                run_id=c.client.server_run_id,
            ),
            *(p.start() for p in [*self.pools.values(), *self.eval_pools.values()]),
            self.teachers.start(),
        )
        progress.end()
        self.curriculum.start({name: pool.num_examples for name, pool in self.pools.items()})
        if c.judge.check:
            await check_judges(
                [p.spec for p in [*self.pools.values(), *self.eval_pools.values()]], c.judge.check_timeout
            )
        if c.ckpt.resume_step:
            self._load_checkpoint(c.ckpt.resume_step)
        await self.policy.resume(self.start_step)
        if c.model.lora is not None and self.policy.num_updates == 0:
            await self._load_initial_adapter()
        self.sender = make_sender(c.transport, self.run_dir, c.num_trainer_ranks)

    async def _load_initial_adapter(self) -> None:
        """Inference serves a LoRA run's adapter name only once loaded: wait for the trainer's adapter of the
        start step (a fresh adapter at step 0) and load it before the first rollout."""
        path = self.run_dir.weight_step(self.start_step)
        deadline = time.monotonic() + self.config.weights_timeout
        with progress.activity(f"waiting for the trainer's adapter ({path})", lane="policy", waits_for="trainer"):
            while not is_stable(path):
                if time.monotonic() > deadline:
                    timeout = self.config.weights_timeout
                    raise TimeoutError(f"waited {timeout:.0f}s for {path}/STABLE; is the trainer running?")
                await asyncio.sleep(0.2)
        await self.policy.load(self.start_step)

    # ----- checkpoints -----
    def _save_checkpoint(self, next_step: int) -> None:
        cursors = self.cursor_history.get(next_step, self.cursors)
        path = self.run_dir.orchestrator_checkpoint(next_step)
        with writing(f"orchestrator checkpoint step {next_step}", path), atomic_dir(path) as tmp:
            atomic_write_json(tmp / "progress.json", {"step": next_step, "cursors": cursors, "seed": self.config.seed})
            self.curriculum.save(tmp, next_step)
        logger.info("saved orchestrator checkpoint %s", self.run_dir.orchestrator_checkpoint(next_step))

    def _load_checkpoint(self, step: int) -> None:
        path = self.run_dir.orchestrator_checkpoint(step) / "progress.json"
        if not path.is_file():  # missing, or a FIFO: one line (exit 1), not a FileNotFoundError traceback
            raise UnreadableFile(f"{path}: {'not a regular file' if path.exists() else 'missing'} (a checkpoint's)")
        with reading(path, "orchestrator checkpoint"):
            state = read_checkpoint_json(path, "an orchestrator checkpoint", PROGRESS_BYTES)
            step, cursors = int(state["step"]), {k: int(v) for k, v in state["cursors"].items() if k in self.cursors}
        self.start_step = step
        self.cursors.update(cursors)
        logger.info("resuming at step %d", self.start_step)

    # ----- rollouts -----
    def _plan_step(self, step: int) -> list[tuple[str, int]]:
        """(env, example) for each group of the step: envs mixed by ratio with a per-step seeded RNG."""
        c = self.config
        rng = random.Random(f"{c.seed}:{step}")
        names = list(self.envs)
        weights = [self.envs[n].ratio for n in names]
        chosen = rng.choices(names, weights=weights, k=c.batch_size // c.rollouts_per_example)
        return self.curriculum.plan(step, chosen, self.cursors)

    def _oldest_weights(self, step: int) -> int | None:
        """The weight step a dispatched-ahead rollout of ``step`` waits for at the inference server (None: it may
        start on what is served now)."""
        oldest = step - self.config.async_level
        return oldest if self.config.dispatch_ahead and oldest > self.policy.version else None

    async def _rollout(
        self, step: int, env: str, example: int, group: int, index: int, flight: Flight | None = None
    ) -> Rollout:
        c = self.config
        flight = flight or Flight()
        async with self.semaphore:
            admitted = time.perf_counter()
            oldest = self._oldest_weights(step)
            weight_step = flight.started = max(self.policy.version, oldest or 0)
            self._requests += 1
            flight.url, flight.tag = self.url_for(self._requests), self.versions.new_tag()
            seed = request_seed(c.seed, step, index) if flight.seed is None else flight.seed
            result = await self.pools[env].rollout(
                example,
                client=self.client_for(self._requests),
                model=self.served_model,
                sampling=sampling_args(c.sampling, seed=seed, tag=flight.tag, oldest_weights=oldest),
            )
        if not result.failed:  # the weight steps that sampled its tokens (`prime_orchestrator.versions`)
            result.versions = await self.versions.take(flight) or bounds(weight_step, self.policy.version)
            flight.versions = result.versions
        else:  # tokens it sampled before failing have a record on the server too: popped, not left to its cap
            self.versions.forget(flight)
        result = self.tracker.record(self.tracker.screen(result, flight.url))
        return Rollout(env, example, group, weight_step, result, admitted=admitted, done=time.perf_counter())

    async def _group(self, step: int, env: str, example: int, gi: int) -> list[Rollout]:
        g = self.config.rollouts_per_example
        rollouts = await asyncio.gather(
            *(self.tracker.track(step, self._rollout(step, env, example, gi, gi * g + j)) for j in range(g))
        )
        return await self.teachers.score(step, env, list(rollouts))

    async def _generate_step(self, step: int, plan: list[tuple[str, int]], batch: StepBatch) -> StepBatch:
        batch.groups = list(await asyncio.gather(*(self._group(step, e, x, gi) for gi, (e, x) in enumerate(plan))))
        # The curriculum marks the groups that train; its dynamic sampling draws more through _group.
        batch.groups = await self.curriculum.fill(step, batch.groups, lambda *a: self._group(step, *a))
        batch.finished = time.perf_counter()
        return batch

    async def rollout_loop(self, buffer: asyncio.Queue) -> None:
        c = self.config
        for step in range(self.start_step, c.max_steps):
            progress.set_step(step)
            # Dispatched ahead, a step's rollouts go out one update early and wait at the server (`_oldest_weights`).
            waited = await self.policy.wait_for(step - c.async_level - int(c.dispatch_ahead), c.weights_timeout)
            self.cursor_history[step] = dict(self.cursors)
            plan = self._plan_step(step)
            batch = StepBatch(step, [], time.perf_counter(), waited)
            batch.metrics["time/policy_served_at"] = self.policy.served_at
            logger.debug("dispatching step %d on weights %d", step, self.policy.version)
            await buffer.put(asyncio.create_task(self._generate_step(step, plan, batch)))
        await buffer.put(None)

    # ----- training side -----
    def _samples(self, batch: StepBatch) -> tuple[list[Sample], dict[str, float]]:
        """Samples of the step: per-seat advantages within each group (``prime_orchestrator.credit``)."""
        return step_samples(batch.groups, self.config, self.teachers)

    def _metrics(self, batch: StepBatch, samples: list[Sample], extra: dict[str, Any]) -> dict[str, Any]:
        rollouts = [r for g in batch.groups for r in g]
        rewards = np.array([r.result.reward for r in rollouts])
        lengths = np.array([r.result.num_tokens for r in rollouts])
        completion = np.array([r.result.completion_len for r in rollouts])
        lags = np.array([batch.step - r.weight_step for r in rollouts])
        gen_time = max(batch.finished - batch.started, 1e-9)
        m: dict[str, Any] = {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "pass_rate": float((rewards >= 1.0).mean()),
            "seq_len/mean": float(lengths.mean()),
            "seq_len/max": int(lengths.max()),
            "completion_len/mean": float(completion.mean()),
            "num_turns/mean": float(np.mean([r.result.num_turns for r in rollouts])),
            "truncated/mean": float(np.mean([r.result.truncated for r in rollouts])),
            "failed/rollouts": sum(r.result.failed for r in rollouts),
            "throughput/rollout_tokens_per_s": float(completion.sum() / gen_time),
            "rollout/latency_mean": float(np.mean([r.result.latency for r in rollouts])),
            "rollout/scoring_share": sum(r.result.scoring_s for r in rollouts)
            / max(sum(r.result.latency for r in rollouts), 1e-9),
            "off_policy_lag/max": int(lags.max()),
            "off_policy_lag/mean": float(lags.mean()),
            "policy/version": self.policy.version,
            "time/rollouts": gen_time,
            "time/wait_for_policy": batch.wait_for_policy,
            "time/dispatched_at": batch.dispatched_at,
            **rollout_timeline(batch.started, rollouts),
            "samples/trained": len(samples),
            "env_servers/restarts": sum(p.server.num_restarts for p in self.pools.values()),
            "env_servers/retries": sum(p.num_retries for p in self.pools.values()),
            **env_metrics([r.result for r in rollouts], self.pools),
            **version_metrics(batch.step, [r.result for r in rollouts]),
            **self.semaphore.metrics(),
            **extra,
        }
        for env, pool in self.pools.items():
            env_rewards = np.array([r.result.reward for r in rollouts if r.env == env])
            if len(env_rewards):
                m[f"reward/{env}/mean"] = float(env_rewards.mean())
                m[f"reward/{env}/std"] = float(env_rewards.std())
                m[f"pass_rate/{env}"] = float((env_rewards >= 1.0).mean())
                m[f"batch/{env}"] = len(env_rewards)
                m.update(seat_step_metrics(env, [r.result for r in rollouts if r.env == env], pool.metric_keys))
        return m

    def _log_extras(self, step: int, batch: StepBatch) -> None:
        cfg = self.config.log_extras
        if not cfg.enabled or step % cfg.interval:
            return
        rows = [
            {
                "step": step,
                "env": r.env,
                "example": r.example,
                "weight_step": r.weight_step,
                "reward": r.result.reward,
                "failed": r.result.failed,
                "prompt": r.result.prompt,
                "completion": r.result.completion if not r.result.failed else r.result.error,
            }
            for g in batch.groups
            for r in g
        ][: cfg.num_samples]
        path = self.run_dir.root / "samples" / f"orchestrator_step_{step}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        for m in getattr(self.monitor, "monitors", []):
            if hasattr(m, "log_table"):
                cols = list(rows[0]) if rows else []
                m.log_table("samples", cols, [[r[k] for k in cols] for r in rows], step)

    async def ship(self, batch: StepBatch) -> None:
        c = self.config
        t0 = time.perf_counter()
        check_step(batch.step, [r.result for g in batch.groups for r in g], c.recovery.min_ok_fraction)
        samples, extra = self._samples(batch)
        if reason := seq_len_too_short(samples, c.seq_len):
            raise RolloutsFailed(f"step {batch.step}: {reason}")
        packed = pack(
            samples,
            step=batch.step,
            seq_len=c.seq_len,
            num_ranks=c.num_trainer_ranks,
            micro_batch_rows=c.micro_batch_rows,
            temperature=c.sampling.temperature,
            long_samples=c.filters.long_samples,
            extras={f"batch/{k}": v for k, v in self._env_counts(batch).items()},
            vision=self.vision,
            run_id=os.environ.get("PRIME_RUN_ID"),
        )
        for rank in range(c.num_trainer_ranks):
            await asyncio.to_thread(self.sender.send, batch.step, rank, packed.metas[rank], packed.micro_batches[rank])
        extra.update(
            {
                "filtered/long_samples": packed.num_truncated + packed.num_dropped,
                "truncated/long_samples": packed.num_truncated,
                "dropped/long_samples": packed.num_dropped,
                "micro_batches": packed.metas[0].num_micro_batches,
                "time/pack_and_send": time.perf_counter() - t0,
                **self.curriculum.metrics(batch.step),
                **self.teachers.metrics(batch.step, batch.groups),
                **batch.metrics,
            }
        )
        metrics = self._metrics(batch, samples, extra)
        self.monitor.log(batch.step, metrics)
        self.shipped.add(batch.step)
        logger.info(
            "Step %d | Reward %.4f | Lag max %d | Filtered %d groups | Samples %d | %.0f tok/s | wait %.1fs",
            batch.step,
            metrics["reward/mean"],
            metrics["off_policy_lag/max"],
            metrics["filtered/groups"],
            len(samples),
            metrics["throughput/rollout_tokens_per_s"],
            batch.wait_for_policy,
        )
        self._log_extras(batch.step, batch)
        nxt = batch.step + 1
        if c.ckpt.interval and nxt % c.ckpt.interval == 0 and nxt <= c.max_steps:
            self._save_checkpoint(nxt)
        # Cursors of steps shipped can no longer be checkpointed: an entry per step would grow for the whole run.
        for old in [s for s in self.cursor_history if s <= nxt]:
            del self.cursor_history[old]
        if self.eval_pools and batch.step > 0 and batch.step % c.eval.interval == 0:
            self._eval_tasks.append(asyncio.create_task(self._eval(batch.step)))

    def _env_counts(self, batch: StepBatch) -> dict[str, int]:
        counts: dict[str, int] = {}
        for g in batch.groups:
            counts[g[0].env] = counts.get(g[0].env, 0) + len(g)
        return counts

    async def _eval(self, step: int) -> None:
        e = self.config.eval
        values: dict[str, Any] = {"eval/policy_version": self.policy.version}
        for temperature in e.temperatures if e.temperatures is not None else [None]:
            sampling = self.config.sampling
            if temperature is not None:
                sampling = sampling.model_copy(update={"temperature": temperature})
            results = await evaluate_envs(
                self.eval_pools,
                client_for=self.client_for,
                model=self.served_model,
                num_examples=e.num_examples,
                # Greedy rollouts of one prompt are identical: one per example is the whole information.
                rollouts_per_example=1 if temperature == 0 else e.rollouts_per_example,
                sampling=sampling,
                seed=self.config.seed,
                semaphore=self.semaphore,
                track=self.eval_lane.track,
            )
            tag = "" if temperature is None else f"t{temperature:g}/"
            for env, summary in results.items():
                values.update({f"eval/{env}/{tag}{k}": v for k, v in summary.items() if isinstance(v, int | float)})
        self.monitor.log(step, values)

    async def _eval_final(self) -> None:
        """Evaluate the weights the last step publishes (step ``max_steps``), logged at that step."""
        last = self.config.max_steps
        logger.info("waiting for the final weights (step %d) to evaluate them", last)
        await self.policy.wait_for(last, self.config.weights_timeout)
        await self._eval(last)

    async def ship_loop(self, buffer: asyncio.Queue) -> None:
        while (item := await buffer.get()) is not None:
            batch = await item
            with ship_activity(self.config, batch.step):
                await self.ship(batch)

    async def run(self) -> None:
        c = self.config
        try:
            await self.setup()
        except BaseException:
            # Env servers may be up (a checkpoint that does not load, weights inference refuses): stop them, or
            # the process would wait for them at exit forever, after its error line, its heartbeat still beating.
            await self.close()
            raise
        # The buffer holds dispatched steps; the policy gate bounds how far it runs ahead.
        buffer: asyncio.Queue = asyncio.Queue(maxsize=self.config.async_level + 1)
        if self.eval_pools and c.eval.eval_base and self.start_step == 0:
            # Before any rollout: once step 0 trains, new weights would reach inference in the middle of this eval.
            await self._eval(0)
        watcher = asyncio.create_task(self.policy.watch())
        continuous = c.max_off_policy_steps is not None
        producer = asyncio.create_task((Continuous(self).rollout_loop if continuous else self.rollout_loop)(buffer))
        consumer = asyncio.create_task(self.ship_loop(buffer))
        server_changed = asyncio.create_task(self.semaphore.raise_fault())
        try:
            # Run until every batch shipped; a failure in any loop (the weight relay, a server's /health) ends the run.
            pending = {producer, consumer, watcher, server_changed}
            while not consumer.done():
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t.exception() is not None:
                        raise t.exception()
            if self._eval_tasks:
                await asyncio.gather(*self._eval_tasks)
            await self._relay_remaining_broadcasts(watcher)
            if self.eval_pools and c.eval.final and self.start_step < c.max_steps:
                await self._eval_final()
            logger.info("finished %d steps", self.shipped.count)
        finally:
            for t in (watcher, producer, consumer, server_changed, *self._eval_tasks):
                t.cancel()
            while not buffer.empty():
                if (item := buffer.get_nowait()) is not None:
                    item.cancel()
            await self.close()

    async def _relay_remaining_broadcasts(self, watcher: asyncio.Task) -> None:
        """With async_level > 0 the last rollouts can ship before the trainer has published the weights that
        precede the final step. Files simply stay unread; a broadcast blocks the trainer until inference takes it,
        so keep relaying until the last broadcast step (``max_steps - 1``; the final weights only go to disk)."""
        last = self.config.max_steps - 1
        if not self.config.weights_broadcast or self.policy.version >= last:
            return
        logger.info("relaying the trainer's weight broadcasts up to step %d before exiting", last)
        waiter = asyncio.create_task(self.policy.wait_for(last, self.config.weights_timeout))
        done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if watcher in done:
            waiter.cancel()
            raise watcher.exception() or RuntimeError("the weight relay stopped")
        waiter.result()

    async def close(self) -> None:
        await asyncio.gather(
            *(p.close() for p in [*self.pools.values(), *self.eval_pools.values()]),
            self.teachers.close(),
            return_exceptions=True,
        )
        await self.semaphore.aclose()
        await self.versions.close()
        if self.sender is not None:  # zmq: until the trainer has taken every step (bounded by its drain timeout)
            with progress.activity("handing the last steps to the trainer", lane="ship", waits_for="trainer"):
                await asyncio.to_thread(self.sender.close)
        if self.monitor is not None:
            self.monitor.close()
