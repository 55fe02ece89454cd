"""Topology: which actors run, how many of each, where, and at which addresses.

A topology is small and declarative (a TOML file for ``flotilla launch``, or built in code):

    name = "pingpong"
    placement = "process"          # "inline": all in one process; "process": one process per instance;
                                   # "ray": one Ray actor per process, placed on a Ray cluster (actors/ray_placement.py)
    transport = "ipc"              # inline -> inproc; process -> "ipc" (one host) or "tcp" (several hosts)

    [[actors]]
    name = "relay"
    kind = "relay"                 # see actors/registry.py
    config = { peer = "echo" }

    [[actors]]
    name = "echo"
    kind = "echo"
    count = 2                      # instances echo/0 and echo/1
    host = "127.0.0.1"             # tcp only: where it runs and listens
    port = 5601                    # tcp only: instance i listens on port + i (0 = pick a free port)

``resolve`` turns it into the frozen ``Endpoints`` table every process shares.
"""

from __future__ import annotations

import socket
import tomllib
from pathlib import Path
from typing import Any, Literal

import msgspec

from flotilla.actors.base import RuntimeOptions
from flotilla.transport import endpoints as ep

Placement = Literal["inline", "process", "ray"]
Transport = Literal["inproc", "ipc", "tcp"]


class ActorSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One actor of the topology (``count`` identical instances)."""

    name: str
    """Name in the topology; peers address it by this name."""
    kind: str
    """Actor class, from actors/registry.py."""
    count: int = 1
    """Number of instances (name/0 .. name/count-1)."""
    host: str = "127.0.0.1"
    """Host it runs on and listens at (tcp); other hosts start it with ``flotilla launch --host``."""
    port: int = 0
    """First tcp port (instance i gets port + i); 0 picks free ports (one-host topologies only)."""
    external: bool = False
    """Started by hand (``flotilla actor``); the launcher only waits for its ready handshake."""
    process: str = ""
    """Process group: actors naming the same group share one OS process per instance index (e.g. a
    worker and an actor that must see its memory); empty = a process of its own."""
    config: dict[str, Any] = {}
    """Actor-specific settings."""

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"actor name must be non-empty and contain no '/': {self.name!r}")
        if self.count < 1:
            raise ValueError(f"actor {self.name}: count must be at least 1")


class Topology(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A declarative description of a deployment."""

    name: str = "flotilla"
    """Used in log lines and socket names."""
    placement: Placement = "process"
    """inline: every actor in this process; process: one OS process per actor instance; ray: one Ray actor per
    process, on a Ray cluster (tcp addresses from the nodes Ray picks)."""
    ray_address: str | None = None
    """placement ray: the cluster to join (ray.init's address; None: RAY_ADDRESS, else a local Ray instance)."""
    ray_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """placement ray: how the placement group spreads the processes' bundles over nodes."""
    transport: Transport | None = None
    """Address scheme; default inproc for inline, ipc for process (tcp when any host is not local)."""
    supervisor_host: str = "127.0.0.1"
    """Where the supervisor (the launcher) listens for ready handshakes and heartbeats (tcp)."""
    supervisor_port: int = 0
    """Its tcp port (0 = free port; fix it when actors run on other hosts)."""
    options: RuntimeOptions = RuntimeOptions()
    """Heartbeat and timeout settings."""
    actors: list[ActorSpec] = []
    """The actors."""
    clients: list[str] = []
    """Participants that are not actors but own an inbox (the HTTP front end, the offline LLM client)."""

    def __post_init__(self) -> None:
        names = [a.name for a in self.actors] + list(self.clients)
        dupes = {n for n in names if names.count(n) > 1}
        if dupes:
            raise ValueError(f"duplicate actor names in topology: {', '.join(sorted(dupes))}")
        if self.placement == "inline" and self.transport not in (None, "inproc"):
            raise ValueError("inline placement uses inproc:// addresses; drop `transport` or use placement=process")
        if self.placement == "process" and self.transport == "inproc":
            raise ValueError("inproc:// only works within one process; use placement=inline")
        if self.placement == "ray" and self.transport not in (None, "tcp"):
            raise ValueError("Ray places actors on any node: its placement uses tcp:// addresses")
        for group, members in self.process_groups().items():
            if len(members) > 1 and len({(m.count, m.host, m.external) for m in members}) > 1:
                raise ValueError(f"process group {group!r}: its actors need the same count, host and external flag")
        hosts = {a.host for a in self.actors}
        if len(hosts) > 1 and not (self.supervisor_port and all(a.port for a in self.actors)):
            # every host's launcher resolves the addresses on its own: they must come out the same
            raise ValueError(f"a topology over several hosts ({', '.join(sorted(hosts))}) needs fixed ports: "
                             "set supervisor_port and every actor's port")

    @property
    def scheme(self) -> Transport:
        if self.transport is not None:
            return self.transport
        if self.placement == "inline":
            return "inproc"
        if self.placement == "ray":
            return "tcp"
        return "tcp" if any(not _is_local(a.host) for a in self.actors) else "ipc"

    def spec(self, name: str) -> ActorSpec:
        for a in self.actors:
            if a.name == name:
                return a
        raise KeyError(f"no actor named {name!r} in topology {self.name!r} "
                       f"(actors: {', '.join(a.name for a in self.actors)})")

    def process_groups(self) -> dict[str, list[ActorSpec]]:
        """Actors by process group; an actor without a group is a group of one, keyed by its name."""
        groups: dict[str, list[ActorSpec]] = {}
        for a in self.actors:
            groups.setdefault(a.process or f"/{a.name}", []).append(a)
        return groups

    def instances(self) -> list[tuple[ActorSpec, int]]:
        """Every (spec, instance index) of the topology."""
        return [(a, i) for a in self.actors for i in range(a.count)]


EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "topologies"
"""The topology and deployment files shipped with the package (`flotilla launch pingpong` finds pingpong.toml)."""


def topology_path(path: str | Path) -> Path:
    """A file path as given, or, for a bare name that is no file, the shipped example of that name."""
    path = Path(path)
    if path.exists() or len(path.parts) != 1:
        return path
    example = EXAMPLES / (path.name if path.suffix else f"{path.name}.toml")
    return example if example.exists() else path


def load_topology(path: str | Path) -> Topology:
    """Read a TOML topology file (or a shipped example by name); a clear error naming the file on any problem."""
    path = topology_path(path)
    try:
        text = path.read_text()
        if path.suffix == ".json":
            return msgspec.json.decode(text, type=Topology)
        return msgspec.convert(tomllib.loads(text), Topology)
    except FileNotFoundError:
        raise ValueError(f"topology file not found: {path} (shipped examples: {examples()})") from None
    except (tomllib.TOMLDecodeError, msgspec.DecodeError, ValueError) as e:
        raise ValueError(f"invalid topology {path}: {e}") from None


def examples() -> str:
    """The shipped examples' names, for error messages and --help."""
    return ", ".join(sorted(p.stem for p in EXAMPLES.glob("*.toml")))


def resolve(topo: Topology, run_id: str, run_dir: Path | None = None) -> ep.Endpoints:
    """Give every actor instance and the supervisor an address."""
    scheme = topo.scheme
    actors: dict[str, str] = {}
    if scheme == "inproc":
        supervisor = ep.inproc(run_id, "supervisor")
        for spec, i in topo.instances():
            actors[ep.key(spec.name, i)] = ep.inproc(run_id, ep.key(spec.name, i))
        for c in topo.clients:
            actors[ep.key(c, 0)] = ep.inproc(run_id, ep.key(c, 0))
    elif scheme == "ipc":
        if run_dir is None:
            raise ValueError("ipc addresses need a run directory")
        supervisor = ep.ipc(run_dir, "supervisor")
        for spec, i in topo.instances():
            actors[ep.key(spec.name, i)] = ep.ipc(run_dir, f"{spec.name}-{i}")
        for c in topo.clients:
            actors[ep.key(c, 0)] = ep.ipc(run_dir, f"{c}-0")
    else:
        supervisor = ep.tcp(topo.supervisor_host, topo.supervisor_port or _free_port(topo.supervisor_host))
        for spec, i in topo.instances():
            if spec.port == 0 and not _is_local(spec.host):
                raise ValueError(f"actor {spec.name} on {spec.host}: set `port`; free ports are only picked locally")
            port = spec.port + i if spec.port else _free_port(spec.host)
            actors[ep.key(spec.name, i)] = ep.tcp(spec.host, port)
        for c in topo.clients:
            actors[ep.key(c, 0)] = ep.tcp(topo.supervisor_host, _free_port(topo.supervisor_host))
    return ep.Endpoints(supervisor=supervisor, actors=actors)


def _is_local(host: str) -> bool:
    """Whether `host` is this machine: a loopback or wildcard name, its hostname, or an address it can bind."""
    if host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", socket.gethostname()):
        return True
    try:
        ep.free_tcp_port(host)
    except OSError:
        return False
    return True


def _free_port(host: str) -> int:
    return ep.free_tcp_port("127.0.0.1" if host in ("0.0.0.0", "localhost") else host)
