"""The multi-process launch script: ``flotilla launch TOPOLOGY.toml`` (or ``python scripts/launch.py``).

Starts every process of a topology (those placed on this host), waits for every ready handshake,
prints where each actor listens, then supervises: Ctrl-C or SIGTERM stops every actor gracefully; an
actor that dies or hangs tears the whole topology down and the launcher exits non-zero. No process is
left behind, also when a child dies at start or the launcher itself is killed (children die with it).

A file with an `engines` list is a served deployment instead (examples/topologies/pd-1p1d.toml): the
launcher becomes the OpenAI front end and router (`flotilla serve --engines ...`) in front of those
engines, each engine's actors in their own processes under their own supervisor, so one engine's death
is not the others'. `--model` and `--port` fill in or override the file's.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import uvloop

from flotilla.actors import ray_placement
from flotilla.actors.runtime import ActorFailure, Runtime
from flotilla.actors.topology import Topology, examples, load_topology, topology_path
from flotilla.server.cli import HelpFormatter
from flotilla.transport import auth

log = logging.getLogger("flotilla.launch")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("topology", help="topology file (TOML), or the name of a shipped example (" + examples() + ")")
    p.add_argument("--host", default=None,
                   help="start only the actors whose `host` is this (multi-host tcp topologies: run the launcher "
                        "once per host); default: every actor")
    p.add_argument("--external", action="append", default=[], metavar="NAME",
                   help="do not start actor NAME; wait for it to be started by hand with `flotilla actor NAME "
                        "--endpoints ...` (debug one actor against the live topology). Repeatable")
    p.add_argument("--trace", action="store_true", help="every actor prints every message in and out")
    p.add_argument("--model", default=None, help="deployment files only: the model folder (overrides the file's)")
    p.add_argument("--port", type=int, default=None, help="deployment files only: the HTTP port (overrides the file's)")
    p.add_argument("--ray-address", default=None, metavar="ADDRESS",
                   help="a topology of placement ray, or a deployment whose engines use distributed_executor_backend "
                        "ray: the Ray cluster to place the processes on (overrides the file's; default: the "
                        "RAY_ADDRESS of the environment, else a Ray instance started on this machine)")
    auth.add_auth_arguments(p)


class Deployment(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A served deployment: one front end (HTTP server + router) and the engines it routes requests to."""

    name: str = "flotilla"
    """Used in log lines."""
    engines: list[str]
    """One engine per entry, by role: prefill, decode, both (what `flotilla serve --engines` takes)."""
    model: str | None = None
    """HF model folder; `--model` overrides it; none = the embedded default model."""
    host: str = "127.0.0.1"
    """Address the HTTP server listens on."""
    port: int = 8000
    """HTTP port; `--port` overrides it."""
    registry: str = "memory"
    """Service registry: memory, or redis://HOST:PORT/DB (shared: front ends route to each other's engines)."""
    engine_host: str = "127.0.0.1"
    """With a redis:// registry: the address other nodes reach this node's engines and front end at."""
    node_name: str = ""
    """With a redis:// registry: this node's prefix of engine ids, unique among the front ends sharing it."""
    engine: dict[str, Any] = {}
    """Engine options for every engine, named like the `flotilla serve` flags with underscores (block_size = 16)."""


def load_deployment(path: str | Path) -> Deployment | None:
    """The deployment a file describes, or None when it is an actor topology."""
    path = topology_path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"topology file not found: {path} (shipped examples: {examples()})") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"invalid topology {path}: {e}") from None
    if "engines" not in data:
        return None
    try:
        return msgspec.convert(data, Deployment)
    except msgspec.ValidationError as e:
        raise ValueError(f"invalid deployment {path}: {e}") from None


def serve_argv(dep: Deployment, model: str | None, port: int | None, trace: bool) -> list[str]:
    """The `flotilla serve` command line that runs a deployment."""
    argv = [a for a in [model or dep.model] if a]
    argv += ["--host", dep.host, "--port", str(port or dep.port), "--engines", ",".join(dep.engines),
             "--registry", dep.registry, "--engine-host", dep.engine_host]
    argv += ["--node-name", dep.node_name] if dep.node_name else []
    for key, value in dep.engine.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv + (["--trace"] if trace else [])


