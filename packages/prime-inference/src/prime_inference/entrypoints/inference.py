"""`inference`: serve a model over HTTP (OpenAI routes, token-in generate, weight updates) with vLLM or PyTorch.

inference --model.name DIR_OR_HUB_ID --server.port 8000 --engine auto|vllm|torch
inference @ inference.toml --server.api-key KEY
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the entry point imports them after its Ctrl-C handler is in place (`main`)
    from prime_core.config.inference import InferenceConfig

STARTING = "inference: interrupted (SIGINT) while starting, before the model began to load"


def serve(config: InferenceConfig) -> None:
    """Run the server until interrupted. Heavy imports (fastapi, torch, vLLM) happen here, after parsing."""
    from prime_core.early_sigint import ends_on_sigint

    if config.vllm.headless:
        from prime_inference.engines.vllm_engine import run_headless
        from prime_inference.structured import deepen_main_stack

        deepen_main_stack()  # before vLLM starts: it compiles grammars on this thread and in the processes it starts
        run_headless(config)
        return
    with ends_on_sigint(STARTING):  # uvicorn takes SIGINT over in `run`
        server = _build_server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn raises the SIGINT again once it stopped: before, a traceback (exit -2)
        print(server.interrupted_line(), file=sys.stderr, flush=True)
        raise SystemExit(130) from None


def _build_server(config: InferenceConfig) -> Any:
    """The uvicorn server of the app; the engine loads when it starts (the app's lifespan)."""
    import uvicorn
    from prime_core.config import write_config
    from prime_core.logging import setup_logging
    from prime_core.run_dir import RunDir

    from prime_inference.connections import ClientWarningsPerMinute, uvicorn_config
    from prime_inference.engines import build_engine, select_engine
    from prime_inference.server import build_app
    from prime_inference.structured import deepen_main_stack

    deepen_main_stack()  # before vLLM starts: it compiles grammars on this thread and in the processes it starts
    run_dir = RunDir(config.output_dir)
    log_file = run_dir.log_file("inference") if config.log.file else None
    logger = setup_logging("inference", level=config.log.level, log_file=log_file)
    write_config(config, run_dir.config_file("inference"))
    app = build_app(config, lambda: build_engine(config))
    logger.info("listening on http://%s:%d", config.server.host, config.server.port)
    if warning := exposure_warning(config):
        logger.warning(warning)
    server = _server_class(uvicorn)(
        uvicorn_config(
            app,
            config,
            log_level=config.log.level,
            # One line per request (health probes, every rollout's generate) would grow the log without bound over a
            # long run; ``log.level = "debug"`` brings them back.
            access_log=config.log.level == "debug",
            log_config=None,
        )
    )
    app.state.server = server  # vLLM's engine-error handler stops it when the engine has died
    uvicorn_log = logging.getLogger("uvicorn.error")
    uvicorn_log.addFilter(CutRequestsInOneLine(config.server.shutdown_timeout))
    uvicorn_log.addFilter(ClientWarningsPerMinute())
    server.in_process = select_engine(config) == "torch"
    server.model = config.model.name
    return server


def _server_class(uvicorn: Any) -> type:
    """uvicorn's server, whose Ctrl-C says what it stopped. Ctrl-C while the model loads cannot stop the load (a
    worker thread: Python cannot cut it short), so uvicorn waited for it to end (4-9 s on the tiny CPU model) before
    stopping. The torch engine (all in this process) now ends at once: the line, the heartbeat's last record, exit 130.
    vLLM's load starts engine processes and takes GPU memory that must be stopped, not left: it still waits."""

    class Server(uvicorn.Server):
        in_process = False
        model = ""
        loading_when_interrupted: bool | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig == signal.SIGINT and self.loading_when_interrupted is None:
                self.loading_when_interrupted = not self.started
                if not self.started and self.in_process:
                    from prime_core.progress import stop_reporting

                    print(self.interrupted_line(), file=sys.stderr, flush=True)
                    stop_reporting()
                    os._exit(130)
            super().handle_exit(sig, frame)

        def interrupted_line(self) -> str:
            if self.loading_when_interrupted is None and not self.started:  # before uvicorn took SIGINT over
                return STARTING
            if self.loading_when_interrupted:
                return f"inference: interrupted (SIGINT) while loading {self.model}; nothing was served"
            return f"inference: interrupted (SIGINT); stopped serving {self.model}"

    return Server


def exposure_warning(config: InferenceConfig) -> str | None:
    """What any host that reaches a server bound beyond loopback without ``server.api_key`` (or ``api_key_var``) may
    do: the admin routes are as open as generation. (The multi-node SLURM job binds 0.0.0.0 and passes a key.)"""
    from prime_core.config.inference import is_loopback

    if is_loopback(config.server.host) or config.server.api_key is not None or config.server.api_key_var:
        return None
    return (
        f"server.host={config.server.host} without server.api_key: any host that reaches port {config.server.port} "
        "may generate, /pause the engine, /reload_weights (back to the base model) and load weights or adapters "
        "from server.weight_roots; set server.api_key unless the network is yours alone"
    )


def missing_engine(config: InferenceConfig) -> str | None:
    """One line when the chosen engine's package is not installed (``engine = vllm`` on a CPU-only install), said
    before anything loads instead of an import traceback from the vLLM app."""
    import importlib.util

    from prime_inference.engines import TORCH_HINT, VLLM_HINT

    if config.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        return f"engine: {VLLM_HINT} (or --engine torch)"
    if config.engine == "torch" and importlib.util.find_spec("torch") is None:
        return f"engine: {TORCH_HINT}"
    return None


class CutRequestsInOneLine(logging.Filter):
    """uvicorn logs each request it cuts at shutdown as an "Exception in ASGI application" traceback of a
    CancelledError: one line says what happened instead."""

    def __init__(self, timeout: float):
        super().__init__()
        self.timeout = timeout

    def filter(self, record: logging.LogRecord) -> bool:
        import asyncio

        if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
            record.msg = "a request was cut: still running %gs after the shutdown began (server.shutdown_timeout)"
            record.args, record.exc_info, record.exc_text = (self.timeout,), None, None
        return True


def check_model_files(config: InferenceConfig) -> None:
    """A ``model.name`` that is a trainer's weights step (a final model served again) must hold what the trainer
    wrote (``checksums.json``): one line and exit 2, not a model that answers NaN logits. The line names what to do
    instead where the run directory shows it (`_instead`)."""
    from pathlib import Path

    from prime_core.config.cli import fail
    from prime_core.schemas.weights import ChangedWeights, verify_weights

    path = Path(config.model.name).expanduser()
    if path.is_dir():
        step = path.resolve().name.removeprefix("step_")
        try:
            verify_weights(path, int(step) if step.isdigit() else None)
        except ChangedWeights as e:
            fail(f"model.name: {e}{_instead(path.resolve())}")


def _instead(weight_dir) -> str:
    """For ``<run>/weights/step_N``: the run's newest earlier weights step to serve, and the ``prime-launch rewind``
    that lets ``rl --resume`` train step N again from the checkpoint before it; "" where the directory shows neither."""
    from prime_core.run_dir import RunDir

    step = weight_dir.name.removeprefix("step_")
    if weight_dir.parent.name != "weights" or not step.isdigit():
        return ""
    run_dir = RunDir(weight_dir.parent.parent)
    served = [s for s in run_dir.stable_weight_steps() if s < int(step)]
    resumable = [s for s in run_dir.resumable_steps() if s < int(step)]
    ways = [f"serve step {served[-1]} instead (--model.name {run_dir.weight_step(served[-1])})"] if served else []
    if resumable:
        ways.append(
            f"`prime-launch rewind --output-dir {run_dir.root} --step {resumable[-1]}` drops it, then rl --resume "
            f"trains it again from checkpoint {resumable[-1]}"
        )
    return f"; {', or '.join(ways)}" if ways else ""


def main(argv: list[str] | None = None) -> None:
    from prime_core.early_sigint import ends_on_sigint

    with ends_on_sigint(STARTING):
        config = _checked_config(argv)
    serve(config)


def _checked_config(argv: list[str] | None) -> InferenceConfig:
    """The config, and what must hold before the server starts (a key, the engine, the port, the model's files)."""
    from prime_core.config import parse_cli
    from prime_core.config.inference import InferenceConfig

    config = parse_cli(InferenceConfig, argv, prog="inference", description=__doc__, writes_output_dir=True)
    from prime_core.config.cli import fail
    from prime_core.preflight import port_in_use

    try:  # a server meant to require a key must not serve without one
        config.server.resolved_api_key()
    except ValueError as e:
        fail(str(e))
    if missing := missing_engine(config):
        fail(missing)
    # A busy port is one line now, not an error after the model has loaded.
    busy = None if config.vllm.headless else port_in_use(config.server.host, config.server.port)
    if busy:
        fail(f"server.port: {busy}; stop that server or choose another --server.port")
    check_model_files(config)
    if not config.vllm.headless:
        from prime_core.progress import start_reporting

        start_reporting(config.output_dir, "inference")
    return config


if __name__ == "__main__":
    main()
