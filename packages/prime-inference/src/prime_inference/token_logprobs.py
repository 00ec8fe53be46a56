"""Sampled-token log-probs out of vLLM's worker in bulk, not per step and per request (``vllm.fast_token_logprobs``).

RL asks for one float per generated token: the sampled token's log-prob (``logprobs`` 0, or 1 from renderers' client:
on the token-in route both return the sampled token's entry alone). vLLM computes it on the
GPU for almost nothing, then carries it through a path built for top-k objects: every engine step slices three
arrays per request, serializes them to the API process, which turns them into Python lists again. At 512 requests
in flight that host work, not the kernels, costs a third of the throughput (docs/benchmarks.md, "Where the time
goes"). With this option:

* the worker (`SampledLogprobTap`, installed by `PrimeWorkerExtension.prime_install_token_logprobs`) copies each
  step's sampled log-probs, token ids and positions to the host in one transfer and files them by request;
* when every request of a step that asked for log-probs is a tapped one, it drops vLLM's log-prob tensors from the
  step's output, so the scheduler, the IPC and the API process handle none;
* when a request finishes, the engine fetches its values with one ``collective_rpc`` for all requests that
  finished together (`TapFetcher`) and aligns them to the output tokens by position (`align`);
* each value is filed with the weight step the worker served when it was sampled (``set_version`` by every
  update, on the thread that runs the steps), so a request that spans an in-flight update knows each token's step.

The values are the ones vLLM's own ``logprobs=0`` returns (same sampler call, same ``logprobs_mode``). Positions
make the result independent of chunked prefill (no sample), a preemption that samples a position again (the last
value wins) and async scheduling (a token sampled after the stop is past the output and ignored). Only vLLM's V2
model runner without speculative decoding is tapped; otherwise the engine keeps vLLM's own path.

Torch and numpy are imported where used: the API process imports this module for `TapFetcher` and `align`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

TAP_FLAG = "prime_token_logprobs"
"""Key in ``SamplingParams.extra_args`` that marks a request whose sampled log-probs the worker tap collects."""
NO_LOGPROBS = -1  # vLLM's marker for "this request asked for no log-probs" in its sampling states

Entries = tuple[list[int], list[int], list[float], list[int]]
"""(positions in the whole sequence, sampled token ids, log-probs, weight steps) collected for one request."""


def external_id(internal_id: str) -> str:
    """vLLM 0.26 runs request ``rid`` as ``f"{rid}-{8 random characters}"``; the API process knows ``rid``."""
    return internal_id.rsplit("-", 1)[0]


class SampledLogprobTap:
    """Worker-side collector, hooked into a V2 model runner's ``sampler.add_request`` and ``sample``."""

    def __init__(self, max_num_reqs: int, sampling_states: Any, token_ids_state: Any):
        import numpy as np

        self.tapped = np.zeros(max_num_reqs, dtype=bool)  # by vLLM's request slot
        self.sampling_states = sampling_states
        self.token_ids_state = token_ids_state
        self.pending: deque[tuple[list[str], Any, Any, Any, int]] = deque()
        # The weight step the worker serves (`set_version`, with each update): steps and updates run on one thread
        # here, so every value is filed with the step of the weights that sampled it.
        self.version = 0
        self.entries: dict[str, Entries] = {}  # by the API process's request id
        # The same lists by vLLM's internal id, and those ids by request id: filing a value costs one lookup.
        self.filing: dict[str, Entries] = {}
        self.internal_ids: dict[str, list[str]] = {}
        # vLLM 0.26 runs sampling and RPCs on one thread per worker; the lock keeps the tap right if that changes.
        self.lock = threading.Lock()

    @classmethod
    def install(cls, runner: Any) -> SampledLogprobTap | None:
        """Hook ``runner`` (vLLM's V2 ``GPUModelRunner``); None where the model runner is not one we can tap."""
        sampler = getattr(runner, "sampler", None)
        if (
            sampler is None
            or not getattr(runner, "is_last_pp_rank", False)
            or getattr(runner, "speculator", None) is not None
            or not hasattr(sampler, "sampling_states")
            or not hasattr(sampler, "logprob_token_ids_state")
        ):
            return None
        tap = cls(runner.max_num_reqs, sampler.sampling_states, sampler.logprob_token_ids_state)
        add_request, sample = sampler.add_request, runner.sample

        def add_request_tapped(req_idx: int, prompt_len: int, sampling_params: Any) -> None:
            add_request(req_idx, prompt_len, sampling_params)
            tap.tapped[req_idx] = bool((sampling_params.extra_args or {}).get(TAP_FLAG))

        def sample_tapped(hidden_states: Any, input_batch: Any, grammar_output: Any) -> Any:
            result = sample(hidden_states, input_batch, grammar_output)
            tap.after_sample(result[0], input_batch)
            return result

        sampler.add_request = add_request_tapped
        runner.sample = sample_tapped
        return tap

    def after_sample(self, output: Any, input_batch: Any) -> None:
        """File this step's values (copy started, read later) and drop vLLM's tensors when nobody else needs them."""
        import torch

        with self.lock:
            self.drain(block=False)
        lt = output.logprobs_tensors
        n = input_batch.num_reqs
        if lt is None or output.num_sampled is None or lt.logprobs.shape[0] != n:
            return
        slots = input_batch.idx_mapping_np[:n]
        tapped = self.tapped[slots]
        if not tapped.any():
            return
        columns = (lt.logprobs[:, 0], lt.logprob_token_ids[:, 0], input_batch.seq_lens[:n], output.num_sampled[:n])
        packed = torch.stack([c.to(torch.float64) for c in columns])  # exact for ids and positions below 2**53
        host = packed.to("cpu", non_blocking=True)
        event = None
        if packed.is_cuda:
            event = torch.cuda.Event()
            event.record()
        with self.lock:
            self.pending.append((list(input_batch.req_ids[:n]), tapped, host, event, self.version))
        wanted = self.sampling_states.num_logprobs[slots] != NO_LOGPROBS
        if not (wanted & ~tapped).any() and self.token_ids_state.max_num_token_ids(slots) == 0:
            output.logprobs_tensors = None

    def drain(self, block: bool) -> None:
        """File every copied step (``block``: wait for the copies still in flight). Call with the lock held.

        Runs on the engine core's thread once per step for every request in the batch: the rows are chosen and
        converted by numpy, the Python loop only appends."""
        import numpy as np

        while self.pending:
            req_ids, tapped, host, event, version = self.pending[0]
            if event is not None:
                if not block and not event.query():
                    return
                event.synchronize()
            self.pending.popleft()
            values, tokens, positions, sampled = host.numpy()
            rows = np.flatnonzero(tapped & (sampled > 0))  # a partial prefill chunk samples nothing
            columns = (positions[rows].astype(np.int64).tolist(), tokens[rows].astype(np.int64).tolist())
            for i, pos, tok, val in zip(rows.tolist(), *columns, values[rows].tolist(), strict=True):
                entry = self.filing.get(req_ids[i])
                if entry is None:
                    entry = self.start_filing(req_ids[i])
                entry[0].append(pos)
                entry[1].append(tok)
                entry[2].append(val)
                entry[3].append(version)

    def start_filing(self, internal_id: str) -> Entries:
        request_id = external_id(internal_id)
        self.internal_ids.setdefault(request_id, []).append(internal_id)
        entry = self.filing[internal_id] = self.entries.setdefault(request_id, ([], [], [], []))
        return entry

    def set_version(self, step: int) -> None:
        """Values of steps sampled from now on carry ``step`` (pending ones keep the step they were taken with)."""
        with self.lock:
            self.version = step

    def take(self, request_ids: Sequence[str]) -> dict[str, Entries]:
        """Hand over (and forget) what was collected for these requests."""
        with self.lock:
            self.drain(block=True)
            for rid in request_ids:
                for internal_id in self.internal_ids.pop(rid, ()):
                    del self.filing[internal_id]
            return {rid: self.entries.pop(rid) for rid in request_ids if rid in self.entries}


