"""Ray placement (topology placement "ray", `--distributed-executor-backend ray`): a topology's processes as Ray
actors, placed by a Ray cluster the operator already runs.

Ray does placement and lifecycle only. Each process of the topology (an actor instance, or a process group's
instance: a worker with its KV-migration and encoder actors) becomes one host actor in its own bundle of one
placement group (PACK by default: as few nodes as fit), with one GPU when its members include a GPU worker, so
Ray's CUDA_VISIBLE_DEVICES gives it that GPU alone. At start each host reports its node's address and free ports;
the runtime builds the topology's TCP address table from them (rendezvous addresses of tensor-parallel groups moved
to their first rank's node, the KV data plane to each host's own), and each host runs flotilla's actor loop
(actors/standalone.py `run_actor`) until it is stopped. The actors then talk over ZeroMQ and the data plane as in
any other placement: nothing goes through Ray per step.

A host actor that dies (its process, or its node) fails the topology as a dead process does (actors/runtime.py),
naming the actor and Ray's reason.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

import msgspec

from flotilla.actors.topology import ActorSpec, Topology
from flotilla.transport.endpoints import Endpoints, free_tcp_port, key

log = logging.getLogger(__name__)

RAY_HINT = "the ray backend needs Ray on every node: pip install 'flotilla[ray]'"
PLACEMENT_TIMEOUT_S = 120.0
"""How long the placement group may wait for its resources before the start fails, seconds."""
_RENDEZVOUS = ("dist_init_method", "ep_init_method")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
_CONNECT = threading.Lock()  # (a fleet's engines place themselves at once: one of them connects the driver)


def import_ray() -> Any:
    """The ray module, or the error that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise RuntimeError(f"{RAY_HINT} ({e})") from None
    return ray


def exit_if_connected(rc: int) -> None:
    """End this process now, with `rc`, if a placement connected it to a Ray cluster. Ray's own teardown (ray.shutdown,
    or its exit hook) can corrupt a driver's heap and crash it after a clean stop; the cluster frees what the driver
    held once its connection drops, and the actors' run folders are already removed by then."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def keep_signal_handlers() -> None:
    """Give SIGTERM and SIGINT back to this process's own handlers once it is connected to Ray (from the main thread;
    elsewhere a no-op). Ray's core puts abseil's failure handler in front of them, which arms a 3 s abort (SIGALRM)
    before it passes the signal on: a graceful stop longer than that ended in SIGABRT, or in a crash inside the
    handler. Setting the Python-level handler again (asyncio's, read from the loop's wakeup fd) puts Python's own C
    handler back."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        handler = signal.getsignal(sig)
        if handler is not None:
            signal.signal(sig, handler)


