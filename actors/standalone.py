"""One actor in the foreground: the body of ``flotilla actor NAME`` (and of every spawned child).

Three ways to run an actor alone:
  * as a child of a Runtime (``--endpoints`` of the run, supervisor included);
  * attached to a running topology by hand, for debugging: mark the actor ``external = true`` in the
    topology (or launch with ``--external NAME``), then run ``flotilla actor NAME --endpoints
    <run dir>/endpoints.json --trace``; the launcher waits for its ready handshake like any other;
  * against scripted peers (``--script FILE``): no topology is running; every peer address is bound
    by this tool and prints what it receives, and the script's messages (JSON lines, one
    ``{"type": "PingRequest", ...}`` per line) are fed to the actor's inbox in order.
"""

from __future__ import annotations

import asyncio
import ctypes
import faulthandler
import gc
import json
import logging
import math
import os
import signal
import sys
from pathlib import Path

import uvloop

from flotilla import envs
from flotilla.actors.base import Actor, ActorContext
from flotilla.actors.registry import actor_class
from flotilla.actors.topology import Topology, resolve
from flotilla.transport.channels import Inbox, Outbox, end_context, new_context
from flotilla.transport.codec import format_message, message_from_dict
from flotilla.transport.endpoints import Endpoints, key
from flotilla.transport.messages import ALL_MESSAGES, Message

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Have the kernel SIGTERM us when the runtime that spawned us dies (Linux), so no orphan survives: in a
    spawned actor a signal asks the actors to stop and arms an alarm (SIGALRM, whose default action ends the
    process) for stop_grace_s later, in case stopping hangs where no Python code runs (on a loaded machine it can
    block in a zmq call). getppid() cannot tell the death signal from another: it may still name
    the dying runtime when the signal is handled (the kernel hands the children to its last threads first)."""
    parent = envs.FLOTILLA_PARENT_PID
    if parent is None or not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before prctl took effect
        sys.exit(1)


def endpoints_for(topo: Topology, endpoints_file: Path | None) -> Endpoints:
    """The running topology's address table: its endpoints.json, or the topology itself when tcp ports are fixed."""
    if endpoints_file is not None:
        return Endpoints.from_json(endpoints_file.read_text())
    fixed = topo.scheme == "tcp" and topo.supervisor_port and all(a.port for a in topo.actors)
    if not fixed:
        raise ValueError("to attach to a running topology pass --endpoints <run dir>/endpoints.json "
                         "(printed by `flotilla launch`), or give every actor and the supervisor a fixed tcp port")
    return resolve(topo, topo.name)


def run_actor(topo: Topology, name: str, instance: int = 0, *, endpoints: Endpoints | None = None,
              trace: bool = False, script: Path | None = None, idle_s: float = 1.0) -> int:
    """Run an actor until it is stopped (or, with a script, until it falls idle); returns an exit code.

    `name` may list several actors ("worker,kv_migration"): they run in this one process, on one event
    loop, as the members of a process group do.
    """
    die_with_parent()
    names = name.split(",")
    if script is not None:
        if len(names) > 1:
            raise ValueError("--script drives one actor at a time")
        return uvloop.run(_run_scripted(topo, name, instance, actor_class(topo.spec(name).kind), script, idle_s,
                                        trace))
    assert endpoints is not None
    ctxs = [(actor_class(topo.spec(n).kind), ActorContext(name=n, instance=instance, endpoints=endpoints,
                                                          config=topo.spec(n).config, options=topo.options,
                                                          trace=trace)) for n in names]
    return uvloop.run(_run_attached(ctxs))


def dump_tasks_on_sigusr1(loop: asyncio.AbstractEventLoop) -> None:
    """`kill -USR1 PID` prints, after every thread's stack (faulthandler, flotilla/__main__.py), the stack of every
    task of `loop`: a process whose loop idles on an await that never resolves (a stop that hangs) says which."""
    def dump() -> None:
        for task in asyncio.all_tasks(loop):
            task.print_stack(file=sys.stderr)
        sys.stderr.flush()

    faulthandler.unregister(signal.SIGUSR1)  # (registered again after the loop's handler, which it then chains to)
    loop.add_signal_handler(signal.SIGUSR1, dump)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)


