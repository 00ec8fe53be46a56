"""Several vLLM engines on the same GPUs behind one server (``vllm.engines``).

On one H200 the host loop of one engine (vLLM's engine core: its scheduler, KV-cache manager and output handling),
not the GPU, bounded how fast 512 short rollouts were generated: two engines, each with half the memory and half the
requests, generated the RL loop's batch 1.61x faster than one (``benchmarks/results/vllm_replicas_h200.json``; three
1.58x, four 1.43x). vLLM's data parallelism puts each engine on GPUs of its own (``--device-ids`` refuses one GPU
twice), so the server starts the engines itself, one after the other (vLLM sizes its KV cache from the memory it finds
in use), and `EngineReplicas` stands where one ``AsyncLLM`` stood:

* a request goes to the engine its prompt hashes to, so that the samples of a group share one engine's prefix cache,
  unless that engine holds `GROUP_SLACK` more of this server's requests than the least busy one, which then takes it
  (ties in turn). Each engine has its own prefix cache, so the next turn of a multi-turn rollout (its tag,
  ``prime_rollout``, names it) goes to the engine of its previous turn, whose cache holds its history, within the
  same slack; the last `SESSIONS` rollouts are remembered. An engine that died takes none of them;
* what changes the engines' state (pauses, weight loads, LoRA adapters, cache resets) reaches every live engine at
  once; a worker RPC answers with the replies of all their workers. A dead engine is skipped: vLLM never restarts a
  dead engine core, and once skipped an engine is never picked again, so it cannot serve weights it missed. When
  none is left, the call fails with `EnginesDied`, naming them;
* the sampled-log-prob tap is fetched from the engine that ran the request (`RoutedTap`);
* the step count that ``/health`` reports is `StepRounds`: it stops when any engine that holds requests stops.

vLLM's own OpenAI routes (chat, completions) run on the first engine; the token-in route that the orchestrator's
rollouts use spreads over all of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from prime_inference.token_logprobs import Entries, TapFetcher

logger = logging.getLogger(__name__)

GROUP_SLACK = 8
"""How many more requests in flight than the least busy engine the engine a prompt hashes to may hold and still take
it: a group of 8 samples of one prompt stays on one engine, and engines stay within a group of each other."""

SESSIONS = 1 << 16
"""How many rollouts' engines are remembered (the least recently served forgotten first): 64k tags of 50-odd bytes."""


def start_engines(count: int, start: Callable[[int], Any]) -> Any:
    """``count`` engines (``start(i)`` each), one after the other: vLLM sizes each KV cache from the memory it finds in
    use. The one engine itself, or `EngineReplicas` over them; when one fails to start, those already up (their
    processes and GPU memory) are shut down before the error goes on."""
    llms: list[Any] = []
    try:
        for i in range(count):
            llms.append(start(i))
    except BaseException:
        for llm in llms:
            llm.shutdown()
        raise
    return llms[0] if count == 1 else EngineReplicas(llms)


class EnginesDied(RuntimeError):
    """Every engine of the server died: nothing is left to load weights into or to serve."""


def is_dead(llm: Any) -> bool:
    """vLLM's ``errored``: the engine core died (an ``AsyncLLM`` never restarts it)."""
    return bool(getattr(llm, "errored", False))


def died_message(engines: list[int], count: int) -> str:
    """One line naming the dead engines, e.g. ``vLLM engine 1 of 2 died``."""
    names = ", ".join(str(i) for i in engines)
    return f"vLLM engine{'s' if len(engines) > 1 else ''} {names} of {count} died"


def dead_engines(llm: Any) -> list[int]:
    """Which engines of ``llm`` (one ``AsyncLLM``, or `EngineReplicas`) died, by index."""
    if isinstance(llm, EngineReplicas):
        return llm.dead
    return [0] if is_dead(llm) else []


