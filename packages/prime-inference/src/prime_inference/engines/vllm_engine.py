"""The vLLM engine (GPU): vLLM 0.26's `AsyncLLM` behind prime's HTTP surface. Every vllm import lives here.

vLLM is extended through its seams, not forked:
* engine options: ``[vllm]`` config keys and ``vllm.extra_args`` go through vLLM's own argument parser;
* a worker extension (`prime_inference.vllm_plugin.PrimeWorkerExtension`, passed as ``worker_extension_cls``)
  adds worker-side RPCs (plugin liveness, STABLE-checked reload, a weight checksum for tests) and, with
  ``vllm.fast_token_logprobs``, the sampled-log-prob tap (`prime_inference.token_logprobs`);
* the ``vllm.general_plugins`` entry point (`prime_inference.vllm_plugin.register`) runs in every vLLM process;
* weight updates from a directory use vLLM's native layerwise reload (``collective_rpc("reload_weights",
  kwargs={"weights_path": dir})``); a streamed transport (the trainer's broadcast) runs its receiver inside every
  worker (``collective_rpc("prime_receive_weights")``), which loads each bucket with ``model.load_weights``; a
  streamed LoRA adapter (CUDA IPC) is received by every worker (``prime_receive_adapter``) and then added with
  vLLM's own ``add_lora`` (`prime_inference.vllm_lora`).

Pause and update semantics match the torch engine: ``/pause`` is ``pause_generation(mode="keep", clear_cache=False)``
(running requests freeze with their KV cache, new ones queue). An update while not paused is bracketed by
``pause_generation`` and ``resume_generation``: with ``weight_update = "in_flight"`` in mode ``keep`` (running requests
freeze at a step boundary and go on with the new weights, their KV cache kept, as the torch engine explains), with
``drain`` in mode ``wait`` (they finish on the old weights). In flight, cached prefixes are salted by the weight step
instead of reset (a reset cannot drop the blocks of frozen requests), so a new request never reuses KV of older
weights. The worker tap files each sampled log-prob with the weight step that sampled it (exact per-token steps);
an untapped request reports bounds (its first token no older than the step at its start).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

from prime_core.config.inference import InferenceConfig, VllmConfig
from prime_core.io import one_line
from prime_core.schemas.weights import Manifest

from prime_inference.engines.base import Engine, EngineInfo, EngineOutput, EngineRequest
from prime_inference.engines.vllm_load import LoadPoller
from prime_inference.engines.vllm_outputs import prompt_logprobs_of, split_logprobs
from prime_inference.engines.vllm_replicas import (
    EngineReplicas,
    RoutedTap,
    dead_engines,
    died_message,
    none_left,
    start_engines,
)
from prime_inference.engines.vllm_requests import refused_as_400, sampling_params
from prime_inference.protocol import RequestError
from prime_inference.token_logprobs import TapFetcher, align

logger = logging.getLogger(__name__)

WORKER_EXTENSION_CLS = "prime_inference.vllm_plugin.PrimeWorkerExtension"
LOGPROBS_MODES = {"processed": "processed_logprobs", "raw": "raw_logprobs"}
VLLM_SERVE_MAX_NUM_SEQS = 1024
"""``vllm serve``'s sequences per step on an H100-class GPU, the context this server starts vLLM in."""


