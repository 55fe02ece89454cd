"""Run a topology: every actor in this process, or one process per actor, supervised.

The supervisor (in the process that calls ``Runtime.start``) owns one inbox that receives every
actor's ReadyEvent and HeartbeatEvent. It declares an actor failed when its process exits, its task
ends or raises, or it is silent for ``heartbeat_timeout_s``; a failure tears the whole tree down, so a
dead actor is never a silent hang. Children are spawned (never forked: torch and ZeroMQ do not survive
fork) as ``python -m flotilla actor NAME`` in their own session, and die with their parent through
PR_SET_PDEATHSIG, so no process outlives the runtime, also when the runtime itself is killed. Under Ray placement
(actors/ray_placement.py) each process is a Ray actor instead, and its death (or its node's) is the failure.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

import msgspec
import zmq.asyncio

from flotilla import envs
from flotilla.actors.base import Actor, ActorContext
from flotilla.actors.registry import actor_class
from flotilla.actors.topology import Topology, resolve
from flotilla.transport import auth
from flotilla.transport.channels import Inbox, Outbox, end_context, new_context
from flotilla.transport.endpoints import Endpoints, free_tcp_port, key, new_run_dir
from flotilla.transport.messages import ActorFailedEvent, HeartbeatEvent, ReadyEvent, StopCmd

log = logging.getLogger(__name__)


class ActorFailure(RuntimeError):
    """An actor died, hung, or never became ready; the topology was torn down."""

    def __init__(self, event: ActorFailedEvent) -> None:
        super().__init__(f"actor {key(event.actor, event.instance)} failed: {event.reason}")
        self.event = event


class Supervisor:
    """Tracks ready handshakes and heartbeats of every actor; reports the silent ones as failed."""

    def __init__(self, zmq_ctx: zmq.asyncio.Context, endpoints: Endpoints, expected: list[str],
                 heartbeat_timeout_s: float, failed: asyncio.Future[ActorFailedEvent],
                 fail: Callable[[str, str], None]) -> None:
        self.inbox = Inbox(zmq_ctx, endpoints.supervisor, (ReadyEvent, HeartbeatEvent, ActorFailedEvent))
        self.expected = list(expected)
        self.ready: dict[str, ReadyEvent] = {}
        self.last_seen: dict[str, float] = {}
        self.timeout = heartbeat_timeout_s
        self.failed = failed
        self.fail = fail
        """Report a failure (the runtime's: the first one wins)."""
        self._all_ready = asyncio.Event()
        self._tasks = [asyncio.create_task(self._receive(), name="supervisor-recv"),
                       asyncio.create_task(self._watch(), name="supervisor-watch")]

    async def wait_ready(self, timeout_s: float) -> dict[str, ReadyEvent]:
        """Every expected actor's ReadyEvent; ActorFailure if one fails or the timeout passes first."""
        waiter = asyncio.ensure_future(self._all_ready.wait())
        try:
            done, _ = await asyncio.wait({waiter, self.failed}, timeout=timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if self.failed.done():
            raise ActorFailure(self.failed.result())
        if not self._all_ready.is_set():
            missing = [k for k in self.expected if k not in self.ready]
            self.fail(missing[0], f"not ready after {timeout_s:.0f} s (also waiting for: {', '.join(missing[1:]) or '-'})")
            raise ActorFailure(self.failed.result())
        return dict(self.ready)

    async def _receive(self) -> None:
        while True:
            msg = await self.inbox.recv()
            k = key(msg.actor, msg.instance)
            if k not in self.expected:
                log.warning("supervisor: message from unknown actor %s ignored", k)
                continue
            if isinstance(msg, ActorFailedEvent):  # another host's launcher saw one of its actors fail
                self.fail(k, f"{msg.reason} (on another host)")
                continue
            self.last_seen[k] = time.monotonic()
            if isinstance(msg, ReadyEvent) and k not in self.ready:
                self.ready[k] = msg
                if len(self.ready) == len(self.expected):
                    self._all_ready.set()

    async def _watch(self) -> None:
        tick = min(self.timeout / 4, 1.0)
        while True:
            began = time.monotonic()
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - began > 2 * tick:
                # this process's own loop stalled (a blocking call): the heartbeats that came meanwhile are still
                # unread in the inbox, so the silence is ours; judge on the next tick, once they are read
                continue
            for k in self.ready:
                silent = now - self.last_seen[k]
                if silent > self.timeout:
                    self.fail(k, f"no heartbeat for {silent:.1f} s (hung or unreachable)")

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.inbox.close()


class Runtime:
    """Starts, supervises and stops one topology (or this host's share of it)."""

    def __init__(self, topo: Topology, *, trace: bool = False, host: str | None = None,
                 log_level: str | None = None) -> None:
        self.topo = topo
        self.trace = trace
        self.host = host
        """Start only the actors placed on this host (multi-host tcp topologies); None = all."""
        self.primary = host is None or host == topo.supervisor_host
        """The primary runtime supervises the whole topology; one on another host only starts and watches
        its own actors (their heartbeats go to the primary)."""
        self.log_level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.run_id = f"{topo.name}-{uuid.uuid4().hex[:8]}"
        self.run_dir: Path | None = None
        self.endpoints: Endpoints | None = None
        self.zmq: zmq.asyncio.Context | None = None
        self.supervisor: Supervisor | None = None
        self.ready: dict[str, ReadyEvent] = {}
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.actors: dict[str, Actor] = {}
        self.ray = None
        """Under Ray placement: the placement group and host actors (actors/ray_placement.py RayPlacement)."""
        self._ray_runs: dict[str, object] = {}  # first actor key of each Ray host -> the ObjectRef of its run
        self._tasks: dict[str, asyncio.Task] = {}
        self._stopping = False
        self._stop_task: asyncio.Future | None = None
        self.on_failure: list[Callable[[ActorFailedEvent], None]] = []
        self.failed: asyncio.Future[ActorFailedEvent] | None = None
        """Resolved with the first failure."""
        self.finished: asyncio.Event | None = None
        """Set when every actor of a non-primary runtime exited cleanly (the primary stopped them)."""

    @property
    def local_instances(self) -> list[tuple[str, int]]:
        """(name, instance) this runtime starts itself."""
        return [(s.name, i) for s, i in self.topo.instances()
                if not s.external and (self.host is None or s.host == self.host)]

    async def start(self) -> dict[str, ReadyEvent]:
        """Start every actor and wait for all ready handshakes; on any failure tear down and raise."""
        if self.topo.placement == "ray":
            return await self._start_ray()
        self.zmq = new_context()
        if self.topo.placement == "process":
            self.run_dir = new_run_dir()
        self.endpoints = resolve(self.topo, self.run_id, self.run_dir)
        for address in [self.endpoints.supervisor, *self.endpoints.actors.values()]:
            if auth.needs_auth(address):
                auth.require_key(address)  # before anything starts: the AuthError says how to give the key
        if self.run_dir is not None:
            (self.run_dir / "endpoints.json").write_text(self.endpoints.to_json())
            (self.run_dir / "topology.json").write_text(_topology_json(self.topo))
        for spec in self.topo.actors:
            if spec.external:
                where = f"--endpoints {self.run_dir / 'endpoints.json'}" if self.run_dir else ""
                print(f"waiting for external actor {spec.name!r}: start it with "
                      f"`flotilla actor {spec.name} --topology TOPOLOGY.toml {where}`", file=sys.stderr, flush=True)
        self.failed = asyncio.get_running_loop().create_future()
        self.failed.add_done_callback(self._notify_failure)
        self.finished = asyncio.Event()
        if self.primary:
            expected = [key(s.name, i) for s, i in self.topo.instances()]
            self.supervisor = Supervisor(self.zmq, self.endpoints, expected, self.topo.options.heartbeat_timeout_s,
                                         self.failed, self.fail)
        try:
            if self.topo.placement == "inline":
                for name, i in self.local_instances:
                    self._start_inline(name, i)
            else:
                local = set(self.local_instances)
                for members in self.topo.process_groups().values():
                    for i in range(members[0].count):
                        names = [m.name for m in members if (m.name, i) in local]
                        if names:
                            await self._spawn(names, i)
            if self.supervisor is not None:
                self.ready = await self.supervisor.wait_ready(self.topo.options.ready_timeout_s)
        except BaseException:
            await self.stop("start-up failed")
            raise
        return self.ready

    async def wait(self) -> ActorFailedEvent | None:
        """Block until an actor fails (returns the failure; the caller decides to stop), or, on a
        non-primary host, until all its actors exited cleanly (returns None)."""
        assert self.failed is not None and self.finished is not None
        finished = asyncio.ensure_future(self.finished.wait())
        try:
            await asyncio.wait({asyncio.shield(self.failed), finished}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            finished.cancel()
        return self.failed.result() if self.failed.done() else None

    def fail(self, actor_key: str, reason: str) -> None:
        """Record the first failure (later ones are consequences and only logged)."""
        assert self.failed is not None
        if self.failed.done():
            log.debug("after the first failure: %s %s", actor_key, reason)
            return
        name, _, inst = actor_key.rpartition("/")
        log.error("actor %s failed: %s", actor_key, reason)
        event = ActorFailedEvent(actor=name, instance=int(inst), reason=reason)
        self.failed.set_result(event)
        if not self.primary and self.endpoints is not None and self.zmq is not None:
            # the primary would only see this as silence after its heartbeat timeout: tell it the reason now
            out = Outbox(self.zmq, self.endpoints.supervisor)
            out.send_nowait(event)
            out.close()  # linger: it still goes out

    async def stop(self, reason: str = "stop requested") -> None:
        """StopCmd to every actor, then SIGTERM and SIGKILL for the ones that linger; idempotent. The teardown runs
        to its end even when the caller is cancelled (a later stop() waits for it), so nothing it holds is left."""
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop(reason))
        await asyncio.shield(self._stop_task)

    async def _stop(self, reason: str) -> None:
        self._stopping = True
        grace = self.topo.options.stop_grace_s
        if self.endpoints is not None and self.zmq is not None:
            # the primary stops every actor, hand-started and other hosts' ones too: the topology is going away
            targets = [(s.name, i) for s, i in self.topo.instances()] if self.primary else self.local_instances
            outs = [Outbox(self.zmq, self.endpoints.of(n, i)) for n, i in targets]
            for out in outs:
                out.send_nowait(StopCmd(reason=reason))
        if self.failed is not None and self.failed.done():
            # the failed actor is dead or hung: waiting out its grace period would only delay the teardown
            ev = self.failed.result()
            proc = self.procs.get(key(ev.actor, ev.instance))
            if proc is not None and proc.returncode is None:
                _kill_group(proc.pid, signal.SIGKILL)
        await self._reap_inline(grace)
        await self._reap_processes(grace)
        await self._reap_ray(grace)
        if self.endpoints is not None and self.zmq is not None:
            for out in outs:
                out.close()  # linger: a StopCmd to another host still goes out
        if self.supervisor is not None:
            await self.supervisor.close()
        if self.zmq is not None:
            end_context(self.zmq)
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    async def __aenter__(self) -> Runtime:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop("context exit")

    # ---- inline placement ------------------------------------------------------------------------

    def _start_inline(self, name: str, instance: int) -> None:
        k = key(name, instance)
        task = asyncio.create_task(self._serve_inline(name, instance), name=k)
        task.add_done_callback(lambda t, k=k: self._inline_done(k, t))
        self._tasks[k] = task

    async def _serve_inline(self, name: str, instance: int) -> None:
        # Constructed inside the task so a failing constructor is reported like any other actor failure.
        spec = self.topo.spec(name)
        ctx = ActorContext(name=name, instance=instance, endpoints=self.endpoints, config=spec.config,
                           options=self.topo.options, trace=self.trace)
        actor = self.actors[key(name, instance)] = actor_class(spec.kind)(ctx, self.zmq)
        await actor.serve()

    def _inline_done(self, k: str, task: asyncio.Task) -> None:
        if self._stopping:
            return
        if task.cancelled():
            self.fail(k, "task cancelled")
        elif task.exception() is not None:
            exc = task.exception()
            self.fail(k, f"{type(exc).__name__}: {exc}")
        else:
            self.fail(k, "stopped on its own")

    async def _reap_inline(self, grace: float) -> None:
        if not self._tasks:
            return
        _, pending = await asyncio.wait(self._tasks.values(), timeout=grace)
        for t in pending:
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    # ---- process placement -----------------------------------------------------------------------

    async def _spawn(self, names: list[str], instance: int) -> None:
        """One process for these actors' instance `instance` (several when they share a process group)."""
        assert self.run_dir is not None
        cmd = [sys.executable, "-m", "flotilla", "--log-level", self.log_level, "actor", ",".join(names),
               "--topology", str(self.run_dir / "topology.json"), "--endpoints", str(self.run_dir / "endpoints.json"),
               "--instance", str(instance), *auth.child_arguments()]
        if self.trace:
            cmd.append("--trace")
        # the child's stderr is our pipe, but with ours a terminal its progress bars end there
        env = {**os.environ, **envs.child_environment(progress=sys.stderr.isatty())}
        proc = await asyncio.create_subprocess_exec(*cmd, env=env, start_new_session=True,
                                                    stdin=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        keys = [key(n, instance) for n in names]
        for k in keys:
            self.procs[k] = proc
        asyncio.create_task(self._watch_process(keys[0], proc), name=f"watch-{keys[0]}")

    async def _watch_process(self, k: str, proc: asyncio.subprocess.Process) -> None:
        # The child's stderr passes through to ours; its last line explains a crash in the failure reason.
        last: list[str] = [""]
        relay = asyncio.create_task(_relay_stderr(proc, last))
        rc = await proc.wait()
        # a grandchild may hold the pipe open: do not let it delay the failure report
        await asyncio.wait({relay}, timeout=0.5)
        if self._stopping:
            return
        if rc == 0 and not self.primary:  # the primary stopped it
            if all(p.returncode is not None for p in self.procs.values()):  # (shared processes repeat)
                assert self.finished is not None
                self.finished.set()
            return
        how = f"killed by signal {-rc}" if rc < 0 else f"exited with code {rc}"
        self.fail(k, f"process {proc.pid} {how}" + (f": {last[0]}" if rc > 0 and last[0] else ""))

    async def _reap_processes(self, grace: float) -> None:
        live = {p.pid: p for p in self.procs.values() if p.returncode is None}  # one entry per process
        if not live:
            return
        for sig, wait_s in ((None, grace), (signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            if sig is not None:
                for p in live.values():
                    if p.returncode is None:
                        log.warning("actor process %d did not stop in time: %s", p.pid, sig.name)
                        _kill_group(p.pid, sig)
            _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in live.values()], timeout=wait_s)
            for t in pending:
                t.cancel()
            live = {k: p for k, p in live.items() if p.returncode is None}
            if not live:
                return

    # ---- Ray placement ---------------------------------------------------------------------------

    async def _start_ray(self) -> dict[str, ReadyEvent]:
        from flotilla.actors.ray_placement import RayPlacement, keep_signal_handlers

        self.zmq = new_context()
        self.failed = asyncio.get_running_loop().create_future()
        self.failed.add_done_callback(self._notify_failure)
        self.finished = asyncio.Event()
        try:
            self.ray = RayPlacement(self.topo)
            await asyncio.to_thread(self.ray.place)
            keep_signal_handlers()
            self.endpoints = self.ray.endpoints(free_tcp_port)
            for address in [self.endpoints.supervisor, *self.endpoints.actors.values()]:
                if auth.needs_auth(address):
                    auth.require_key(address)
            expected = [key(s.name, i) for s, i in self.topo.instances()]
            self.supervisor = Supervisor(self.zmq, self.endpoints, expected, self.topo.options.heartbeat_timeout_s,
                                         self.failed, self.fail)
            settings = auth.settings()
            for keys, ref in self.ray.start(_topology_json(self.ray.rendezvous()), self.endpoints, self.trace,
                                            self.log_level, settings.mode, settings.key_file):
                self._ray_runs[keys[0]] = ref
                asyncio.create_task(self._watch_ray(keys[0], ref), name=f"watch-{keys[0]}")
            self.ready = await self.supervisor.wait_ready(self.topo.options.ready_timeout_s)
        except BaseException:
            await self.stop("start-up failed")
            raise
        return self.ready

    async def _watch_ray(self, k: str, ref: object) -> None:
        """A Ray host's run ends: cleanly when stopped; otherwise its actors failed, or Ray lost it (or its node)."""
        try:
            rc = await ref  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 (RayActorError, WorkerCrashedError, a node that left, ...)
            if not self._stopping:
                from flotilla.actors.ray_placement import ray_failure

                self.fail(k, ray_failure(e))
            return
        if not self._stopping:
            self.fail(k, f"its Ray actor's actors exited (code {rc}) before they were stopped")

    async def _reap_ray(self, grace: float) -> None:
        """Wait for the Ray hosts' actors to stop, then kill the hosts and give the placement group back."""
        if self.ray is None:
            return
        if self._ray_runs:
            runs = [asyncio.ensure_future(self._settled(ref)) for ref in self._ray_runs.values()]
            await asyncio.wait(runs, timeout=grace)
            for r in runs:
                r.cancel()
        await asyncio.to_thread(self.ray.stop)

    @staticmethod
    async def _settled(ref: object) -> None:
        try:
            await ref  # type: ignore[misc]
        except Exception:  # noqa: BLE001 (its death is reported by _watch_ray)
            pass

    def _notify_failure(self, fut: asyncio.Future) -> None:
        if fut.cancelled():
            return
        for cb in self.on_failure:
            cb(fut.result())


async def _relay_stderr(proc: asyncio.subprocess.Process, last: list[str]) -> None:
    """Pass the child's stderr through as it comes (chunks, not lines: progress bars redraw with \\r)
    and remember its last non-empty line."""
    assert proc.stderr is not None
    tail = b""
    while chunk := await proc.stderr.read(65536):
        sys.stderr.buffer.write(chunk)
        sys.stderr.buffer.flush()
        tail = (tail + chunk)[-8192:]
        lines = [x for x in tail.replace(b"\r", b"\n").split(b"\n") if x.strip()]
        if lines:
            last[0] = lines[-1].decode(errors="replace").strip()


def _kill_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # the child leads its own session: take its helpers with it
    except ProcessLookupError:
        pass
    except PermissionError:
        os.kill(pid, sig)


def _topology_json(topo: Topology) -> str:
    return msgspec.json.encode(topo).decode()