async def freeze_when_ready(actors: list[Actor]) -> None:
    """Once every actor of this process has set up, move what that built (a model, torch's and transformers'
    modules) out of the garbage collector's sight: a full collection in the process then takes milliseconds, not
    a tenth of a second in the middle of a step (as vLLM freezes its engine's heap after start)."""
    await asyncio.gather(*(a.ready.wait() for a in actors))
    gc.freeze()


async def _run_attached(ctxs: list[tuple[type[Actor], ActorContext]]) -> int:
    zctx = new_context()
    actors = [cls(ctx, zctx) for cls, ctx in ctxs]
    loop = asyncio.get_running_loop()
    grace = max(c.options.stop_grace_s for _, c in ctxs)
    spawned = envs.FLOTILLA_PARENT_PID is not None

    def on_signal(sig: signal.Signals) -> None:
        if spawned:  # the runtime may be dead (its death signal): if stopping hangs the kernel ends us
            signal.alarm(max(1, math.ceil(grace)))
        for a in actors:
            a.request_stop(f"signal {sig.name}")

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, on_signal, sig)
        except (RuntimeError, ValueError):  # not the main thread (a Ray actor's method): its host stops it
            break
    else:
        dump_tasks_on_sigusr1(loop)
    tasks = [asyncio.create_task(a.serve(), name=a.label) for a in actors]
    freezer = asyncio.create_task(freeze_when_ready(actors))
    try:
        # one failing actor fails the whole process (the supervisor then tears the topology down)
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = [t for t in done if t.exception() is not None]
        if failed:
            raise failed[0].exception()
        await asyncio.gather(*tasks)
    finally:
        for t in (*tasks, freezer):
            t.cancel()
        await asyncio.gather(*tasks, freezer, return_exceptions=True)
        end_context(zctx)
    return 0


async def _run_scripted(topo: Topology, name: str, instance: int, cls: type[Actor], script: Path,
                        idle_s: float, trace: bool) -> int:
    messages = _read_script(script)
    run_id = f"script-{os.getpid()}"
    table = resolve(Topology(name=topo.name, placement="inline", actors=topo.actors), run_id)
    endpoints = Endpoints(supervisor="", actors=table.actors)
    zctx = new_context()
    me = key(name, instance)
    sinks = [Inbox(zctx, addr, ALL_MESSAGES) for k, addr in endpoints.actors.items() if k != me]
    actor = cls(ActorContext(name=name, instance=instance, endpoints=endpoints, config=topo.spec(name).config,
                             options=topo.options, trace=trace), zctx)
    serving = asyncio.create_task(actor.serve())
    feeder = Outbox(zctx, endpoints.of(name, instance))
    for msg in messages:
        await feeder.send(msg)
    received = 0
    try:
        while True:
            recvs = {asyncio.ensure_future(s.recv()): s for s in sinks}
            if not recvs:
                await asyncio.sleep(idle_s)
                break
            done, pending = await asyncio.wait(recvs, timeout=idle_s, return_when=asyncio.FIRST_COMPLETED)
            for t in pending:
                t.cancel()
            if not done:
                break
            for t in done:
                received += 1
                print(f"{recvs[t].address} <- {format_message(t.result())}", flush=True)
    finally:
        actor.request_stop("script finished")
        await serving
        for s in sinks:
            s.close()
        feeder.close()
        end_context(zctx)
    log.info("script: sent %d messages, peers received %d", len(messages), received)
    return 0


def _read_script(path: Path) -> list[Message]:
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                out.append(message_from_dict(json.loads(line)))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{path}:{n}: {e}") from None
    return out