def vllm_cli_args(config: InferenceConfig, *, headless: bool = False) -> list[str]:
    """The ``vllm serve``-style argv for this config (engine flags only)."""
    v = config.vllm
    args = [
        "--model", config.model.name,
        "--dtype", config.model.dtype,
        "--seed", str(config.seed),
        "--gpu-memory-utilization", str(v.gpu_memory_utilization),
        "--tensor-parallel-size", str(v.tensor_parallel_size),
        "--data-parallel-size", str(v.data_parallel_size),
        "--logprobs-mode", LOGPROBS_MODES[config.logprobs_mode],
        "--worker-extension-cls", WORKER_EXTENSION_CLS,
    ]  # fmt: skip
    if config.model.trust_remote_code:
        args.append("--trust-remote-code")
    if config.max_model_len is not None:
        args += ["--max-model-len", str(config.max_model_len)]
    if config.server.served_model_name:
        args += ["--served-model-name", config.server.served_model_name]
    if v.data_parallel_size_local is not None:
        args += ["--data-parallel-size-local", str(v.data_parallel_size_local)]
    if v.data_parallel_address is not None:
        args += ["--data-parallel-address", v.data_parallel_address]
    if v.data_parallel_rpc_port is not None:
        args += ["--data-parallel-rpc-port", str(v.data_parallel_rpc_port)]
    if v.enforce_eager:
        args.append("--enforce-eager")
    if not v.log_stats:
        args.append("--disable-log-stats")
    if v.max_num_seqs is not None:
        args += ["--max-num-seqs", str(v.max_num_seqs)]
    if not v.enforce_eager and not names_capture_sizes(v.extra_args):
        args += ["--max-cudagraph-capture-size", str(cudagraph_capture_size(v))]
    if v.enable_prefix_caching is not None:
        args.append("--enable-prefix-caching" if v.enable_prefix_caching else "--no-enable-prefix-caching")
    if config.lora_enabled:
        rank = str(config.max_lora_rank)
        args += ["--enable-lora", "--max-loras", str(config.lora.max_loras), "--max-lora-rank", rank]
        if config.lora.max_cpu_loras is not None:
            args += ["--max-cpu-loras", str(config.lora.max_cpu_loras)]
    if config.auto_tool_choice:
        args.append("--enable-auto-tool-choice")
    if config.tool_parser is not None:
        args += ["--tool-call-parser", config.tool_parser]
    if config.reasoning_parser is not None:
        args += ["--reasoning-parser", config.reasoning_parser]
    if headless:
        args.append("--headless")
    return args + list(v.extra_args)


def cudagraph_capture_size(v: VllmConfig) -> int:
    """``vllm.max_cudagraph_capture_size``, or what it means unset: graphs for every step the engine may decode."""
    if v.max_cudagraph_capture_size is not None:
        return v.max_cudagraph_capture_size
    seqs = v.max_num_seqs or VLLM_SERVE_MAX_NUM_SEQS
    return max(seqs, min(2 * seqs, 512))


def names_capture_sizes(extra_args: list[str]) -> bool:
    """Whether the user's flags choose the captured sizes themselves (``--cuda-graph-sizes``, or
    ``cudagraph_capture_sizes`` / ``max_cudagraph_capture_size`` in ``--compilation-config`` or ``-cc.``): vLLM refuses
    a capture limit that disagrees with an explicit list of sizes."""
    text = " ".join(extra_args).replace("-", "_")
    return "cudagraph_capture_size" in text or "cuda_graph_sizes" in text


def engine_args(config: InferenceConfig, engine: int = 0) -> Any:
    """Parse the argv with ``vllm serve``'s own parser, so ``extra_args`` accepts exactly what ``vllm serve`` does
    (server flags such as ``--chat-template`` included; the engine takes its own fields from the namespace).
    ``engine``: which of ``vllm.engines`` engines on the same GPUs this is: it gets its share of the memory, and a seed
    of its own (the same seed would give unseeded requests on two engines the same samples)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="inference --vllm.extra-args"))
    namespace = parser.parse_args(vllm_cli_args(config))
    args = AsyncEngineArgs.from_cli_args(namespace)
    if config.vllm.enable_fp32_lm_head and hasattr(args, "enable_fp32_lm_head"):
        args.enable_fp32_lm_head = True
    if config.vllm.engines > 1:
        args.gpu_memory_utilization = config.vllm.gpu_memory_utilization / config.vllm.engines
        args.seed = config.seed + engine
    return args


def run_headless(config: InferenceConfig) -> None:
    """Secondary data-parallel node: engine cores only, no HTTP server (vLLM's own ``serve --headless``)."""
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *vllm_cli_args(config, headless=True)]
    vllm_main()


