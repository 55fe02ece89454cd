"""RemoteEngine: an engine that another node's front end started, as this front end routes to it.

Front ends that share a registry (Redis) see each other's engines there, with the addresses of their actors. A
front end sends a request straight to such an engine's tokenizer, naming its own reply inbox in the request
(`GenerateRequest.reply_to`), so the engine's text and failures come back here, not to the front end that started
it. This object is the EngineClient counterpart the fleet uses for it: the same `_pending` queues, `to_tokenizer`,
`_dead`, and the addresses a disaggregated partner needs (its scheduler, its KV migration actors).

Liveness is the registry's: an engine that leaves it (missed heartbeats, or its front end retired it) is dead
here too, and its requests end with an EngineDeadError naming it (Fleet._watch_registry).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgspec
import zmq.asyncio

from flotilla.server.engine_client import EngineDeadError, Outcome, deltas
from flotilla.transport.channels import Outbox
from flotilla.transport.endpoints import Endpoints
from flotilla.transport.messages import AbortCmd, GenerateRequest, SeqText
from flotilla.transport.registry import EngineInfo


class RemoteEngine:
    """Send requests to another node's engine and hear its answers through this front end's reply inbox. Its addresses
    answer `of` and `instances` like a local engine's Endpoints."""

    def __init__(self, info: EngineInfo, zmq_ctx: zmq.asyncio.Context, reply_to: str) -> None:
        self.name, self.role, self.reply_to = info.engine_id, info.role, reply_to
        self.endpoints = Endpoints(supervisor="", actors=dict(info.addresses))
        self.to_tokenizer = Outbox(zmq_ctx, self.of("tokenizer"))
        self._pending: dict[str, asyncio.Queue] = {}
        self._dead: str | None = None

    def of(self, actor: str, instance: int = 0) -> str:
        """Where one of its actors listens (EngineDeadError, a 503, when it registered none)."""
        try:
            return self.endpoints.of(actor, instance)
        except KeyError as e:
            raise EngineDeadError(f"engine {self.name}: {e.args[0]}") from None

    def instances(self, actor: str) -> list[str]:
        """Addresses of every instance of one of its actors, in instance order."""
        return self.endpoints.instances(actor)

    @property
    def alive(self) -> bool:
        return self._dead is None

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    async def stream(self, req: GenerateRequest) -> AsyncIterator[SeqText]:
        """Submit one engine request (n == 1) and yield its deltas; closing early aborts it there."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        queue: asyncio.Queue = asyncio.Queue()
        outcome = Outcome()
        self._pending[req.rid] = queue
        try:
            # dp_rank -1: a data-parallel engine's own tokenizer spreads them (its ranks' loads are its front end's)
            await self.to_tokenizer.send(msgspec.structs.replace(req, reply_to=self.reply_to, dp_rank=-1))
            async for item in deltas(queue, outcome):
                yield item
        finally:
            self._pending.pop(req.rid, None)
            if not outcome.ended and self._dead is None:
                with contextlib.suppress(Exception):  # closing down: the request ends with the engine anyway
                    await self.to_tokenizer.send(AbortCmd(rid=req.rid, dp_rank=-1))

    def died(self, reason: str) -> None:
        """It left the registry: every request waiting on it ends with `reason`."""
        if self._dead is None:
            self._dead = reason
            for q in self._pending.values():
                q.put_nowait(reason)

    def close(self) -> None:
        self.to_tokenizer.close()
