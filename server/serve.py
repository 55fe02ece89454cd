"""`flotilla serve`: start the engine's actors, then the OpenAI-compatible HTTP server in front of them.

The engine runs one process per actor by default (`--single-process` keeps them all in this process,
for debugging). Once the model is loaded and every actor is ready, one line says where the server
listens, which model it serves, how many tokens fit the KV cache and which kernels were chosen.
SIGTERM / Ctrl-C stop accepting connections, let in-flight streams finish (up to
--shutdown-timeout), then stop every engine process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn
import uvloop
from flotilla import envs
from flotilla.actors import ray_placement
from flotilla.actors.base import RuntimeOptions
from flotilla.actors.standalone import dump_tasks_on_sigusr1
from flotilla.config import EngineConfig
from flotilla.models.model_folder import (
    chat_template_text,
    load_tokenizer,
    max_model_len_of,
    model_dir,
    takes_images,
)
from flotilla.server.cli import engine_config_from_args, fleet_engines
from flotilla.server.engine_client import EngineClient, ready_summary
from flotilla.server.fleet import Fleet
from flotilla.server.metrics import StatsLine
from flotilla.server.protocol_logprobs import TokenTexts
from flotilla.server.reasoning_parser import REASONING_PARSERS
from flotilla.server.tool_parsers import TOOL_PARSERS
from flotilla.transport.registry import shared_registry

if TYPE_CHECKING:
    from flotilla.server.app import ServerState

log = logging.getLogger("flotilla.serve")


def _front_end(path: Path, config: EngineConfig) -> tuple[Any, Any, Any, Any]:
    """The HTTP app, the media fetcher and the tokenizer helpers (transformers' import: about a second of CPU) and
    the model's tokenizer (None with skip_tokenizer_init: token-id prompts only, as the engine's actors run), made in
    a thread while the engine's actors start rather than before they are spawned or after they are ready."""
    from flotilla.actors import tokenizer
    from flotilla.server import app, media

    loaded = None if config.model.skip_tokenizer_init else load_tokenizer(path, config.model.chat_template)
    return app, media, tokenizer, loaded


def served_name(config: EngineConfig, path: Path) -> str:
    return config.model.served_model_name or path.name


class _Server(uvicorn.Server):
    """uvicorn without its own signal capture: `serve` owns SIGINT/SIGTERM so it can stop the engine last."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def check_listen(host: str, port: int) -> str | None:
    """Why the server could not listen there (None if it can): checked before the model loads, not after."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return f"cannot listen on {host}:{port}: {e.strerror or e}"
    return None


async def serve(config: EngineConfig, args: argparse.Namespace) -> int:
    path = model_dir(config)
    placement = "inline" if args.single_process else "process"
    engines = fleet_engines(args.engines, config, args.registry, args.node_name)
    options = RuntimeOptions(heartbeat_timeout_s=args.heartbeat_timeout)
    if engines is None:
        client: EngineClient | Fleet = EngineClient(config, placement=placement, trace=args.trace, options=options,
                                                    restarts=args.engine_restarts,
                                                    restart_backoff_s=args.engine_restart_backoff)
    else:
        client = Fleet(engines, served_name(config, path), placement=placement, trace=args.trace, options=options,
                       registry=args.registry, engine_host=args.engine_host, restarts=args.engine_restarts,
                       restart_backoff_s=args.engine_restart_backoff)
    server: _Server | None = None
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set() and server is not None:
            server.force_exit = True  # a second Ctrl-C: do not wait for streams to finish
        stop.set()
        if server is not None:
            server.should_exit = True

    loop = asyncio.get_running_loop()
    dump_tasks_on_sigusr1(loop)
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    log.info("starting the engine%s for %s (%s)", "s " + ",".join(n for n, _ in engines) if engines else "", path,
             "one process" if args.single_process else "one process per actor")
    starting = asyncio.ensure_future(client.start())
    preparing = asyncio.ensure_future(asyncio.to_thread(_front_end, path, config))
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        preparing.cancel()
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await client.stop()
        return 130
    stopper.cancel()
    try:
        starting.result()
    except RuntimeError as e:  # an actor failed at start (its runtime already stopped), an unreachable registry
        preparing.cancel()
        print(f"flotilla serve: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        app, media, tok, tokenizer = await preparing
        tool_format = TOOL_PARSERS[args.tool_call_parser]
        reasoning = REASONING_PARSERS[args.reasoning_parser] if args.reasoning_parser else None
        special = []
        if tokenizer is not None:
            special = tok.special_tokens_among(tokenizer, tool_format.TAGS + (reasoning.TAGS if reasoning else ()))
            if special:
                log.info("%s are special tokens of this tokenizer: chat requests whose parsers read them run with "
                         "skip_special_tokens false unless they set it", ", ".join(special))
            await asyncio.to_thread(_check_chat_template, tok, tokenizer)
        images = takes_images(path)
        body_bytes = args.max_body_bytes or (32 if images else 4) * 2**20
        state = app.ServerState(
            client=client, model_name=served_name(config, path), max_model_len=max_model_len_of(config, path),
            token_texts=TokenTexts(_token_text(tokenizer)), tokenizer=tokenizer,
            api_key=args.api_key if args.api_key is not None else envs.FLOTILLA_API_KEY,
            max_body_bytes=body_bytes,
            media=media.MediaPolicy(allowed_domains=tuple(d.lower().rstrip(".") for d in args.allowed_media_domains),
                              fetch_timeout_s=args.media_fetch_timeout, max_bytes=body_bytes), takes_images=images,
            max_in_flight=args.max_in_flight or config.scheduler.max_num_seqs + config.scheduler.max_waiting_requests,
            tool_call_parser=tool_format, reasoning_parser=reasoning, keep_special_tokens=bool(special))
        server = _Server(uvicorn.Config(app.build_app(state), host=args.host, port=args.port, loop="none",
                                        log_level="warning", access_log=False, lifespan="off",
                                        timeout_graceful_shutdown=args.shutdown_timeout))
        failed = asyncio.Event()
        on_failure = (lambda *_: (failed.set(), setattr(server, "should_exit", True)))
        if isinstance(client, Fleet):  # one engine's death is that engine's: stop only when none is left
            client.on_all_dead.append(on_failure)
        else:  # the engine failed with no restart left
            client.on_gave_up.append(on_failure)
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.02)  # uvicorn exposes no started event
        if server.started:
            log.info("flotilla ready: http://%s:%d/v1 %s%s", args.host, args.port,
                     ready_summary(client.ready_detail, state.model_name, state.max_model_len, config.scheduler),
                     f" engines={','.join(n for n, _ in engines)}" if engines else "")
        stats_log = asyncio.create_task(_log_stats(state, args.log_stats_interval)) \
            if args.log_stats_interval > 0 else None  # fmt: skip
        try:
            await serving
        except SystemExit:  # uvicorn exits this way when it cannot start; the engine still stops cleanly
            return 1
        finally:
            if stats_log is not None:
                stats_log.cancel()
        return 1 if failed.is_set() or not server.started else 0
    finally:
        log.info("stopping the engine")
        await client.stop()
        log.info("stopped")


