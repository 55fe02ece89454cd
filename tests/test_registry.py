"""The service registry: in memory (injected clock) and in a real redis-server (real TTLs)."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest
import uvloop

from flotilla.transport.endpoints import free_tcp_port
from flotilla.transport.registry import EngineInfo, Heartbeat, InMemoryRegistry, RedisRegistry
from helpers_optional import needs, optional, program, require

redis = optional("redis")  # with redis.asyncio and redis.exceptions
needs_redis = needs("redis", "the Redis registry's client")


def engine(engine_id: str, role: str = "both", load: float = 0.0, model: str = "m") -> EngineInfo:
    return EngineInfo(engine_id=engine_id, role=role, model=model, addresses={"tokenizer": f"tcp://h:{len(engine_id)}"},
                      kv_capacity_tokens=1000, load=load)


async def _semantics(reg, expire) -> None:
    """The contract both stores keep; `expire()` lets the entries' TTL run out."""
    await reg.register(engine("p1", "prefill", load=3))
    await reg.register(engine("p2", "prefill", load=1))
    await reg.register(engine("d1", "decode", load=2))
    await reg.register(engine("c1", "both", load=5, model="other"))
    await reg.register(engine("e1", "encoder", load=4))
    assert [e.engine_id for e in await reg.engines("prefill")] == ["p2", "p1", "c1"]  # least loaded first
    assert [e.engine_id for e in await reg.engines("encoder")] == ["e1"]  # a colocated engine is no encoder
    assert [e.engine_id for e in await reg.engines("decode", model="m")] == ["d1"]
    assert (await reg.engines(model="m"))[0].addresses == {"tokenizer": "tcp://h:2"}
    assert await reg.heartbeat("p1", 0.5)
    assert [e.engine_id for e in await reg.engines("prefill", model="m")] == ["p1", "p2"]
    await reg.deregister("p2")
    await reg.deregister("e1")
    assert [e.engine_id for e in await reg.engines("prefill", model="m")] == ["p1"]
    await expire()
    assert await reg.engines() == []  # nobody heartbeated: all evicted
    assert not await reg.heartbeat("p1", 0.0)  # an expired engine must register again
    await reg.register(engine("p1", "prefill"))
    assert [e.engine_id for e in await reg.engines()] == ["p1"]


def test_in_memory_registry_evicts_silent_engines():
    now = [100.0]
    reg = InMemoryRegistry(ttl_s=3.0, clock=lambda: now[0])

    async def expire():
        now[0] += 3.01

    uvloop.run(_semantics(reg, expire))


@pytest.fixture(scope="module")
def redis_url():
    require("redis", "the Redis registry's client")
    binary = program("redis-server", "the Redis registry's tests")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    port = free_tcp_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"

    async def ping():
        r = redis.asyncio.from_url(url)
        try:
            return await r.ping()
        finally:
            await r.aclose()

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if uvloop.run(ping()):
                break
        except (OSError, redis.exceptions.ConnectionError):
            time.sleep(0.05)  # not listening yet
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_redis_registry_keeps_the_same_contract_with_real_ttls(redis_url):
    async def main():
        reg = RedisRegistry(redis_url, ttl_s=0.3, prefix="t1")

        async def expire():
            await _until(lambda: _empty(reg))

        await _semantics(reg, expire)
        await reg.close()

    uvloop.run(main())


async def _empty(reg) -> bool:
    return not await reg.engines()


def test_a_dead_engine_is_evicted_within_three_heartbeats_and_a_live_one_comes_back(redis_url):
    async def main():
        reg = RedisRegistry(redis_url, ttl_s=0.3, prefix="t2")
        load = [7.0]
        live = Heartbeat(reg, engine("live", "decode"), lambda: load[0], interval_s=0.1)
        dead = Heartbeat(reg, engine("dead", "prefill"), lambda: 1.0, interval_s=0.1)
        await live.start()
        await dead.start()
        assert {e.engine_id for e in await reg.engines()} == {"live", "dead"}
        dead._task.cancel()  # the process dies: no deregistration, its heartbeats just stop
        # its entry outlives its last heartbeat by the TTL at most: Redis expires it (-2: gone already)
        left_ms = await reg._redis.pttl(reg._key("dead"))
        assert left_ms == -2 or 0 < left_ms <= reg.ttl_ms, left_ms
        await _until(lambda: _ids_are(reg, {"live"}))
        assert (await reg.engines())[0].load == 7.0  # heartbeats carry the load
        await reg._redis.delete(reg._key("live"))  # a partition long enough to expire the entry
        await _until(lambda: _ids_are(reg, {"live"}))  # its heartbeat registers it again
        await live.stop()
        assert await reg.engines() == []
        await reg.close()

    uvloop.run(main())


