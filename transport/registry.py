"""Service registry: which engines exist, what they serve, where they listen, how loaded they are.

Engines register themselves (role, model, addresses, KV capacity) and then heartbeat with their load;
an entry lives for `ttl_s` after its last heartbeat, so an engine that dies silently disappears within
`ttl_s` (three heartbeat intervals by default). The router reads the registry to pair prefill and decode
engines and to balance load. Two stores with one interface:

  InMemoryRegistry — one process or one node (the default); expiry against an injectable clock.
  RedisRegistry    — several nodes; each entry is a Redis key with a millisecond TTL (PX), refreshed by
                     every heartbeat, so expiry is Redis's own and needs no sweeper.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Literal, Protocol

import msgspec

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode", "both", "encoder"]

HEARTBEAT_INTERVAL_S = 1.0
"""Default heartbeat period, seconds."""
TTL_HEARTBEATS = 3
"""An entry survives this many missed heartbeats."""
REDIS_TIMEOUT_S = 5.0
"""How long one Redis command (or a connect) may take before it fails: a registry that stopped answering must not
hang a front end's heartbeats, an engine's retirement or its shutdown (redis-py waits forever by default)."""


def shared_registry(url: str | None) -> bool:
    """Whether a registry URL names one other nodes' front ends share (redis://...), not this process's memory."""
    return url not in (None, "", "memory")


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """One engine as the registry knows it."""

    engine_id: str
    """Unique engine name."""
    role: Role
    """prefill, decode, both (a colocated engine), or encoder (a vision tower for the others' prefills)."""
    model: str
    """Served model name."""
    addresses: dict[str, str]
    """Where its actors listen, by name (tokenizer, scheduler, kv data plane, ...)."""
    kv_capacity_tokens: int
    """KV cache capacity, tokens."""
    load: float = 0.0
    """Current load, the router's sort key (e.g. running + waiting sequences)."""
    updated_at: float = 0.0
    """Wall-clock time of the last registration or heartbeat, seconds since the epoch."""


class Registry(Protocol):
    """What engines and routers need from a registry."""

    async def register(self, info: EngineInfo) -> None: ...

    async def heartbeat(self, engine_id: str, load: float) -> bool:
        """Refresh an entry; False when it expired or never existed (the engine must register again)."""
        ...

    async def deregister(self, engine_id: str) -> None: ...

    async def engines(self, role: Role | None = None, model: str | None = None) -> list[EngineInfo]:
        """Live engines, least loaded first; role "prefill"/"decode" also matches "both"."""
        ...

    async def close(self) -> None: ...


def _matches(info: EngineInfo, role: Role | None, model: str | None) -> bool:
    return ((role is None or info.role == role or (info.role == "both" and role != "encoder"))
            and (model is None or info.model == model))


def _sorted(infos: list[EngineInfo]) -> list[EngineInfo]:
    return sorted(infos, key=lambda e: (e.load, e.engine_id))


class InMemoryRegistry:
    """A registry in this process's memory."""

    def __init__(self, ttl_s: float = HEARTBEAT_INTERVAL_S * TTL_HEARTBEATS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, tuple[EngineInfo, float]] = {}  # id -> (info, expires at)

    async def register(self, info: EngineInfo) -> None:
        self._entries[info.engine_id] = (msgspec.structs.replace(info, updated_at=time.time()),
                                         self._clock() + self.ttl_s)

    async def heartbeat(self, engine_id: str, load: float) -> bool:
        self._evict()
        entry = self._entries.get(engine_id)
        if entry is None:
            return False
        info = msgspec.structs.replace(entry[0], load=load, updated_at=time.time())
        self._entries[engine_id] = (info, self._clock() + self.ttl_s)
        return True

    async def deregister(self, engine_id: str) -> None:
        self._entries.pop(engine_id, None)

    async def engines(self, role: Role | None = None, model: str | None = None) -> list[EngineInfo]:
        self._evict()
        return _sorted([info for info, _ in self._entries.values() if _matches(info, role, model)])

    async def close(self) -> None:
        self._entries.clear()

    def _evict(self) -> None:
        now = self._clock()
        for engine_id in [k for k, (_, expires) in self._entries.items() if expires <= now]:
            log.warning("registry: engine %s missed its heartbeats; evicted", engine_id)
            del self._entries[engine_id]


class RedisRegistry:
    """A registry in Redis: key `<prefix>:engine:<id>` holds the JSON entry with a TTL."""

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", ttl_s: float = HEARTBEAT_INTERVAL_S * TTL_HEARTBEATS,
                 prefix: str = "flotilla") -> None:
        import redis.asyncio  # optional dependency (the `redis` extra): only multi-node deployments need it

        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.prefix = prefix
        self._redis = redis.asyncio.from_url(url, socket_timeout=REDIS_TIMEOUT_S,
                                             socket_connect_timeout=REDIS_TIMEOUT_S)
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder(EngineInfo)

    def _key(self, engine_id: str) -> str:
        return f"{self.prefix}:engine:{engine_id}"

    async def register(self, info: EngineInfo) -> None:
        info = msgspec.structs.replace(info, updated_at=time.time())
        await self._redis.set(self._key(info.engine_id), self._encoder.encode(info), px=self.ttl_ms)

    async def heartbeat(self, engine_id: str, load: float) -> bool:
        key = self._key(engine_id)
        raw = await self._redis.get(key)
        if raw is None:
            return False
        info = msgspec.structs.replace(self._decoder.decode(raw), load=load, updated_at=time.time())
        # XX: only if it still exists, so a heartbeat racing an expiry cannot resurrect a dead entry
        return bool(await self._redis.set(key, self._encoder.encode(info), px=self.ttl_ms, xx=True))

    async def deregister(self, engine_id: str) -> None:
        await self._redis.delete(self._key(engine_id))

    async def engines(self, role: Role | None = None, model: str | None = None) -> list[EngineInfo]:
        keys = [k async for k in self._redis.scan_iter(match=self._key("*"), count=512)]
        if not keys:
            return []
        infos = [self._decoder.decode(raw) for raw in await self._redis.mget(keys) if raw is not None]
        return _sorted([info for info in infos if _matches(info, role, model)])

    async def close(self) -> None:
        await self._redis.aclose()