def none_left(llm: Any, error: BaseException | None = None) -> str | None:
    """One line naming the dead engines once every engine of ``llm`` died (``error``: what a call to it raised, vLLM's
    ``EngineDeadError`` from one engine whose death it saw first); None while one is alive."""
    count = len(llm.llms) if isinstance(llm, EngineReplicas) else 1
    dead = dead_engines(llm)
    if count == 1 and type(error).__name__ == "EngineDeadError":
        dead = [0]
    if len(dead) < count:
        return None
    named = error is not None and not isinstance(error, EnginesDied)
    return died_message(dead, count) + (f" ({type(error).__name__})" if named else "")


def _prompt_hash(ids: Any) -> int:
    """Equal for equal prompts; from the length and both ends only, so a 100k-token prompt costs no more than a short
    one (two prompts that share them only share an engine)."""
    return hash((len(ids), tuple(ids[:256]), tuple(ids[-256:])))


class StepRounds:
    """A step count for several engines that stops when one engine holding requests stops stepping: a round ends
    once every engine that held requests when it began has stepped since, or let its requests go. One stuck engine
    thus freezes the count however fast the others step, as one stuck engine freezes vLLM's own count."""

    def __init__(self, engines: int, busy: Callable[[int], bool]):
        self.count = 0
        self._engines, self._busy = engines, busy
        self._pending: set[int] = set()

    def stepped(self, engine: int) -> None:
        self._pending.discard(engine)
        self._end_round()

    def released(self, engine: int) -> None:
        if not self._busy(engine):
            self._pending.discard(engine)
            self._end_round()

    def _end_round(self) -> None:
        if not self._pending:
            self.count += 1
            self._pending = {i for i in range(self._engines) if self._busy(i)}