async def _ids_are(reg, ids: set[str]) -> bool:
    return {e.engine_id for e in await reg.engines()} == ids


@needs_redis
def test_a_registry_that_never_answers_fails_in_seconds_and_a_heartbeat_still_stops(monkeypatch):
    """A Redis that accepts connections and then says nothing (hung, or a half-open link): each command fails after
    REDIS_TIMEOUT_S instead of waiting forever, and Heartbeat.stop() returns (the entry is left to its TTL), so an
    engine's retirement and the front end's shutdown cannot hang on the registry."""
    from flotilla.transport import registry

    monkeypatch.setattr(registry, "REDIS_TIMEOUT_S", 0.5)

    async def main():
        conns = []
        server = await asyncio.start_server(lambda r, w: conns.append(w), "127.0.0.1", 0)  # says nothing
        port = server.sockets[0].getsockname()[1]
        reg = RedisRegistry(f"redis://127.0.0.1:{port}/0", ttl_s=3)
        # a client without the timeout would wait forever: asyncio's TimeoutError, at 20 s, instead of redis's
        with pytest.raises(redis.exceptions.TimeoutError):
            await asyncio.wait_for(reg.deregister("x"), 20)
        hb = Heartbeat(reg, engine("e"), lambda: 0.0, interval_s=0.1)
        await asyncio.wait_for(hb.stop(), 20)  # never started: only the deregistration, which times out and is logged
        for w in conns:
            w.close()
        server.close()
        await reg.close()

    uvloop.run(main())


class _FlakyRegistry(InMemoryRegistry):
    """An in-memory registry whose heartbeats fail `failures` times, then take `delay_s` each; it records whether a
    heartbeat was cancelled mid-command."""

    def __init__(self, failures: int = 0, delay_s: float = 0.0) -> None:
        super().__init__(ttl_s=60)
        self.failures, self.delay_s = failures, delay_s
        self.beats = self.cancelled = 0
        self.in_flight = asyncio.Event()

    async def heartbeat(self, engine_id: str, load: float) -> bool:
        self.in_flight.set()
        try:
            await asyncio.sleep(self.delay_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.failures:
            self.failures -= 1
            raise redis.exceptions.TimeoutError("Timeout reading from socket")
        self.beats += 1
        return await super().heartbeat(engine_id, load)


@needs_redis
def test_a_failed_heartbeat_is_logged_and_the_next_one_still_comes(caplog):
    """A registry slow past its timeout once must not end the engine's heartbeats (an exception that ended the
    heartbeat task would let the engine's entry expire while it serves)."""
    async def main():
        reg = _FlakyRegistry(failures=2)
        hb = Heartbeat(reg, engine("e"), lambda: 4.0, interval_s=0.02)
        await hb.start()
        await _until(lambda: _beats(reg, 2))
        assert not hb._task.done()
        assert (await reg.engines())[0].load == 4.0
        await hb.stop()
        assert await reg.engines() == []

    uvloop.run(main())
    assert sum("heartbeat of e failed (TimeoutError" in r.getMessage() for r in caplog.records) == 2


async def _beats(reg: _FlakyRegistry, n: int) -> bool:
    return reg.beats >= n


def test_stopping_lets_a_heartbeat_in_flight_finish_before_deregistering():
    """stop() during a heartbeat's command waits for it instead of cancelling it: redis-py's asyncio client cancelled
    mid-command can leave its connection out of step with its replies (redis-py #2624), and the deregistration
    behind it would hang, leaving a stopped engine's entry in Redis."""
    async def main():
        reg = _FlakyRegistry(delay_s=0.2)
        hb = Heartbeat(reg, engine("e"), lambda: 0.0, interval_s=0.01)
        await hb.start()
        await reg.in_flight.wait()
        await hb.stop()
        assert (reg.cancelled, reg.beats) == (0, 1)
        assert hb._task.done() and await reg.engines() == []

    uvloop.run(main())
