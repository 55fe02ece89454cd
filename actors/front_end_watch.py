"""FrontEndWatch: whether the other nodes' front ends that requests named (`reply_to`) still listen.

An engine streams the text of a request another node's front end routed to it back to that front end. When that
front end dies, nobody reads the text any more and nobody tells the engine: its sequences would compute on to
max_tokens, holding their KV blocks. The watch reads the connection events of the engine's socket to each such
front end (ZeroMQ's socket monitor). A front end that has been disconnected for `grace_s`, or has not connected
within `connect_s` of its first request, is reported gone (`on_gone(address)`), and the detokenizer aborts its
sequences. One that connects again is watched as before; what was sent to it meanwhile (an aborted sequence's
last delta) is delivered then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

class FrontEndWatch:
    """One task per watched front end address, on the monitor of the socket that sends to it."""

    def __init__(self, on_gone: Callable[[str], Awaitable[None]], grace_s: float,
                 connect_s: float | None = None) -> None:
        """grace_s: how long a front end may be unreachable before it is reported gone (DisaggConfig.frontend_grace_s);
        connect_s: how long a front end may take to accept the first connection (default: the grace, at least
        5 s: a TCP connect takes far less, but the grace may be 0)."""
        self.on_gone, self.grace_s = on_gone, grace_s
        self.connect_s = max(grace_s, 5.0) if connect_s is None else connect_s
        self.gone: set[str] = set()
        """Front ends reported gone and not connected again since."""
        self._watches: dict[str, tuple[asyncio.Task, zmq.asyncio.Socket, zmq.asyncio.Socket]] = {}

    def watch(self, address: str, sock: zmq.asyncio.Socket) -> None:
        """Watch the front end at `address`, which `sock` (a PUSH socket, not yet connected: the monitor must see
        the connection happen) will send to; again is a no-op."""
        if address in self._watches:
            return
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        task = asyncio.create_task(self._run(address, monitor), name=f"front-end-watch-{address}")
        self._watches[address] = (task, sock, monitor)

    async def _run(self, address: str, monitor: zmq.asyncio.Socket) -> None:
        loop = asyncio.get_running_loop()
        deadline: float | None = loop.time() + self.connect_s  # None: connected (or already reported gone)
        while True:
            timeout = None if deadline is None else max(0.0, deadline - loop.time())
            try:
                event = parse_monitor_message(await asyncio.wait_for(monitor.recv_multipart(), timeout))["event"]
            except asyncio.TimeoutError:
                deadline = None
                self.gone.add(address)
                log.warning("the front end at %s is unreachable: aborting its sequences", address)
                await self.on_gone(address)
                continue
            if event == zmq.EVENT_CONNECTED:
                deadline = None
                if address in self.gone:
                    self.gone.discard(address)
                    log.info("the front end at %s is back", address)
            elif event == zmq.EVENT_DISCONNECTED and deadline is None and address not in self.gone:
                deadline = loop.time() + self.grace_s

    async def close(self) -> None:
        """Stop watching (before the sockets close)."""
        for task, sock, monitor in self._watches.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close(linger=0)
        self._watches.clear()