def align(
    entries: Entries | None, prompt_len: int, token_ids: Sequence[int]
) -> tuple[list[float], list[int] | None] | None:
    """The log-prob and weight step of each output token (steps None where the worker filed none), or None unless
    every token has a value collected for exactly that token."""
    if entries is None:
        return None
    n = len(token_ids)
    values: list[float | None] = [None] * n
    sampled: list[int | None] = [None] * n
    steps: list[int] = [0] * n
    versions = entries[3] if len(entries) > 3 and len(entries[3]) == len(entries[0]) else None
    for i, (pos, tok, val) in enumerate(zip(*entries[:3], strict=True)):
        j = pos - prompt_len
        if 0 <= j < n:
            values[j], sampled[j] = val, tok
            steps[j] = versions[i] if versions is not None else 0
    if sampled != list(token_ids):
        return None
    return values, (steps if versions is not None else None)  # type: ignore[return-value]


class TapFetcher:
    """Fetches the tapped values of requests that finish together with one worker RPC.

    ``rpc(request_ids)`` returns one ``{request id: Entries}`` per worker (tensor-parallel ranks collect the same
    values; the first reply that has a request wins).
    """

    def __init__(self, rpc: Callable[[list[str]], Awaitable[list[dict[str, Entries]]]]):
        self.rpc = rpc
        self.waiting: dict[str, asyncio.Future[Entries | None]] = {}
        self.flush_task: asyncio.Task | None = None

    async def take(self, request_id: str) -> Entries | None:
        future = asyncio.get_running_loop().create_future()
        self.waiting[request_id] = future
        if self.flush_task is None:
            self.flush_task = asyncio.create_task(self.flush())
        return await future

    def forget(self, request_id: str) -> None:
        """Make the worker drop an aborted request's values (nobody waits for them)."""
        task = asyncio.ensure_future(self.take(request_id))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def flush(self) -> None:
        await asyncio.sleep(0)  # requests finished by the same engine output land before the RPC goes out
        batch, self.waiting, self.flush_task = self.waiting, {}, None
        try:
            replies = await self.rpc(list(batch))
        except Exception as e:  # every waiter sees the failure, none hangs
            for future in batch.values():
                if not future.done():
                    future.set_exception(e)
            return
        for rid, future in batch.items():
            found = next((r[rid] for r in replies if rid in r), None)
            if not future.done():
                future.set_result(found)
