"""The Actor: one asyncio task with one inbox, typed handlers, a ready handshake and heartbeats.

An actor subclass names the messages it accepts (``inbox``) and defines ``on_<snake_case_name>`` for
each; a missing handler is a TypeError when the class is defined, not a surprise at run time. The
same actor runs three ways with the same code: alone (``flotilla actor NAME``), with its peers in one
process (inproc://), or in a process of its own (ipc:// or tcp://); see actors/runtime.py.

Life of an actor: bind the inbox -> ``setup()`` (load a model, ...) -> ReadyEvent to the supervisor ->
heartbeats every interval while handling messages one at a time, in arrival order -> StopCmd, a
signal, or the runtime's stop -> ``teardown()`` -> sockets closed. A handler that raises is logged and
answered by ``on_handler_error``; the actor keeps serving (the actor boundary is the one place where
``except Exception`` is allowed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import msgspec
import zmq.asyncio

from flotilla.transport.channels import Inbox, Outbox
from flotilla.transport.codec import format_message
from flotilla.transport.endpoints import Endpoints, key
from flotilla.transport.messages import HeartbeatEvent, Message, ReadyEvent, StopCmd

log = logging.getLogger(__name__)

READ_AHEAD = 256
"""Most messages an actor reads ahead while one of its handler's sends waits (Actor._send_watching_for_stop)."""


class _StopRequested(BaseException):
    """A StopCmd arrived while a handler's send waited: ends the handler (not an error of it) and the actor."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RuntimeOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Liveness settings shared by the supervisor and every actor of a topology."""

    heartbeat_interval_s: float = 0.5
    """How often each actor says it is alive, seconds."""
    heartbeat_timeout_s: float = 10.0
    """Silence after which the supervisor declares an actor dead, seconds."""
    ready_timeout_s: float = 300.0
    """How long start-up (model load included) may take before the topology gives up, seconds."""
    stop_grace_s: float = 10.0
    """After StopCmd, how long an actor may take to exit before it is terminated, seconds."""

    def __post_init__(self) -> None:
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")


class ActorContext(msgspec.Struct, kw_only=True):
    """Everything an actor instance needs to know about its place in the topology."""

    name: str
    """Actor name in the topology (several names may share one kind)."""
    instance: int = 0
    """Replica index, 0-based."""
    endpoints: Endpoints
    """Every address of the topology."""
    config: dict[str, Any] = {}
    """Actor-specific settings from the topology file."""
    options: RuntimeOptions = RuntimeOptions()
    """Liveness settings."""
    trace: bool = False
    """Print every message in and out, readable (``--trace``)."""


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name).lower()


def handler_name(msg_type: type[Message]) -> str:
    """``StepResult`` -> ``on_step_result``; ``KVCacheInfoEvent`` -> ``on_kv_cache_info_event``."""
    return "on_" + _snake(msg_type.__name__)