class EngineReplicas:
    """vLLM ``AsyncLLM`` engines serving one model as one: what `VllmEngine` calls on its ``llm``."""

    def __init__(self, llms: list[Any]):
        self.llms = llms
        self.in_flight = [0] * len(llms)
        """Requests of this server's token-in route that each engine is generating for."""
        self.running = [0] * len(llms)
        """What each engine's scheduler last said it runs (its load probe; vLLM's routes' requests too)."""
        self._next = 0
        self._owner: dict[str, int] = {}
        self._sessions: OrderedDict[str, int] = OrderedDict()
        """The engine of each rollout's latest turn, by rollout tag."""
        self._dead: set[int] = set()
        """Engines found dead (logged once): never picked again, even by a call that found them alive."""
        self.rounds = StepRounds(len(llms), lambda i: self.in_flight[i] > 0 or self.running[i] > 0)

    @property
    def primary(self) -> Any:
        """The first engine: vLLM's own routes run on it, and its model, tokenizer and renderer are every engine's."""
        return self.llms[0]

    @property
    def engine_cores(self) -> list[Any]:
        return [llm.engine_core for llm in self.llms]

    @property
    def renderer(self) -> Any:
        return self.primary.renderer

    @property
    def vllm_config(self) -> Any:
        return self.primary.vllm_config

    def get_tokenizer(self) -> Any:
        return self.primary.get_tokenizer()

    def read_loads(self, loads: list[Any]) -> None:
        """Each engine's load as the server's poller read it (`prime_inference.engines.vllm_load`)."""
        self.running = [load.running for load in loads]

    def owner(self, request_id: str) -> int | None:
        return self._owner.get(request_id)

    def _live(self) -> list[bool]:
        """Which engines still run: vLLM's ``errored`` once an engine core died. A dead one fails each request at
        once, so it always looked the least busy, and the rollouts it had served stayed with it: every request went
        to it. Its requests go to the others (none live: it takes them and fails them, naming the cause)."""
        for i, llm in enumerate(self.llms):
            if is_dead(llm):
                self._mark_dead(i)
        live = [i not in self._dead for i in range(len(self.llms))]
        return live if any(live) else [True] * len(live)

    def _mark_dead(self, engine: int, cause: BaseException | None = None) -> None:
        if engine in self._dead:
            return
        self._dead.add(engine)
        why = f" ({type(cause).__name__})" if cause is not None else ""
        logger.error("%s%s: its requests go to the other engines, and weight loads skip it",
                     died_message([engine], len(self.llms)), why)  # fmt: skip

    @property
    def dead(self) -> list[int]:
        """The engines found dead, in order."""
        self._live()
        return sorted(self._dead)

    def _pick(self, prompt: Any, session: str | None) -> int:
        live, n = self._live(), len(self.llms)
        least = min(load for load, ok in zip(self.in_flight, live, strict=True) if ok)
        home = self._sessions.get(session) if session is not None else None
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        if (home is None or not live[home]) and ids:
            home = _prompt_hash(ids) % n
        if home is not None and live[home] and self.in_flight[home] - least <= GROUP_SLACK:
            return home
        chosen = next(i for i in ((self._next + k) % n for k in range(n)) if live[i] and self.in_flight[i] == least)
        self._next = (chosen + 1) % n
        return chosen

    def _remember(self, session: str | None, engine: int) -> None:
        if session is None:
            return
        self._sessions[session] = engine
        self._sessions.move_to_end(session)
        if len(self._sessions) > SESSIONS:
            self._sessions.popitem(last=False)

    async def generate(
        self, prompt: Any, params: Any, request_id: str, session: str | None = None, **kwargs: Any
    ) -> AsyncIterator[Any]:
        """``session``: the rollout the request is a turn of (its tag), if any."""
        engine = self._pick(prompt, session)
        self._remember(session, engine)
        self._owner[request_id] = engine
        self.in_flight[engine] += 1
        try:
            async for output in self.llms[engine].generate(prompt, params, request_id, **kwargs):
                yield output
        finally:
            self.in_flight[engine] -= 1
            self._owner.pop(request_id, None)
            self.rounds.released(engine)

    async def _each(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """``method`` on every live engine at once; their answers, in order. An engine that fails the call and is
        dead after it (it died under the call) is skipped from then on; another failure is raised as it is."""
        self._live()
        engines = [i for i in range(len(self.llms)) if i not in self._dead]
        answers = await asyncio.gather(
            *(getattr(self.llms[i], method)(*args, **kwargs) for i in engines), return_exceptions=True
        )
        kept = []
        for i, answer in zip(engines, answers, strict=True):
            if isinstance(answer, BaseException) and is_dead(self.llms[i]):
                self._mark_dead(i, answer)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                kept.append(answer)
        if len(self._dead) == len(self.llms):
            raise EnginesDied(died_message(self.dead, len(self.llms)))
        return kept

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs=None) -> list:
        """Every engine's workers run ``method``; the replies of all of them, engine after engine."""
        replies = await self._each("collective_rpc", method, timeout=timeout, args=args, kwargs=kwargs)
        return [reply for engine in replies for reply in engine]

    async def pause_generation(self, **kwargs: Any) -> None:
        await self._each("pause_generation", **kwargs)

    async def resume_generation(self) -> None:
        await self._each("resume_generation")

    async def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> None:
        await self._each("reset_prefix_cache", *args, **kwargs)

    async def reset_encoder_cache(self) -> None:
        await self._each("reset_encoder_cache")

    async def add_lora(self, request: Any) -> bool:
        return all(await self._each("add_lora", request))

    async def remove_lora(self, lora_id: int) -> bool:
        return all(await self._each("remove_lora", lora_id))

    def shutdown(self) -> None:
        for llm in self.llms:
            llm.shutdown()


class RoutedTap:
    """The tap of each engine (`prime_inference.token_logprobs.TapFetcher`), asked for a request's values on the
    engine that generated it: a take sent to every engine would make each drain its worker's pending copies."""

    def __init__(self, replicas: EngineReplicas, rpc_of: Callable[[Any], Callable]):
        self.replicas = replicas
        self.taps = [TapFetcher(rpc_of(llm)) for llm in replicas.llms]

    async def take(self, request_id: str) -> Entries | None:
        engine = self.replicas.owner(request_id)
        if engine is None:  # taken after its generation ended: not ours to route
            raise RuntimeError(f"sampled log-probs of request {request_id} asked for after its generation ended")
        return await self.taps[engine].take(request_id)

    def forget(self, request_id: str) -> None:
        """An aborted request: its engine is no longer known once its generation closed, so every engine drops it."""
        engine = self.replicas.owner(request_id)
        for i, tap in enumerate(self.taps):
            if engine is None or i == engine:
                tap.forget(request_id)
