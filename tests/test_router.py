"""The router's choices over a real (in-memory) registry."""

from __future__ import annotations

import collections

import pytest
import uvloop

from flotilla.server.fleet import RegistryView
from flotilla.server.router import NoEngineError, Router
from flotilla.transport.registry import EngineInfo, InMemoryRegistry


def info(engine_id: str, role: str, load: float = 0.0, model: str = "m") -> EngineInfo:
    return EngineInfo(engine_id=engine_id, role=role, model=model, addresses={}, kv_capacity_tokens=1, load=load)


def test_a_burst_spreads_over_equally_loaded_engines_and_prefers_the_least_loaded():
    async def main():
        reg = InMemoryRegistry()
        for e in (info("a", "both", 0), info("b", "both", 0), info("c", "both", 4), info("x", "both", 0, "other")):
            await reg.register(e)
        router = Router(reg, "m")
        picks = collections.Counter([(await router.pick()).engine_id for _ in range(13)])
        assert "x" not in picks and sum(picks.values()) == 13  # another model's engine never serves this one
        # a and b start at 0, c at 4: after the burst every engine's load is within one of the others'
        loads = {"a": picks["a"], "b": picks["b"], "c": 4 + picks["c"]}
        assert max(loads.values()) - min(loads.values()) <= 1 and picks["c"] >= 1, picks
        await reg.heartbeat("a", 0.0)  # a fresh report replaces what the router assumed
        assert router.effective_load((await reg.engines(model="m"))[0]) == 0.0
        for _ in range(3):
            router.finished("b")
        assert (await router.pick()).engine_id in ("a", "b")

    uvloop.run(main())


def test_pairs_prefer_dedicated_roles_and_fall_back_to_colocated_engines():
    async def main():
        reg = InMemoryRegistry()
        router = Router(reg, "m")
        with pytest.raises(NoEngineError, match="prefill"):
            await router.pick_pair()
        await reg.register(info("both1", "both", 1))
        await reg.register(info("d1", "decode", 5))
        prefill, decode = await router.pick_pair()
        assert (prefill.engine_id, decode.engine_id) == ("both1", "d1")
        await reg.register(info("p1", "prefill", 9))
        await reg.register(info("p2", "prefill", 2))
        prefill, decode = await router.pick_pair()
        assert (prefill.engine_id, decode.engine_id) == ("p2", "d1")
        with pytest.raises(NoEngineError, match="both"):
            await Router(reg, "other").pick()

    uvloop.run(main())


def test_the_view_gives_this_front_ends_own_engines_their_load_as_it_is_now():
    # the registry holds a load as old as the engine's last heartbeat (here: busy); the front end knows its own
    # engines' load now (idle again), another node's engine keeps the registry's, and a dead engine is left out
    async def main():
        reg = InMemoryRegistry()
        for e in (info("mine", "both", 10), info("theirs", "both", 3), info("dead", "both", 0)):
            await reg.register(e)
        view = RegistryView(reg, alive=lambda name: name != "dead", max_age_s=60,
                            local_load=lambda name: 0.0 if name == "mine" else None)
        assert {e.engine_id: e.load for e in await view.engines(model="m")} == {"mine": 0.0, "theirs": 3}
        router = Router(view, "m")
        assert [(await router.pick()).engine_id for _ in range(5)] == ["mine"] * 4 + ["theirs"]  # (ties: by id)

    uvloop.run(main())