class Heartbeat:
    """Keeps one engine registered: registers, then heartbeats with its current load every interval, and
    registers again if its entry expired (e.g. after a network partition). A heartbeat that fails (a registry slow
    past REDIS_TIMEOUT_S, a lost connection) is logged and the next one tried: the engine leaves the registry only
    when stopped, or when its process dies."""

    def __init__(self, registry: Registry, info: EngineInfo, load: Callable[[], float],
                 interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        self.registry, self.info, self.load, self.interval_s = registry, info, load, interval_s
        self._task: asyncio.Task | None = None
        self._stop = asyncio.Event()

    async def start(self) -> None:
        await self.registry.register(self.info)
        self._task = asyncio.create_task(self._run(), name=f"heartbeat-{self.info.engine_id}")

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), self.interval_s)
                return
            except TimeoutError:
                pass
            try:
                if not await self.registry.heartbeat(self.info.engine_id, self.load()):
                    log.warning("registry: %s had expired; registering again", self.info.engine_id)
                    await self.registry.register(msgspec.structs.replace(self.info, load=self.load()))
            except Exception as exc:  # the client's own errors, timeouts included (its sockets time out)
                log.warning("registry: heartbeat of %s failed (%s: %s); trying again in %.1f s", self.info.engine_id,
                            type(exc).__name__, exc, self.interval_s)

    async def stop(self) -> None:
        """Stop heartbeating and leave the registry. A heartbeat in flight is let finish, not cancelled: redis-py's
        asyncio client cancelled mid-command can leave its connection reading the wrong reply or none (redis-py
        #2624, #2028), which would hang the deregistration behind it. A registry that does not answer within
        REDIS_TIMEOUT_S is logged and left to expire the entry (the engine is gone from it within TTL_HEARTBEATS
        heartbeats)."""
        self._stop.set()
        if self._task is not None:
            _, pending = await asyncio.wait({self._task}, timeout=2 * REDIS_TIMEOUT_S + 1)
            if pending:  # (the client's socket timeouts end a command first; this is the last resort)
                self._task.cancel()
                await asyncio.gather(self._task, return_exceptions=True)
        try:
            await asyncio.wait_for(self.registry.deregister(self.info.engine_id), REDIS_TIMEOUT_S)
        except Exception as exc:  # (TimeoutError or the client's own error): the TTL removes the entry
            log.warning("registry: %s not deregistered (%s: %s); its entry expires within %d heartbeats",
                        self.info.engine_id, type(exc).__name__, exc, TTL_HEARTBEATS)