class Actor:
    """Base class of every flotilla actor."""

    kind: ClassVar[str] = ""
    """Registry name of the actor class (``flotilla actor KIND``)."""
    inbox: ClassVar[tuple[type[Message], ...]] = ()
    """Messages this actor accepts; StopCmd is always accepted."""
    _handlers: ClassVar[dict[type[Message], str]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        missing = [handler_name(t) for t in cls.inbox if not callable(getattr(cls, handler_name(t), None))]
        if missing:
            raise TypeError(f"{cls.__name__} accepts messages it has no handler for: {', '.join(missing)}")
        cls._handlers = {t: handler_name(t) for t in cls.inbox}

    def __init__(self, ctx: ActorContext, zmq_ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.zmq = zmq_ctx
        self.address = ctx.endpoints.of(ctx.name, ctx.instance)
        self._outboxes: dict[str, Outbox] = {}
        self._inbox: Inbox | None = None
        self._hb_seq = 0
        self._self_address = f"inproc://flotilla-self-{id(self):x}"
        self._closed = False
        self._receiver: asyncio.Task | None = None
        """The task of the receive loop (the one reader of the inbox)."""
        self._read_ahead: deque[Message] = deque()
        """Messages read while a handler's send waited (see _send_watching_for_stop), handled next, in order."""
        self.dropped_replies = 0
        """Answers to another node's front end dropped because it read none of the last SEND_HWM."""
        self.ready = asyncio.Event()
        """Set once the actor has said ready (its setup done)."""
        self._trace_out = sys.stderr

    # ---- for subclasses -----------------------------------------------------------------------

    async def setup(self) -> dict[str, str]:
        """Acquire resources before the ready handshake; returns facts for the ready log line."""
        return {}

    async def teardown(self) -> None:
        """Release resources after the last message."""

    async def on_handler_error(self, msg: Message, exc: BaseException) -> None:
        """A handler raised: answer the caller if the message says who it is (default: only log)."""

    async def send(self, peer: str, msg: Message, instance: int = 0) -> None:
        """Send to a peer actor's inbox by topology name."""
        await self.send_to(self.ctx.endpoints.of(peer, instance), msg)

    def send_nowait(self, peer: str, msg: Message, instance: int = 0) -> bool:
        """Send if the peer's queue has room; False (message dropped) otherwise. For best-effort telemetry only."""
        address = self.ctx.endpoints.of(peer, instance)
        if self.ctx.trace:
            self._trace("->", msg, address)
        return self._outbox(address).send_nowait(msg)

    def _outbox(self, address: str) -> Outbox:
        out = self._outboxes.get(address)
        if out is None:
            out = self._outboxes[address] = Outbox(self.zmq, address)
        return out

    async def send_to(self, address: str, msg: Message) -> None:
        """Send to an inbox by address (outboxes are opened once and kept)."""
        if self.ctx.trace:
            self._trace("->", msg, address)
        out = self._outbox(address)
        frames = out.send_at_once(msg)
        if frames is None:
            return
        if asyncio.current_task() is not self._receiver:
            await out.send_frames(frames)
        else:
            await self._send_watching_for_stop(out.send_frames(frames))

    async def _send_watching_for_stop(self, sending: Awaitable[None]) -> None:
        """A handler's send that must wait (the peer's queue is full, or the peer is gone: stopped before us):
        meanwhile the inbox is read on, so that a StopCmd behind the message being handled stops the actor now
        instead of after the runtime's grace period. What else arrives is handled next, in order (up to
        READ_AHEAD messages; past them the send is simply awaited)."""
        send = asyncio.ensure_future(sending)
        try:
            while not send.done() and len(self._read_ahead) < READ_AHEAD:
                peek = asyncio.ensure_future(self._inbox.recv())
                await asyncio.wait((send, peek), return_when=asyncio.FIRST_COMPLETED)
                if not peek.done():
                    peek.cancel()  # (it takes a message only after its wait, in the step that returns it)
                    await asyncio.gather(peek, return_exceptions=True)
                if not peek.cancelled():
                    msg = peek.result()
                    if isinstance(msg, StopCmd):
                        raise _StopRequested(msg.reason)
                    self._read_ahead.append(msg)
            await send
        finally:
            if not send.done():
                send.cancel()

    async def reply(self, reply_to: str | None, msg: Message) -> None:
        """Send a request's answer (its text, its failure) to the front end that asked: `reply_to`, the inbox of a
        front end on another node (GenerateRequest.reply_to), or else the engine's own front end (the `frontend`
        peer of the topology). Another node's front end may be gone without anyone telling this engine, so its
        answers never wait: when its queue is full (SEND_HWM messages unread) they are dropped, with a warning."""
        if reply_to is None:
            await self.send(str(self.ctx.config.get("frontend", "frontend")), msg)
            return
        if self.ctx.trace:
            self._trace("->", msg, reply_to)
        if not self._outbox(reply_to).send_nowait(msg):
            self.dropped_replies += 1
            log.warning("%s: the front end at %s reads nothing (%d answers dropped so far)", self.label, reply_to,
                        self.dropped_replies)

    @property
    def label(self) -> str:
        return key(self.ctx.name, self.ctx.instance)

    # ---- the loop -----------------------------------------------------------------------------

    async def serve(self) -> None:
        """Bind, set up, say ready, handle messages until stopped; always closes its sockets."""
        self._inbox = Inbox(self.zmq, self.address, (*self.inbox, StopCmd))
        # a second, in-process endpoint for request_stop: it works even when the ipc path was unlinked
        self._inbox.sock.bind(self._self_address)
        heartbeat: asyncio.Task | None = None
        try:
            detail = await self.setup()
            await self._to_supervisor(ReadyEvent(
                actor=self.ctx.name, instance=self.ctx.instance, pid=os.getpid(), host=socket.gethostname(),
                address=self.address, detail={k: str(v) for k, v in detail.items()}))
            log.info("%s ready on %s", self.label, self.address)
            self.ready.set()
            heartbeat = asyncio.create_task(self._heartbeat(), name=f"{self.label}-heartbeat")
            await self._receive_until_stopped()
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
            try:
                await self.teardown()
            finally:
                self._close()

    async def _receive_until_stopped(self) -> None:
        assert self._inbox is not None
        self._receiver = asyncio.current_task()
        while True:
            msg = self._read_ahead.popleft() if self._read_ahead else await self._inbox.recv()
            if self.ctx.trace:
                self._trace("<-", msg, self.address)
            if isinstance(msg, StopCmd):
                log.info("%s stopping: %s", self.label, msg.reason or "StopCmd")
                return
            try:
                await self._dispatch(msg)
            except _StopRequested as stop:
                log.info("%s stopping: %s (a send of its %s handler was waiting)", self.label,
                         stop.reason or "StopCmd", type(msg).__name__)
                return

    def request_stop(self, reason: str = "") -> None:
        """Stop after the messages already queued (safe from a signal handler): StopCmd to our own inbox. Once
        the actor has closed its sockets it does nothing: a new socket then would keep the zmq context's
        term() waiting forever."""
        if not self._closed:
            self._outbox(self._self_address).send_nowait(StopCmd(reason=reason))

    async def _dispatch(self, msg: Message) -> None:
        handler: Callable[[Message], Awaitable[None]] = getattr(self, self._handlers[type(msg)])
        try:
            await handler(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # actor boundary: report and keep serving
            log.exception("%s: handler %s failed", self.label, self._handlers[type(msg)])
            try:
                await self.on_handler_error(msg, exc)
            except Exception:
                log.exception("%s: on_handler_error failed too", self.label)

    async def _heartbeat(self) -> None:
        interval = self.ctx.options.heartbeat_interval_s
        while True:
            await asyncio.sleep(interval)
            self._hb_seq += 1
            await self._to_supervisor(HeartbeatEvent(actor=self.ctx.name, instance=self.ctx.instance, seq=self._hb_seq))

    async def _to_supervisor(self, msg: Message) -> None:
        if self.ctx.endpoints.supervisor:
            self._outbox(self.ctx.endpoints.supervisor).send_nowait(msg)  # liveness must never block the actor

    def _trace(self, arrow: str, msg: Message, address: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        print(f"{stamp} {self.label} {arrow} {address} {format_message(msg)}", file=self._trace_out, flush=True)

    @property
    def dropped_messages(self) -> int:
        """Malformed frame sets dropped by the inbox so far."""
        return self._inbox.dropped if self._inbox else 0

    def _close(self) -> None:
        self._closed = True
        for out in self._outboxes.values():
            out.close()
        self._outboxes.clear()
        if self._inbox is not None:
            self._inbox.close()