def _token_text(tokenizer: Any) -> Callable[[int], str]:
    """A token's text in logprobs: the tokenizer's decoding, or without one "token_id:N" (vLLM's form for a token
    it returns as its id)."""
    if tokenizer is None:
        return lambda i: f"token_id:{i}"
    return lambda i: tokenizer.decode([i])


def _check_chat_template(tok: Any, tokenizer: Any) -> None:
    """Warn, once at start, when the chat template cannot serve tool calling: it ignores a request's tools (the model
    is never shown them), or it cannot render a plain conversation at all."""
    renders = tok.template_renders_tools(tokenizer)
    if renders is None:
        log.warning("the chat template cannot render a one-message conversation (or the model has none): chat "
                    "requests may fail; pass --chat-template FILE with a template for this model")
    elif not renders:
        log.warning("the chat template ignores `tools`: the model is not shown a request's tools, so it cannot call "
                    "them as it was trained to; pass --chat-template FILE with a template that renders them (e.g. "
                    "the model family's tool-calling template)")


async def _log_stats(state: ServerState, interval: float) -> None:
    """vLLM's stats line every `interval` seconds while the engine has work (server/metrics.py StatsLine)."""
    stats = StatsLine(state.metrics, time.monotonic())
    while True:
        await asyncio.sleep(interval)
        line = stats.line(state.client.stats, time.monotonic())
        if line is not None:
            log.info("%s", line)


def main(args: argparse.Namespace) -> int:
    try:
        config = engine_config_from_args(args, args.model)
        engines = fleet_engines(args.engines, config, args.registry, args.node_name)  # bad flags: fail before loading
        if config.model.chat_template is not None:
            chat_template_text(config.model.chat_template)
        if args.single_process and engines and any(c.disagg.role != "both" for _, c in engines):
            raise ValueError("prefill, decode and encoder engines talk across processes: drop --single-process")
        if args.single_process and shared_registry(args.registry):
            raise ValueError("engines other nodes reach run one process per actor: drop --single-process")
        if args.engine_host in ("0.0.0.0", "::", "*", ""):
            raise ValueError(f"--engine-host must be an address other nodes reach this one at, not the wildcard "
                             f"{args.engine_host!r}")
    except (TypeError, ValueError) as e:
        print(f"flotilla serve: {e}", file=sys.stderr)
        return 2
    if (problem := check_listen(args.host, args.port)) is not None:
        print(f"flotilla serve: {problem}", file=sys.stderr)
        return 2
    rc = uvloop.run(serve(config, args))
    ray_placement.exit_if_connected(rc)
    gc.freeze()  # the interpreter's last collection then skips what torch and transformers built (about half a second)
    return rc
