"""The router: which engine(s) serve the next request, from what the registry says about them.

Three decisions, all least-loaded-first:
  pick()         — one colocated engine (role "both") for plain data-parallel serving;
  pick_pair()    — a prefill engine and a decode engine for a disaggregated request (dedicated roles
                   preferred; a colocated engine stands in for a missing role);
  pick_encoder() — an encoder engine (a vision tower) for a request with images, when one is live.

Loads in the registry are as fresh as the engines' last heartbeat, so a burst of requests between two
heartbeats would all land on the same "least loaded" engine. The router therefore adds the requests it
assigned to an engine since that engine's last report to the reported load (SGLang's router does the
same kind of bookkeeping), and forgets them once the engine reports again.
"""

from __future__ import annotations

import time
from collections import defaultdict

from flotilla.transport.registry import EngineInfo, Registry, Role


class NoEngineError(RuntimeError):
    """No live engine can take the request (the front end answers 503)."""


class Router:
    """Engine selection over a registry, for one served model."""

    def __init__(self, registry: Registry, model: str) -> None:
        self.registry = registry
        self.model = model
        self._assigned: dict[str, list[float]] = defaultdict(list)  # engine id -> wall times of assignments

    async def pick(self) -> EngineInfo:
        """The least loaded colocated engine."""
        engines = [e for e in await self.registry.engines(model=self.model) if e.role == "both"]
        return self._take(engines, "both")

    async def pick_pair(self) -> tuple[EngineInfo, EngineInfo]:
        """(prefill engine, decode engine), each the least loaded of its role."""
        engines = await self.registry.engines(model=self.model)
        prefill = self._take(self._for(engines, "prefill"), "prefill")
        decode = self._take(self._for(engines, "decode", exclude=prefill.engine_id), "decode")
        return prefill, decode

    async def pick_encoder(self) -> EngineInfo | None:
        """The least loaded encoder engine; None when none is live (the engines encode images themselves)."""
        engines = await self.registry.engines(role="encoder", model=self.model)
        return self._take(engines, "encoder") if engines else None

    def finished(self, engine_id: str) -> None:
        """A request assigned to this engine ended before the engine reported again."""
        times = self._assigned.get(engine_id)
        if times:
            times.pop(0)

    def effective_load(self, info: EngineInfo) -> float:
        """The engine's reported load plus what this router sent it since that report."""
        times = self._assigned.get(info.engine_id)
        if not times:
            return info.load
        times[:] = [t for t in times if t > info.updated_at]  # the report already counts older ones
        return info.load + len(times)

    @staticmethod
    def _for(engines: list[EngineInfo], role: Role, exclude: str | None = None) -> list[EngineInfo]:
        dedicated = [e for e in engines if e.role == role and e.engine_id != exclude]
        return dedicated or [e for e in engines if e.role == "both" and e.engine_id != exclude]

    def _take(self, engines: list[EngineInfo], role: str) -> EngineInfo:
        if not engines:
            raise NoEngineError(f"no live {role} engine serves model {self.model!r}")
        # each assignment raises the engine's effective load, so a burst spreads over equal engines
        best = min(engines, key=lambda e: (self.effective_load(e), e.engine_id))
        self._assigned[best.engine_id].append(time.time())
        return best
