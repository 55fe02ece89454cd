"""ZeroMQ sockets for the control plane, with the house rules built in.

Rules: the receiver binds and senders connect (an actor's inbox is its one stable address);
ROUTER binds and DEALERs connect with their rank as identity. High-water marks are set so PUSH
*blocks* (awaits) rather than drops when a peer falls behind: a control message is never lost
silently, and a slow consumer slows its producers (backpressure) instead of growing memory without
bound. Linger is bounded so a stop flushes the last messages but a dead peer cannot hang shutdown.

Sends and receives first try the socket without waiting, through a plain socket over the same ZeroMQ socket,
and only await zmq.asyncio's future when the peer's queue is full or nothing has arrived: pyzmq's asyncio path
makes a future and checks the socket's events for every message, a large share of the control plane's time per
message. A send waits behind any earlier send still waiting, so messages keep their order.

A socket at a tcp:// address beyond loopback authenticates with the deployment's cluster key (transport/auth.py):
an inbox or ROUTER accepts only peers that hold it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from flotilla.transport import auth
from flotilla.transport.codec import Decoder, DecodeError, Encoder
from flotilla.transport.messages import Message

log = logging.getLogger(__name__)

SEND_HWM = 10_000
"""Messages queued per outgoing pipe before send awaits (backpressure, never drop)."""
RECV_HWM = 10_000
"""Messages queued per incoming pipe before the sender's send awaits."""
LINGER_MS = 500
"""How long close() may flush unsent messages, milliseconds."""
RECHECK_MS = 100
"""Longest wait for a wake-up before a receiving socket is read again, milliseconds (see _recv_frames)."""


class ChannelOptions(msgspec.Struct, frozen=True, kw_only=True):
    """Socket options of a channel (defaults suit the request path)."""

    send_hwm: int = SEND_HWM
    recv_hwm: int = RECV_HWM
    linger_ms: int = LINGER_MS


def _configure(sock: zmq.asyncio.Socket, opts: ChannelOptions) -> None:
    sock.setsockopt(zmq.SNDHWM, opts.send_hwm)
    sock.setsockopt(zmq.RCVHWM, opts.recv_hwm)
    sock.setsockopt(zmq.LINGER, opts.linger_ms)
    if sock.type in (zmq.PUSH, zmq.DEALER, zmq.ROUTER):
        # Reconnects to a restarted peer are quick; a peer that never comes back is the supervisor's job.
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    if sock.type == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown identity is an error, not a silent drop


class _Channel:
    """One ZeroMQ socket, held twice: as zmq.asyncio's (awaiting) and as a plain socket over the same ZeroMQ socket
    (the no-wait path; the asyncio one owns the socket and closes it)."""

    sock: zmq.asyncio.Socket
    _plain_sock: zmq.Socket

    def _open(self, ctx: zmq.asyncio.Context, kind: int, opts: ChannelOptions, address: str, server: bool) -> None:
        """server: the socket binds `address` (else it connects there); auth.secure decides whether it authenticates."""
        self.sock = ctx.socket(kind)
        try:
            auth.secure(self.sock, address, server)
        except BaseException:
            self.sock.close(linger=0)
            raise
        self._plain_sock = zmq.Socket.shadow(self.sock.underlying)
        _configure(self.sock, opts)

    def close(self) -> None:
        self.sock.close()


class _Sending(_Channel):
    """Sends that go out at once when they can and otherwise wait, in order (see the module's docstring)."""

    _waiting: int = 0
    """Sends awaiting room at the peer: later sends queue behind them rather than overtake them."""

    def _send_now(self, frames: list[Any]) -> bool:
        """Send through the plain socket without waiting; False (nothing sent) when the peer's queue is full. Only
        while no send waits (self._waiting == 0): this one would overtake it."""
        try:
            self._plain_sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            return False

    async def _send_frames(self, frames: list[Any]) -> None:
        if not self._waiting and self._send_now(frames):
            return
        self._waiting += 1
        try:
            await self.sock.send_multipart(frames, copy=False)
        finally:
            self._waiting -= 1


class _Receiving(_Channel):
    """Typed decoding for a receiving socket: a malformed frame set is logged, counted and dropped."""

    address: str
    decoder: Decoder
    dropped: int = 0
    """Malformed or unexpected frame sets received and dropped."""

    async def _recv_frames(self) -> list[Any]:
        """The next frame set: taken at once if one has arrived, else awaited. (One reader per socket: an actor's
        receive loop.)

        The wait is bounded by RECHECK_MS, then the socket is read again: ZeroMQ's notification descriptor is
        edge-triggered, and the plain socket's reads can consume the edge zmq.asyncio waits for, which left a
        message sitting unread in an idle inbox (a StopCmd, the last StepPlan of a burst)."""
        while True:
            try:
                return self._plain_sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                await self.sock.poll(RECHECK_MS, zmq.POLLIN)

    def _decode(self, frames: Sequence[Any]) -> Message | None:
        try:
            return self.decoder.decode(frames)
        except DecodeError as e:
            self.dropped += 1
            log.warning("dropped a malformed message on %s (%d frames): %s", self.address, len(frames), e)
            return None


