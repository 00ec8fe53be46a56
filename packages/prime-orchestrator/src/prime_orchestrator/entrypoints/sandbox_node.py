"""``sandbox-node`` entry point: serve the local sandbox pool over HTTP (a dedicated sandbox node)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from prime_core.config import parse_cli
    from prime_core.config.sandbox import SandboxNodeConfig

    config = parse_cli(
        SandboxNodeConfig,
        argv,
        prog="sandbox-node",
        description="Serve isolated code execution (POST /execute) from a pool of warm sandboxes.",
    )

    import asyncio
    import signal
    import sys

    from prime_core.logging import setup_logging

    log_file = config.output_dir / "logs" / "sandbox-node.log" if config.output_dir and config.log.file else None
    logger = setup_logging("sandbox-node", level=config.log.level, log_file=log_file)

    async def serve() -> None:
        from aiohttp import web

        from prime_orchestrator.sandbox.pool import SandboxUnavailable
        from prime_orchestrator.sandbox.server import Listener, build_app, connection_cap

        try:
            runner = web.AppRunner(build_app(config), keepalive_timeout=config.idle_s)
            await runner.setup()
        except (SandboxUnavailable, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        listener = Listener(runner, config.host, config.port, connection_cap(config))
        port = listener.port
        logger.info("sandbox node listening on http://%s:%d", config.host, port)
        print(f"sandbox node listening on http://{config.host}:{port}", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        await stop.wait()
        await listener.close()
        await runner.cleanup()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
