"""The embedded PyTorch engine: continuous batching on one device.

A scheduler thread owns the model. Each iteration it (1) applies a pending weight swap when allowed, (2) admits
waiting requests into free KV-cache slots (prefill + first token), (3) runs one batched decode step for every
running sequence, and (4) hands each sequence's new token to its asyncio consumer. Requests therefore join and
leave the running batch between decode steps. Requests admitted together with the same prompt and adapter (an RL
group's rollouts) share one prefill: its KV cache is copied to their slots and each samples its own first token.

Weight updates (``inference.weight_update``) and pause. ``update_weights`` loads the new model off the scheduler
thread (`prime_inference.engines.torch_loading`), then the thread swaps it in between two steps:
* ``in_flight``: at the next step boundary, without waiting. Running sequences go on with the new weights; each
  token's log-prob and weight step are those of the weights that sampled it, so a completion may span steps.
  Their KV cache is kept, not recomputed: the cached keys and values of tokens before the swap stay those of the
  old weights (as PipelineRL and AReaL do). Recomputing would cost a prefill of every running context per update
  (the long tail's contexts are the longest) to make the new tokens' distribution the new policy's exactly; kept,
  the returned log-probs are still those of the distribution each token was drawn from, which is what the trainer's
  importance ratio divides by, so the mismatch is corrected, not ignored. (The recompute fallback decoder, which
  keeps no cache, recomputes anyway.)
* ``drain``: no new request is admitted, running ones finish on the old weights, then the swap happens and queued
  requests start on the new ones, so every completion comes from a single weight step.
``pause`` freezes the scheduler: running sequences keep their KV cache and wait, new requests queue. A swap while
paused happens at once, and frozen sequences continue on the new weights after ``resume`` (like vLLM's
``pause_generation(mode="keep")``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import random
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import torch
from prime_core.config.inference import InferenceConfig
from prime_core.schemas.weights import Manifest

from prime_inference.engines.base import Engine, EngineInfo, EngineOutput, EngineRequest
from prime_inference.engines.lora import AdapterOp, AdapterRouter, ServedAdapter, received_adapter
from prime_inference.engines.model_runner import build_decoder, resolve_dtype
from prime_inference.engines.sampling import prompt_logprobs, sample
from prime_inference.engines.torch_load import load_fields
from prime_inference.engines.torch_loading import check_compatible, eos_ids, load_model, receive_model, text_config
from prime_inference.protocol import RequestError

logger = logging.getLogger(__name__)


@dataclass
class _Sequence:
    request: EngineRequest
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    generator: torch.Generator
    slot: int = -1
    output_ids: list[int] = field(default_factory=list)
    next_input: int | None = None
    aborted: bool = False
    finished: bool = False
    grammar: Any = None
    """``prime_inference.structured.GrammarState`` of a structured-output request."""

    def emit(self, out: EngineOutput) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, out)


def _same_prompt_groups(seqs: list[_Sequence]) -> list[list[_Sequence]]:
    """Text-only sequences with the same prompt and adapter, in admission order; each image prompt on its own."""
    groups: dict[Any, list[_Sequence]] = {}
    for i, seq in enumerate(seqs):
        request = seq.request
        key = i if request.multimodal is not None else (tuple(request.prompt_ids), request.lora_name)
        groups.setdefault(key, []).append(seq)
    return list(groups.values())


@dataclass
class _Swap:
    model: Any
    hf_config: Any
    step: int
    weight_dir: str | None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class TorchEngine(Engine):
    name = "torch"
    supports_prompt_logprobs = True

    def __init__(self, config: InferenceConfig, tokenizer: Any):
        self.config = config
        self.tokenizer = tokenizer
        self._adapters: dict[str, ServedAdapter] = {}
        self._adapter_ops: list[AdapterOp] = []
        dev = config.torch.device
        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if dev == "auto" else dev)
        if config.torch.num_threads is not None:
            torch.set_num_threads(config.torch.num_threads)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        model, source, hf_config = self._load(config.model.name)
        self.source = source
        max_pos = getattr(text_config(hf_config), "max_position_embeddings", None) or 2048
        self.max_model_len = config.max_model_len or max_pos
        if self.max_model_len > max_pos:
            logger.warning(
                "max_model_len %d exceeds the model's max_position_embeddings %d", self.max_model_len, max_pos
            )
        self.vocab_size = text_config(hf_config).vocab_size
        self.eos_ids = eos_ids(hf_config, tokenizer)
        self.decoder = AdapterRouter(
            build_decoder(
                model, hf_config, num_slots=config.max_batch_size, max_len=self.max_model_len, device=self.device
            ),
            model,
        )
        self.model, self.hf_config = model, hf_config
        self.weight_step, self.weight_dir = 0, None
        self._rng = random.Random(config.seed)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._running: list[_Sequence] = []
        self._free_slots = list(range(config.max_batch_size))
        self._paused = False
        self._swap: _Swap | None = None
        self.in_flight = config.weight_update == "in_flight"
        self._stop = False
        self._ended: str | None = None  # why the scheduler thread is gone (nothing waits on it after that)
        self._live: dict[int, _Sequence] = {}  # every request's sequence (by id) until its generate ends
        self.num_steps = 0
        self._admin_lock: asyncio.Lock | None = None
        self._thread = threading.Thread(target=self._loop, name="torch-engine", daemon=True)
        logger.info(
            "torch engine: %s via %s on %s (%s), %s, max_model_len=%d, max_batch_size=%d",
            config.model.name, source, self.device, self.dtype, self.decoder.name,
            self.max_model_len, config.max_batch_size,
        )  # fmt: skip

    def _load(self, path: str) -> tuple[Any, str, Any]:
        adapters_of = self.model if self._adapters else None  # new base weights keep serving the loaded adapters
        return load_model(path, self.config, dtype=self.dtype, device=self.device, adapters_of=adapters_of,
                          served_source=getattr(self, "source", None))  # fmt: skip

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            engine=self.name,
            model=self.config.served_model_name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            weight_step=self.weight_step,
            weight_dir=self.weight_dir,
            paused=self._paused,
            adapters={name: a.card() for name, a in self._adapters.items()},
            extra={"implementation": self.source, "decoder": self.decoder.name, "device": str(self.device)},
            waiting=len(self._waiting),
            steps=self.num_steps,
            **load_fields(list(self._running), self.config.max_batch_size, self.max_model_len),
        )

    async def start(self) -> None:
        self._admin_lock = asyncio.Lock()
        self._thread.start()
        for name, path in self.config.lora.adapters.items():
            await self.load_adapter(name, path, None)

    async def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        await asyncio.to_thread(self._thread.join, 30)

    # ---- requests (event-loop side) ----

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        seed = request.params.seed if request.params.seed is not None else self._rng.getrandbits(63)
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed % (2**63))
        seq = _Sequence(request, asyncio.get_running_loop(), asyncio.Queue(), generator)
        if request.params.grammar is not None:
            from prime_inference.structured import GrammarState

            seq.grammar = GrammarState(self.tokenizer, request.params.grammar)
        with self._cond:
            self._check_serving()
            self._live[id(seq)] = seq
            self._waiting.append(seq)
            self._cond.notify_all()
        try:
            while True:
                out = await seq.queue.get()
                if isinstance(out, BaseException):
                    raise out
                yield out
                if out.finish_reason is not None:
                    return
        finally:
            with self._cond:
                self._live.pop(id(seq), None)
                if not seq.finished:
                    seq.aborted = True
                    self._cond.notify_all()

    # ---- admin (event-loop side) ----

    async def update_weights(self, weight_dir: str, step: int | None) -> None:
        assert self._admin_lock is not None
        async with self._admin_lock:
            model, _, hf_config = await asyncio.to_thread(self._load, weight_dir)
            check_compatible(hf_config, self.hf_config)
            await self._apply_swap(_Swap(model, hf_config, self.weight_step + 1 if step is None else step, weight_dir))

    async def receive_weights(self, manifest: Manifest, step: int | None) -> None:
        assert self._admin_lock is not None
        async with self._admin_lock:
            model = await asyncio.to_thread(receive_model, manifest, self.model, self.source, self.dtype, self.device)
            await self._apply_swap(_Swap(model, self.hf_config, self.weight_step + 1 if step is None else step, None))

    async def reload_weights(self) -> None:
        assert self._admin_lock is not None
        async with self._admin_lock:
            model, _, hf_config = await asyncio.to_thread(self._load, self.config.model.name)
            await self._apply_swap(_Swap(model, hf_config, 0, None))

    async def load_adapter(self, name: str, path: str, step: int | None) -> None:
        """Serve the PEFT adapter at ``path`` as ``name`` (replacing one of that name once its sequences finish)."""
        await self._adapter_op(AdapterOp(name, path, step))

    async def receive_adapter(self, name: str, manifest: Manifest, step: int | None) -> None:
        received = await asyncio.to_thread(received_adapter, manifest, self.device)
        await self._adapter_op(AdapterOp(name, f"{manifest.type} step {manifest.step}", step, received=received))

    async def unload_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise RequestError(f"no LoRA adapter named {name!r} is loaded", status_code=404, param="lora_name")
        await self._adapter_op(AdapterOp(name, None))

    async def _adapter_op(self, op: AdapterOp) -> None:
        assert self._admin_lock is not None
        async with self._admin_lock:
            with self._cond:
                self._check_serving()
                self._adapter_ops.append(op)
                self._cond.notify_all()
            await asyncio.wrap_future(op.future)

    async def _apply_swap(self, swap: _Swap) -> None:
        with self._cond:
            self._check_serving()
            self._swap = swap
            self._cond.notify_all()
        await asyncio.wrap_future(swap.future)

    async def pause(self) -> None:
        with self._cond:
            self._paused = True
            self._cond.notify_all()

    async def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    # ---- scheduler thread ----

    def _adapter_op_ready(self) -> AdapterOp | None:
        """The first pending adapter op that no running sequence blocks (all of them while paused)."""
        for op in self._adapter_ops:
            if self._paused or not any(s.request.lora_name == op.name for s in self._running):
                return op
        return None

    def _waits_for_adapter(self, seq: _Sequence) -> bool:
        return seq.request.lora_name is not None and any(op.name == seq.request.lora_name for op in self._adapter_ops)

    def _swap_due(self) -> bool:
        """A pending swap happens now: in flight, paused, or (draining) once nothing runs."""
        return self._swap is not None and (self.in_flight or self._paused or not self._running)

    def _has_work(self) -> bool:
        if self._swap_due():
            return True
        if self._adapter_op_ready() is not None:
            return True
        if self._paused:
            return False
        return bool(self._running) or (bool(self._waiting) and self._swap is None)

    def _loop(self) -> None:
        try:
            self._schedule()
            self._end("the torch engine shut down")
        except BaseException as e:  # logged here; the thread ends either way
            logger.exception("the torch engine's scheduler died")
            self._end(f"the torch engine's scheduler died ({type(e).__name__}: {e})")

    def _end(self, why: str) -> None:  # fail what waits on the scheduler: requests, admin ops would wait forever
        with self._cond:
            self._ended, error = why, RuntimeError(why)
            for seq in self._live.values():  # waiting, running, or in the hands of the step that failed
                with contextlib.suppress(RuntimeError):  # its event loop is closed: nobody waits
                    seq.emit(error)
            self._waiting, self._running = collections.deque(), []
            for future in [op.future for op in self._adapter_ops] + ([self._swap.future] if self._swap else []):
                if not future.done():
                    future.set_exception(error)

    def _check_serving(self) -> None:
        if self._ended is not None:  # what it queued now would wait forever
            raise RuntimeError(self._ended)

    def _schedule(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self._has_work():
                    self._cond.wait()
                if self._stop:
                    break
                swap = None
                if self._swap_due():
                    swap, self._swap = self._swap, None
                adapter_op = self._adapter_op_ready() if swap is None else None
                if adapter_op is not None:
                    self._adapter_ops.remove(adapter_op)
                admitted: list[_Sequence] = []
                if swap is None and adapter_op is None and not self._paused and self._swap is None:
                    deferred = []  # sequences of an adapter that is being replaced start on the new one
                    while self._waiting and self._free_slots:
                        seq = self._waiting.popleft()
                        if seq.aborted:
                            continue
                        if self._waits_for_adapter(seq):
                            deferred.append(seq)
                        elif seq.request.lora_name is not None and seq.request.lora_name not in self._adapters:
                            self._reject(seq)
                        else:
                            seq.slot = self._free_slots.pop(0)
                            self.decoder.slot_adapters[seq.slot] = seq.request.lora_name
                            admitted.append(seq)
                    self._waiting.extendleft(reversed(deferred))
                self._running.extend(admitted)
                self._running = [s for s in self._running if not self._reap_aborted(s)]
                if not self._running:
                    self.decoder.release()
            try:
                if swap is not None:
                    self._do_swap(swap)
                    continue
                if adapter_op is not None:
                    self._do_adapter_op(adapter_op)
                    continue
                self._step(admitted)
            except Exception as e:  # an engine bug must not hang clients: fail the batch, keep serving
                logger.exception("engine step failed")
                with self._cond:
                    for seq in self._running:
                        seq.emit(e)
                        self._finish(seq)
                    self._running = []
                    self.decoder.release()

    def _reject(self, seq: _Sequence) -> None:
        name = seq.request.lora_name
        seq.emit(RequestError(f"LoRA adapter {name!r} was unloaded", status_code=404, param="model"))
        seq.finished = True

    def _do_adapter_op(self, op: AdapterOp) -> None:
        try:
            from prime_models import lora

            if op.path is None:
                lora.remove_adapter(self.model, op.name)
                del self._adapters[op.name]
                logger.info("unloaded LoRA adapter %s", op.name)
            else:
                op.load_into(self.model)
                # Loading may wrap linear layers in LoRA layers: the decoder must call the new modules.
                self.decoder.set_model(self.model, self.hf_config)
                self._adapters[op.name] = ServedAdapter(op.name, op.path, op.step)
                logger.info("serving LoRA adapter %s from %s (step %s)", op.name, op.path, op.step)
            op.future.set_result(None)
        except Exception as e:
            op.future.set_exception(e)

    def _reap_aborted(self, seq: _Sequence) -> bool:
        if seq.aborted and not seq.finished:
            self._finish(seq)
            return True
        return seq.finished

    def _finish(self, seq: _Sequence) -> None:
        seq.finished = True
        if seq.slot >= 0:
            self._free_slots.append(seq.slot)
            self._free_slots.sort()
            seq.slot = -1

    def _do_swap(self, swap: _Swap) -> None:
        try:
            self.decoder.set_model(swap.model, swap.hf_config)
            old = self.model
            self.model, self.hf_config = swap.model, swap.hf_config
            self.weight_step, self.weight_dir = swap.step, swap.weight_dir
            del old
            logger.info("serving weight step %d (%s)", swap.step, swap.weight_dir or self.config.model.name)
            swap.future.set_result(None)
        except Exception as e:
            swap.future.set_exception(e)

    def _step(self, admitted: list[_Sequence]) -> None:
        self.num_steps += 1
        for first, *copies in _same_prompt_groups(admitted):
            logits = self.decoder.prefill(first.slot, first.request.prompt_ids, first.request.multimodal)
            for seq in copies:
                self.decoder.copy_prompt(first.slot, seq.slot, len(seq.request.prompt_ids))
            for seq in (first, *copies):
                self._sample_or_fail(seq, logits)
        running = [s for s in self._running if not s.finished and s.next_input is not None]
        if running:
            slots = [s.slot for s in running]
            inputs = [s.next_input for s in running]
            positions = [len(s.request.prompt_ids) + len(s.output_ids) - 1 for s in running]
            logits = self.decoder.decode(slots, inputs, positions)
            for row, seq in enumerate(running):
                self._sample_or_fail(seq, logits[row])
        with self._cond:
            self._running = [s for s in self._running if not s.finished]
            if not self._running:
                self.decoder.release()

    def _sample_or_fail(self, seq: _Sequence, logits_V: torch.Tensor) -> None:
        """What fails in one sequence's own work (its prompt log-probs out of memory, its grammar) ends that sequence
        only: it ended every running one, all clients' requests failing for one client's."""
        try:
            self._sample_and_emit(seq, logits_V)
        except Exception as e:
            logger.exception("request %s failed", seq.request.request_id)
            with self._cond:
                self._finish(seq)
            seq.emit(e)

    def _sample_and_emit(self, seq: _Sequence, logits_V: torch.Tensor) -> None:
        params = seq.request.params
        banned = None
        if len(seq.output_ids) < params.min_tokens:
            banned = params.derived("banned", lambda: torch.tensor(sorted(self._bans(params))))
        if seq.grammar is not None:
            logits_V = seq.grammar.mask(logits_V)
        mode = self.config.logprobs_mode
        token, lp = sample(logits_V, params, seq.generator, mode, seq.request.prompt_ids, seq.output_ids, banned)
        logprobs = top = None
        if lp is not None:
            logprobs = [float(lp[token])]
            top = [{}]
            if params.logprobs > 0:
                values, ids = torch.topk(lp, min(params.logprobs, lp.numel()))
                top = [dict(zip(ids.tolist(), values.tolist(), strict=True))]
        seq.output_ids.append(token)
        seq.next_input = token
        if seq.grammar is not None:
            seq.grammar.consume(token)
        finish, reason = self._finish_reason(seq, token)
        adapter = self._adapters.get(seq.request.lora_name) if seq.request.lora_name is not None else None
        step = adapter.step if adapter is not None and adapter.step is not None else self.weight_step
        out = EngineOutput([token], logprobs, top, finish, reason, step)
        if len(seq.output_ids) == 1 and params.prompt_logprobs is not None:
            out.prompt_logprobs = prompt_logprobs(self.model, seq.request.prompt_ids, params.prompt_logprobs)
        if finish is not None:
            with self._cond:
                self._finish(seq)
        seq.emit(out)

    def _bans(self, params: Any) -> set[int]:  # what min_tokens holds back
        return (set() if params.ignore_eos else self.eos_ids) | set(params.stop_token_ids)

    def _finish_reason(self, seq: _Sequence, token: int) -> tuple[str | None, int | str | None]:
        params = seq.request.params
        n_out = len(seq.output_ids)
        if n_out > params.min_tokens or n_out == params.min_tokens:
            if not params.ignore_eos and token in self.eos_ids:
                return "stop", None
            if token in params.derived("stop_ids", lambda: frozenset(params.stop_token_ids)):
                return "stop", token
            if seq.grammar is not None and seq.grammar.stopped:
                return "stop", None
            if params.stop:
                text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
                tail_start = max(0, len(text) - max(len(s) for s in params.stop) - 32)
                for stop in params.stop:
                    if text.find(stop, tail_start) >= 0:
                        return "stop", stop
        if n_out >= params.max_tokens or len(seq.request.prompt_ids) + n_out >= self.max_model_len:
            return "length", None
        return None, None