def ray_failure(e: BaseException) -> str:
    """Why a host actor's run ended in an error: what the run raised (a RayTaskError's cause), or how Ray lost the
    actor (killed, its process or node gone)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        return f"its Ray actor failed ({type(cause).__name__}: {cause})"
    reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"its Ray actor died ({type(e).__name__}: {reason})"


@dataclass
class HostPlan:
    """One Ray host actor: the actors it runs (a process group's instance) and what it was placed with."""

    names: list[str]
    instance: int
    gpus: int
    handle: Any = None
    ip: str = ""
    node: str = ""
    """The Ray node id it landed on."""
    ports: tuple[int, ...] = ()

    @property
    def keys(self) -> list[str]:
        return [key(n, self.instance) for n in self.names]


def _wants_gpu(spec: ActorSpec, cluster_gpus: float) -> bool:
    """A worker of an engine on a GPU (its device cuda..., or auto where the cluster has GPUs)."""
    if spec.kind != "worker":
        return False
    device = str(spec.config.get("engine", {}).get("worker", {}).get("device", "auto"))
    return device.startswith("cuda") or (device == "auto" and cluster_gpus > 0)


class RayHost:
    """The body of a Ray host actor (made a Ray actor class by `ray.remote` at placement)."""

    def node(self, num_ports: int) -> tuple[str, str, list[int]]:
        """This node's address as Ray knows it, its node id, and free TCP ports on it (below the ephemeral range,
        which any outgoing connection may take a port from before the actor binds it: free_tcp_port)."""
        import ray

        ip = ray.util.get_node_ip_address()
        ports: list[int] = []
        while len(ports) < num_ports:
            port = free_tcp_port(ip)
            if port not in ports:
                ports.append(port)
        return ip, ray.get_runtime_context().get_node_id(), ports

    def run(self, topology_json: str, endpoints_json: str, names: str, instance: int, gpu: bool, trace: bool,
            log_level: str, auth_mode: str, auth_key_file: str | None) -> int:
        """Run the actors until they are stopped; their exit code."""
        import ray

        from flotilla.actors.standalone import run_actor
        from flotilla.transport import auth

        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s")
        auth.configure(auth.AuthSettings(mode=auth_mode, key_file=auth_key_file))
        topo = msgspec.json.decode(topology_json, type=Topology)
        ip = ray.util.get_node_ip_address()
        actors = []
        for spec in topo.actors:
            config = dict(spec.config)
            engine = config.get("engine")
            if isinstance(engine, dict):
                disagg = engine.get("disagg", {})
                if disagg.get("kv_host", "127.0.0.1") in _LOOPBACK:  # the KV data plane serves on this node's address
                    engine = {**engine, "disagg": {**disagg, "kv_host": ip}}
                if gpu:  # Ray's CUDA_VISIBLE_DEVICES shows this host its one GPU
                    engine = {**engine, "worker": {**engine.get("worker", {}), "device": "cuda:0"}}
                config["engine"] = engine
            if gpu and spec.kind == "worker":
                config["per_rank_device"] = False
            actors.append(msgspec.structs.replace(spec, config=config))
        topo = msgspec.structs.replace(topo, actors=actors)
        return run_actor(topo, names, instance, endpoints=Endpoints.from_json(endpoints_json), trace=trace)


class RayPlacement:
    """The placement group and host actors of one topology."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.ray = import_ray()
        self.hosts: list[HostPlan] = []
        self.group = None
        self.driver_ip = ""

    def place(self) -> None:
        """Connect to the cluster, reserve a bundle per process and start an idle host actor in each (blocking:
        run it in a thread)."""
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        with _CONNECT:
            if not ray.is_initialized():
                ray.init(address=self.topo.ray_address, ignore_reinit_error=True, log_to_driver=True,
                         include_dashboard=False, configure_logging=False)
        cluster_gpus = ray.cluster_resources().get("GPU", 0.0)
        for members in self.topo.process_groups().values():
            for i in range(members[0].count):
                gpu = any(_wants_gpu(m, cluster_gpus) for m in members)
                self.hosts.append(HostPlan([m.name for m in members], i, 1 if gpu else 0))
        bundles = [{"CPU": 1.0, **({"GPU": float(h.gpus)} if h.gpus else {})} for h in self.hosts]
        self.group = placement_group(bundles, strategy=self.topo.ray_placement_strategy)
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"the Ray cluster could not place {len(bundles)} bundles ({bundles}) in "
                               f"{PLACEMENT_TIMEOUT_S:g} s: it lacks the CPUs or GPUs") from None
        host_class = ray.remote(RayHost)
        for b, h in enumerate(self.hosts):
            h.handle = host_class.options(
                num_cpus=1, num_gpus=h.gpus, max_concurrency=2, name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                                     placement_group_bundle_index=b)).remote()
        try:
            nodes = ray.get([h.handle.node.remote(len(h.names) + 2) for h in self.hosts])
        except ray.exceptions.RayError as e:  # (e.g. a node without flotilla: its host cannot import the class)
            lines = [line for line in str(e).splitlines() if "Error" in line]
            raise RuntimeError(f"the Ray host actors did not start: {lines[-1] if lines else type(e).__name__} "
                               "(flotilla and its dependencies must be installed on every node)") from None
        for h, (ip, node, ports) in zip(self.hosts, nodes, strict=True):
            h.ip, h.node, h.ports = ip, node, tuple(ports)
        self.driver_ip = ray.util.get_node_ip_address()
        by_node: dict[str, list[str]] = {}
        for h in self.hosts:
            by_node.setdefault(f"{h.node[:12]} ({h.ip})", []).extend(h.keys)
        log.info("%s placed by Ray (%s): %s", self.topo.name, self.topo.ray_placement_strategy,
                 "; ".join(f"node {n}: {' '.join(keys)}" for n, keys in by_node.items()))

    def endpoints(self, free_port) -> Endpoints:
        """The TCP address table: each actor at its host's node and ports; the supervisor and the clients here."""
        actors: dict[str, str] = {}
        for h in self.hosts:
            for k, port in zip(h.keys, h.ports, strict=False):
                actors[k] = f"tcp://{h.ip}:{port}"
        for c in self.topo.clients:
            actors[key(c, 0)] = f"tcp://{self.driver_ip}:{free_port(self.driver_ip)}"
        return Endpoints(supervisor=f"tcp://{self.driver_ip}:{free_port(self.driver_ip)}", actors=actors)

    def rendezvous(self) -> Topology:
        """The topology with each tensor- / expert-parallel rendezvous on its first rank's node (at a port free
        there), instead of the loopback address a one-host engine uses."""
        workers = {h.instance: h for h in self.hosts if "worker" in h.names}
        if not workers:
            return self.topo
        actors = []
        for spec in self.topo.actors:
            config = dict(spec.config)
            first = workers.get(0)
            if first is not None:
                for n, field in enumerate(_RENDEZVOUS):
                    if field in config:
                        config[field] = f"tcp://{first.ip}:{first.ports[-1 - n]}"
            if "dist_init_methods" in config:  # one TP group per data-parallel rank: its first worker's node
                tp = len(workers) // len(config["dist_init_methods"])
                config["dist_init_methods"] = [f"tcp://{workers[d * tp].ip}:{workers[d * tp].ports[-1]}"
                                               for d in range(len(config["dist_init_methods"]))]
            actors.append(msgspec.structs.replace(spec, config=config))
        return msgspec.structs.replace(self.topo, actors=actors)

    def start(self, topology_json: str, endpoints: Endpoints, trace: bool, log_level: str, auth_mode: str,
              auth_key_file: str | None) -> list[tuple[list[str], Any]]:
        """Run every host's actors; (their actor keys, the ObjectRef that resolves when they exit) per host."""
        out = []
        for h in self.hosts:
            ref = h.handle.run.remote(topology_json, endpoints.to_json(), ",".join(h.names), h.instance, h.gpus > 0,
                                      trace, log_level, auth_mode, auth_key_file)
            out.append((h.keys, ref))
        return out

    def stop(self) -> None:
        """Kill the host actors that are left and give the placement group back."""
        for h in self.hosts:
            if h.handle is not None:
                try:
                    self.ray.kill(h.handle)
                except Exception:  # noqa: BLE001 (already dead)
                    pass
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.group)
            except Exception:  # noqa: BLE001 (the cluster is gone)
                pass
            self.group = None