def with_ray_address(argv: list[str], address: str | None) -> list[str]:
    """A deployment's serve command line with --ray-address set (the launcher's flag wins over the file)."""
    return argv if address is None else [*argv, "--ray-address", address]


def run_deployment(dep: Deployment, args: argparse.Namespace) -> int:
    from flotilla.server import serve
    from flotilla.server.cli import add_serve_arguments

    parser = argparse.ArgumentParser(prog=f"flotilla launch {args.topology}")
    add_serve_arguments(parser)
    log.info("deployment %r: a front end and engines %s", dep.name, ", ".join(dep.engines))
    argv = with_ray_address(serve_argv(dep, args.model, args.port, args.trace), args.ray_address)
    return serve.main(parser.parse_args(argv))


def with_externals(topo: Topology, names: list[str]) -> Topology:
    """The topology with the named actors marked external (started by hand)."""
    for n in names:
        topo.spec(n)  # a clear error for a name that is not there
    actors = [msgspec.structs.replace(a, external=True) if a.name in names else a for a in topo.actors]
    return msgspec.structs.replace(topo, actors=actors)


def print_table(rt: Runtime) -> None:
    rows = [("actor", "pid", "host", "address", "detail")]
    for k, ev in sorted(rt.ready.items()):
        detail = " ".join(f"{a}={b}" for a, b in ev.detail.items())
        rows.append((k, str(ev.pid), ev.host, ev.address, detail))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[4], flush=True)


async def launch(topo: Topology, host: str | None, trace: bool) -> int:
    rt = Runtime(topo, trace=trace, host=host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.ensure_future(rt.start())
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if starting not in done:
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await rt.stop("interrupted during start-up")
        return 130
    try:
        starting.result()
    except ActorFailure as e:
        print(f"flotilla launch: {e}; every actor stopped", file=sys.stderr, flush=True)
        return 1
    except auth.AuthError as e:
        print(f"flotilla launch: {e}", file=sys.stderr, flush=True)
        return 2
    except RuntimeError as e:  # (Ray placement: Ray missing, a cluster that cannot place the processes)
        print(f"flotilla launch: {e}", file=sys.stderr, flush=True)
        return 1
    if rt.primary:
        print(f"topology {topo.name!r} ready: {len(rt.ready)} actor(s)", flush=True)
        print_table(rt)
    else:
        print(f"started {len(rt.procs)} actor process(es) of topology {topo.name!r} on {host}; the launcher on "
              f"{topo.supervisor_host} supervises them", flush=True)
    if rt.run_dir is not None:
        print(f"endpoints: {rt.run_dir / 'endpoints.json'}", flush=True)
    ended = asyncio.ensure_future(rt.wait())
    done, _ = await asyncio.wait({ended, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if ended in done:
        ev = ended.result()
        if ev is None:  # another host's launcher stopped this host's actors
            await rt.stop("topology stopped")
            print("all actors stopped", flush=True)
            return 0
        print(f"flotilla launch: actor {ev.actor}/{ev.instance} failed: {ev.reason}; stopping every actor",
              file=sys.stderr, flush=True)
        await rt.stop(f"{ev.actor}/{ev.instance} failed")
        return 1
    ended.cancel()
    print("stopping (signal received)", flush=True)
    await rt.stop("launcher received a signal")
    print("all actors stopped", flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        deployment = load_deployment(args.topology)
    except ValueError as e:
        print(f"flotilla launch: {e}", file=sys.stderr)
        return 2
    if deployment is not None:
        if args.host or args.external:
            print("flotilla launch: --host and --external apply to actor topologies, not to a deployment",
                  file=sys.stderr)
            return 2
        return run_deployment(deployment, args)
    try:
        topo = with_externals(load_topology(args.topology), args.external)
        if args.ray_address is not None:
            topo = msgspec.structs.replace(topo, ray_address=args.ray_address)
    except (ValueError, KeyError) as e:
        print(f"flotilla launch: {e}", file=sys.stderr)
        return 2
    rc = uvloop.run(launch(topo, args.host, args.trace))
    ray_placement.exit_if_connected(rc)
    return rc


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="launch.py", description=__doc__,
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parser.parse_args()
    try:
        auth.configure(auth.settings_from_args(args))
    except auth.AuthError as e:
        sys.exit(f"launch.py: {e}")
    sys.exit(main(args))