class VllmEngine(Engine):
    name = "vllm"
    live_versions = False  # non-streamed requests deliver their tokens at the end
    # Text prompts on the base model: a distillation teacher's scores (max_tokens 1, prompt_logprobs 0).
    supports_prompt_logprobs = True

    def __init__(self, config: InferenceConfig):
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        self.config = config
        self._load = LoadPoller()  # KV-cache usage, queue and preemptions for /health (engines/vllm_load.py)
        # `vllm serve`'s context, hence its batch defaults (on an H100: 1024 sequences and 8192 tokens per step);
        # vLLM's default engine context gives 128 and 2048: a server without vllm.max_num_seqs decoded only 128
        # rollouts at a time.
        self.llm = start_engines(config.vllm.engines, lambda i: AsyncLLM.from_engine_args(
            engine_args(config, i), usage_context=UsageContext.OPENAI_API_SERVER))  # fmt: skip
        self.tokenizer = self.llm.get_tokenizer()
        model_config = self.llm.vllm_config.model_config
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.get_vocab_size()
        self.weight_step, self.weight_dir = 0, None
        self._paused = False
        self._admin_lock: asyncio.Lock | None = None
        self._plugin: dict[str, Any] = {}
        # name -> (vLLM LoRARequest, weight step); a name keeps its int id across in-place reloads.
        self._adapters: dict[str, tuple[Any, int | None]] = {}
        self._next_lora_id = 1
        self._tap: TapFetcher | None = None
        self._in_flight = 0
        self.in_flight_updates = config.weight_update == "in_flight"
        self._steps = 0
        self._swapping = False
        self._unusable: str | None = None  # why the loaded weights must not be sampled (a load failed part-way)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            engine=self.name,
            model=self.config.served_model_name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            weight_step=self.weight_step,
            weight_dir=self.weight_dir,
            # A weight swap pauses vLLM's scheduler (requests queue, no step runs); its own bound is the relay's.
            paused=self._paused or self._swapping,
            extra={
                "vllm_plugin": self._plugin,
                "fast_token_logprobs": self._tap is not None,
                "engines": self.engines,
                "dead_engines": dead_engines(self.llm),
            },
            **self._load.fields(self._in_flight),  # running, waiting, KV-cache usage, preemptions (vllm_load.py)
            steps=self._engine_steps(),
            adapters={name: {"path": r.lora_path, "weight_step": s} for name, (r, s) in self._adapters.items()},
        )

    def _count_engine_steps(self) -> None:
        """Count each engine core's steps as their outputs arrive: every step that advanced a request sends one batch
        to the output handler, which pulls it with ``engine_core.get_output_async()`` (looked up on each call). A count
        that stops while requests are in flight is an engine core that stopped behind a front end that still answers
        ``/health``."""
        for engine, core in enumerate(self._engine_cores()):
            core.get_output_async = self._counting(core.get_output_async, engine)

    def _counting(self, pull: Any, engine: int) -> Any:
        replicas = self.llm if isinstance(self.llm, EngineReplicas) else None

        async def counted() -> Any:
            outputs = await pull()
            if outputs.outputs:
                self._steps += 1
                if replicas is not None:
                    replicas.rounds.stepped(engine)
            return outputs

        return counted

    def _engine_cores(self) -> list[Any]:
        return self.llm.engine_cores if isinstance(self.llm, EngineReplicas) else [self.llm.engine_core]

    @property
    def engines(self) -> int:
        return len(self.llm.llms) if isinstance(self.llm, EngineReplicas) else 1

    @contextlib.asynccontextmanager
    async def _naming_death(self, what: str) -> AsyncIterator[None]:
        """An error that means every engine died (vLLM never restarts a dead engine core) as a 503 naming them, and
        nothing served from then on (before, vLLM's EngineDeadError: HTTP 500 "internal error: EngineDeadError")."""
        try:
            yield
        except Exception as e:
            if (died := none_left(self.llm, e)) is None:
                raise
            self._unusable = f"{died}: {what}; this server serves nothing until restarted"
            raise RequestError(self._unusable, status_code=503, permanent=True) from e

    def _unserved(self) -> RequestError:
        """Why nothing is served: permanent once every engine died; a failed load ends at the next complete one."""
        return RequestError(self._unusable or "", status_code=503, permanent=none_left(self.llm) is not None)

    def _engine_steps(self) -> int:
        """Steps made; with several engines, rounds in which every engine holding requests stepped (`StepRounds`)."""
        return self.llm.rounds.count if isinstance(self.llm, EngineReplicas) else self._steps

    def lora_requests(self) -> dict[str, Any]:
        """Served adapters as vLLM ``LoRARequest``s, by name (what vLLM's OpenAI routes resolve ``model`` with)."""
        return {name: request for name, (request, _) in self._adapters.items()}

    async def start(self) -> None:
        self._admin_lock = asyncio.Lock()
        self._count_engine_steps()
        replicas = self.llm if isinstance(self.llm, EngineReplicas) else None
        on_read = None if replicas is None else replicas.read_loads
        self._load.start(self._engine_cores(), on_read)
        # vLLM swallows plugin failures, so check that the worker extension really answers on every worker.
        replies = await self.llm.collective_rpc("prime_plugin_status")
        self._plugin = {"workers": len(replies), "loaded": all(r.get("general_plugin") for r in replies)}
        if not self._plugin["loaded"]:
            logger.warning("prime's vllm.general_plugins entry point did not run in every worker: %s", replies)
        if self.config.vllm.fast_token_logprobs:
            await self._install_tap()
        for name, path in self.config.lora.adapters.items():
            await self.load_adapter(name, path, None)

    async def _install_tap(self) -> None:
        if self.config.vllm.data_parallel_size > 1:
            logger.warning("vllm.fast_token_logprobs: off with data parallelism (a request's values live on one of "
                           "several engines); using vLLM's log-probs")  # fmt: skip
            return
        if not all(await self.llm.collective_rpc("prime_install_token_logprobs")):
            logger.warning("vllm.fast_token_logprobs: the model runner cannot be tapped (vLLM's V1 runner or "
                           "speculative decoding); using vLLM's log-probs")  # fmt: skip
            return

        def rpc_of(llm: Any) -> Any:
            async def take(request_ids: list[str]) -> list[dict[str, Any]]:
                return await llm.collective_rpc("prime_take_token_logprobs", args=(request_ids,))

            return take

        if isinstance(self.llm, EngineReplicas):
            self._tap = RoutedTap(self.llm, rpc_of)  # type: ignore[assignment]
        else:
            self._tap = TapFetcher(rpc_of(self.llm))

    async def shutdown(self) -> None:
        await self._load.stop()
        self.llm.shutdown()

    def _sampling_params(self, request: EngineRequest, tapped: bool) -> Any:
        return sampling_params(request, tapped)  # a method: CPU tests replace it, having no vllm to build one

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self._unusable is None and (died := none_left(self.llm)) is not None:
            self._unusable = f"{died}: this server serves nothing until restarted"
        if self._unusable is not None:
            raise self._unserved()
        k = request.params.logprobs
        # The tap serves what RL sends: the sampled tokens' log-probs, in one response per request. renderers' client
        # asks for logprobs=1, which on this route means the same: its top_logprobs hold the first max(k, 1) entries.
        tapped = self._tap is not None and k is not None and k <= 1 and not request.stream
        params = self._sampling_params(request, tapped)
        prompt = {"prompt_token_ids": list(request.prompt_ids)}
        if request.multimodal is not None:
            prompt = request.multimodal.vllm_prompt(list(request.prompt_ids))
        first_step = self.weight_step  # no token of this request is sampled with older weights
        if self.in_flight_updates:
            prompt["cache_salt"] = f"prime-weights-{first_step}"
        # vLLM deprecated raw prompts in AsyncLLM.generate: its renderer turns them into engine inputs (images too).
        (engine_input,) = await self.llm.renderer.render_cmpl_async([prompt])
        # Closing this generator early closes vLLM's, which aborts the request inside the engine.
        lora = None
        if request.lora_name is not None:
            if request.lora_name not in self._adapters:
                raise RequestError(f"LoRA adapter {request.lora_name!r} was unloaded", status_code=404, param="model")
            lora = self._adapters[request.lora_name][0]
        taken, delivered = False, 0
        self._in_flight += 1
        # Several engines: a rollout's next turn goes where its previous turn's prefix is cached.
        route = {"session": request.session} if self.engines > 1 else {}
        try:
            async for result in refused_as_400(
                self.llm.generate(engine_input, params, request.request_id, lora_request=lora, **route)
            ):
                if self._unusable is not None:  # a failed load under it (in flight): closing aborts it in vLLM
                    raise self._unserved()
                out = result.outputs[0]
                logprobs = top = steps = None
                if tapped and result.finished:
                    taken = True
                    logprobs, steps = await self._tapped_logprobs(request, out)
                elif k is not None and out.logprobs is not None:
                    logprobs, top = split_logprobs(out.token_ids, out.logprobs, k)
                ids, finish = list(out.token_ids), out.finish_reason if result.finished else None
                exact = steps is not None
                if steps is None:  # bounds: the first token no older than the start, the others than now
                    steps = [first_step if delivered == 0 and i == 0 else self.weight_step for i in range(len(ids))]
                delivered += len(ids)
                delta = EngineOutput(ids, logprobs, top, finish, out.stop_reason, self.weight_step, steps, exact)
                if request.params.prompt_logprobs is not None and result.prompt_logprobs is not None:
                    delta.prompt_logprobs = prompt_logprobs_of(result.prompt_logprobs)
                yield delta
        finally:
            self._in_flight -= 1
            if tapped and not taken:  # aborted: the worker forgets what it collected
                self._tap.forget(request.request_id)  # type: ignore[union-attr]

    async def _tapped_logprobs(self, request: EngineRequest, out: Any) -> tuple[list[float], list[int] | None]:
        """Each token's log-prob, and the weight step that sampled it (None: not known exactly)."""
        assert self._tap is not None
        aligned = align(await self._tap.take(request.request_id), len(request.prompt_ids), out.token_ids)
        if aligned is not None:
            return aligned
        # A step the tap did not file (it leaves vLLM's tensors in place then): vLLM's own values, if complete.
        if out.logprobs is not None and len(out.logprobs) == len(out.token_ids):
            return split_logprobs(out.token_ids, out.logprobs, 0)[0], None
        raise RuntimeError(f"sampled log-probs missing for request {request.request_id}")

    async def _forget_old_weights(self) -> None:
        """Cached prefixes and vision-encoder outputs were computed with the old weights. vLLM's worker-side reload
        clears only the worker's encoder cache; the scheduler would then still count on it (an "Encoder cache miss"
        kills the engine), so both sides are reset together."""
        await self.llm.reset_prefix_cache()
        await self.llm.reset_encoder_cache()

    async def _swap_weights(self, method: str, kwargs: dict[str, Any], step: int, weight_dir: str | None) -> None:
        """Run a worker RPC that replaces the weights with those of ``step``, between engine steps: unless paused,
        running requests freeze (in flight) or finish on the old weights first (drain)."""
        was_paused = self._paused
        self._swapping = True
        try:
            # The pause inside: on a dead engine it is the first call that fails.
            async with self._naming_death(f"weights step {step} not loaded"):
                if not was_paused:
                    mode = "keep" if self.in_flight_updates else "wait"
                    await self.llm.pause_generation(mode=mode, clear_cache=False)
                try:
                    try:
                        answers = await self.llm.collective_rpc(method, kwargs={**kwargs, "version": step})
                        refusal = next((a for a in answers or () if isinstance(a, str)), None)  # a worker's NaN check
                    except Exception as e:
                        if none_left(self.llm, e) is not None:
                            raise
                        refusal, cause = str(e) or type(e).__name__, e
                    else:
                        cause = None
                    if refusal is not None:
                        # vLLM loads in place: a load that failed part-way (or loaded NaNs) left weights of no
                        # step, which must not be sampled under the old step's name. A later complete load serves.
                        self._unusable = (
                            f"loading the weights of step {step} failed ({one_line(refusal)}): this "
                            "server serves nothing until weights load completely"
                        )
                        raise RequestError(self._unusable, status_code=400, param="weight_dir") from cause
                    self._unusable = None
                    if self.in_flight_updates:
                        await self.llm.reset_encoder_cache()  # the reload cleared the workers' (prefixes are salted)
                    else:
                        await self._forget_old_weights()
                    # Before resuming: a request that starts from here on samples with these weights only.
                    self.weight_step, self.weight_dir = step, weight_dir
                finally:
                    if not was_paused:
                        await self.llm.resume_generation()
        finally:
            self._swapping = False
        if dead := dead_engines(self.llm):
            logger.warning("weights step %d loaded on %d of %d engines: %s", step, self.engines - len(dead),
                           self.engines, died_message(dead, self.engines))  # fmt: skip

    async def update_weights(self, weight_dir: str, step: int | None) -> None:
        assert self._admin_lock is not None
        async with self._admin_lock:
            new = self.weight_step + 1 if step is None else step
            await self._swap_weights("prime_reload_weights", {"weights_path": weight_dir}, new, weight_dir)

    async def receive_weights(self, manifest: Manifest, step: int | None) -> None:
        assert self._admin_lock is not None
        async with self._admin_lock:
            new = self.weight_step + 1 if step is None else step
            await self._swap_weights("prime_receive_weights", {"manifest": manifest.model_dump()}, new, None)

    async def reload_weights(self) -> None:
        assert self._admin_lock is not None
        async with self._admin_lock:
            await self._swap_weights("prime_reload_weights", {"weights_path": self.config.model.name}, 0, None)

    async def load_adapter(self, name: str, path: str, step: int | None) -> None:
        """vLLM's LoRA manager loads the adapter; an existing name is reloaded in place (``load_inplace``)."""
        await self._add_lora(name, path, step)

    async def receive_adapter(self, name: str, manifest: Manifest, step: int | None) -> None:
        """Every worker takes the adapter's tensors (``prime_receive_adapter``, kept in host memory for vLLM's loader,
        `prime_inference.vllm_lora`), then vLLM adds it as from a directory, under a path naming the transfer."""
        from prime_inference.vllm_lora import ipc_path

        await self._add_lora(name, ipc_path(manifest), step, manifest)

    async def _add_lora(self, name: str, path: str, step: int | None, manifest: Manifest | None = None) -> None:
        from vllm.lora.request import LoRARequest

        if not self.config.lora_enabled:
            raise RequestError("LoRA is not enabled: start the server with model.lora or lora.enable", status_code=400)
        assert self._admin_lock is not None
        async with self._admin_lock, self._naming_death(f"LoRA adapter {name!r} not loaded"):
            old = self._adapters.get(name)
            lora_id = old[0].lora_int_id if old is not None else self._next_lora_id
            if manifest is not None:
                rpc = {"manifest": manifest.model_dump(), "lora_int_id": lora_id}
                await self.llm.collective_rpc("prime_receive_adapter", kwargs=rpc)
            request = LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path, load_inplace=old is not None)
            if not await self.llm.add_lora(request):
                raise RuntimeError(f"vLLM refused LoRA adapter {name!r} from {path}")
            if old is None:
                self._next_lora_id += 1
            else:
                # Cached prefixes of this adapter id were computed with its previous weights.
                await self.llm.reset_prefix_cache()
            self._adapters[name] = (request, step)

    async def unload_adapter(self, name: str) -> None:
        assert self._admin_lock is not None
        async with self._admin_lock:
            if name not in self._adapters:
                raise RequestError(f"no LoRA adapter named {name!r} is loaded", status_code=404, param="lora_name")
            request, _ = self._adapters.pop(name)
            await self.llm.remove_lora(request.lora_int_id)

    async def pause(self) -> None:
        async with self._naming_death("not paused"):
            await self.llm.pause_generation(mode="keep", clear_cache=False)
        self._paused = True

    async def resume(self) -> None:
        async with self._naming_death("not resumed"):
            await self.llm.resume_generation()
        self._paused = False
