"""Diagnostic actors: an echo and a relay, to check a topology's wiring and measure the transport.

``flotilla launch`` of a topology made of these (see examples/topologies/pingpong.toml) is the smallest
real deployment: a client sends PingRequest to a relay, which adds one to the payload and forwards it
to an echo, which answers the client directly. Tests and scripts/dev/bench_transport.py use them.
"""

from __future__ import annotations

import itertools
import time

from flotilla.actors.base import Actor, ActorContext
from flotilla.transport.messages import PingRequest, PongResult


class EchoActor(Actor):
    """Answers every PingRequest with a PongResult carrying the same payload. Config ``hang_on_stop_s``: when
    stopping, block the whole process that long (a stop that hangs, for the tests of what ends such a process)."""

    kind = "echo"
    inbox = (PingRequest,)

    async def teardown(self) -> None:
        time.sleep(float(self.ctx.config.get("hang_on_stop_s", 0)))

    async def on_ping_request(self, msg: PingRequest) -> None:
        if not msg.reply_to:
            raise ValueError(f"PingRequest {msg.seq} has no reply_to address")
        await self.send_to(msg.reply_to, PongResult(seq=msg.seq, sent_ns=msg.sent_ns, payload=msg.payload,
                                                     echoed_by=self.label))


class RelayActor(Actor):
    """Forwards PingRequests to the instances of its ``peer`` in turn, payload + 1 (proves it touched them)."""

    kind = "relay"
    inbox = (PingRequest,)

    def __init__(self, ctx: ActorContext, zmq_ctx) -> None:
        super().__init__(ctx, zmq_ctx)
        self.peer = str(ctx.config.get("peer", "echo"))
        targets = ctx.endpoints.instances(self.peer)
        if not targets:
            raise ValueError(f"relay {self.label}: the topology has no actor named {self.peer!r}")
        self._targets = itertools.cycle(targets)

    async def setup(self) -> dict[str, str]:
        return {"peer": self.peer}

    async def on_ping_request(self, msg: PingRequest) -> None:
        payload = None if msg.payload is None else msg.payload + 1
        await self.send_to(next(self._targets), PingRequest(seq=msg.seq, sent_ns=msg.sent_ns, payload=payload,
                                                            reply_to=msg.reply_to))