class Inbox(_Receiving):
    """An actor's PULL socket, bound at its address; yields typed messages, drops malformed ones."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, types: Sequence[type[Message]],
                 opts: ChannelOptions = ChannelOptions()) -> None:
        self.address = address
        self._open(ctx, zmq.PULL, opts, address, server=True)
        self.sock.bind(address)
        if address.startswith("tcp://") and address.endswith(":0"):
            self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.decoder = Decoder(types)

    async def recv(self) -> Message:
        """The next valid message; invalid frame sets are logged, counted and skipped."""
        while (msg := self._decode(await self._recv_frames())) is None:
            pass
        return msg


class Outbox(_Sending):
    """A PUSH socket connected to one peer's inbox."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, opts: ChannelOptions = ChannelOptions(),
                 connect: bool = True) -> None:
        """connect=False: the caller connects `sock` to `address` itself (e.g. after attaching a monitor)."""
        self.address = address
        self._open(ctx, zmq.PUSH, opts, address, server=False)
        if connect:
            self.sock.connect(address)
        self.encoder = Encoder()

    async def send(self, msg: Message) -> None:
        """Send one message; awaits (does not drop) while the peer's queue is full."""
        await self._send_frames(self.encoder.encode(msg))

    def send_at_once(self, msg: Message) -> list[Any] | None:
        """Send now if it can go without waiting (None); else nothing is sent and the encoded frames come back,
        for send_frames."""
        frames = self.encoder.encode(msg)
        return None if not self._waiting and self._send_now(frames) else frames

    async def send_frames(self, frames: list[Any]) -> None:
        """Send encoded frames (send_at_once's), waiting while the peer's queue is full."""
        await self._send_frames(frames)

    def send_nowait(self, msg: Message) -> bool:
        """Send if it can go without waiting; False (message not sent) when the peer's queue is full."""
        frames = self.encoder.encode(msg)
        if not self._waiting:
            return self._send_now(frames)
        # queued behind an earlier send that waits: it goes out, or fails, after that one (zmq.asyncio keeps the
        # order of its pending sends, and later sends queue behind this one until it is done)
        fut = self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        self._waiting += 1

        def done(f: Any) -> None:
            self._waiting -= 1
            _retrieve(f)

        fut.add_done_callback(done)
        return True


class Router(_Receiving, _Sending):
    """ROUTER socket (binds): sends to and receives from DEALERs addressed by their identity."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, types: Sequence[type[Message]],
                 opts: ChannelOptions = ChannelOptions()) -> None:
        self.address = address
        self._open(ctx, zmq.ROUTER, opts, address, server=True)
        self.sock.bind(address)
        self.encoder = Encoder()
        self.decoder = Decoder(types)

    async def send(self, identity: bytes, msg: Message) -> None:
        """Send to one DEALER; zmq.ZMQError(EHOSTUNREACH) if no peer has that identity."""
        await self._send_frames([identity, *self.encoder.encode(msg)])

    async def recv(self) -> tuple[bytes, Message]:
        """(identity, message); malformed frame sets are logged and skipped."""
        while True:
            frames = await self._recv_frames()
            if (msg := self._decode(frames[1:])) is not None:
                return frames[0].bytes, msg


class Dealer(_Receiving, _Sending):
    """DEALER socket (connects) with a fixed identity, e.g. a worker's rank."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, identity: bytes, types: Sequence[type[Message]],
                 opts: ChannelOptions = ChannelOptions()) -> None:
        self.address = address
        self._open(ctx, zmq.DEALER, opts, address, server=False)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(address)
        self.encoder = Encoder()
        self.decoder = Decoder(types)

    async def send(self, msg: Message) -> None:
        await self._send_frames(self.encoder.encode(msg))

    async def recv(self) -> Message:
        while (msg := self._decode(await self._recv_frames())) is None:
            pass
        return msg


def _retrieve(fut: Any) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("a best-effort send failed: %s", fut.exception())


def rank_identity(rank: int) -> bytes:
    """DEALER identity of a rank (ROUTER_MANDATORY makes a wrong rank an error)."""
    return f"rank-{rank}".encode()


def new_context() -> zmq.asyncio.Context:
    """A fresh asyncio zmq Context (one per process; inproc needs the shared one)."""
    return zmq.asyncio.Context()


def end_context(ctx: zmq.asyncio.Context) -> None:
    """Close whatever sockets of `ctx` are still open (each may flush for LINGER_MS) and terminate it. A plain
    term() waits forever for a socket nobody closes, e.g. one a late callback opened after its owner closed."""
    auth.release(ctx)
    ctx.destroy(linger=LINGER_MS)


def raw_push(ctx: zmq.asyncio.Context, address: str) -> Any:
    """A bare PUSH socket for tests and tools that must send frames the codec would never produce."""
    sock = ctx.socket(zmq.PUSH)
    auth.secure(sock, address, server=False)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.connect(address)
    return sock
