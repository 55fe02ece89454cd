"""Addresses: where every actor instance of a topology listens, as ZeroMQ URLs.

Three schemes, one per placement: ``inproc://`` (all actors in one process, one zmq Context),
``ipc://`` (one process per actor on one host; a Unix socket under a short run directory) and
``tcp://`` (actors on several hosts). A resolved ``Endpoints`` table is frozen and travels to child
processes as JSON, so every process agrees on every address.
"""

from __future__ import annotations

import os
import random
import socket
import tempfile
from pathlib import Path

import msgspec

SCHEMES = ("inproc", "ipc", "tcp")
_IPC_MAX_PATH = 100  # Unix socket paths are limited to ~107 bytes


class Endpoints(msgspec.Struct, frozen=True, kw_only=True):
    """The frozen address table of one running topology."""

    supervisor: str
    """The supervisor's inbox: ready handshakes, heartbeats."""
    actors: dict[str, str]
    """Inbox address per actor instance, keyed ``name/instance`` (see ``key``)."""

    def of(self, name: str, instance: int = 0) -> str:
        """Address of one actor instance; a clear KeyError if the topology has none."""
        try:
            return self.actors[key(name, instance)]
        except KeyError:
            known = ", ".join(sorted(self.actors)) or "none"
            raise KeyError(f"no actor {key(name, instance)!r} in this topology (known: {known})") from None

    def instances(self, name: str) -> list[str]:
        """Addresses of every instance of an actor, in instance order."""
        found = sorted((int(k.rsplit("/", 1)[1]), a) for k, a in self.actors.items() if k.rsplit("/", 1)[0] == name)
        return [a for _, a in found]

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> Endpoints:
        return msgspec.json.decode(text, type=cls)


def key(name: str, instance: int) -> str:
    """The table key of one actor instance."""
    return f"{name}/{instance}"


def scheme_of(address: str) -> str:
    """``tcp`` for ``tcp://host:port`` etc.; ValueError for anything else."""
    scheme, sep, _ = address.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"not a ZeroMQ address (inproc://, ipc://, tcp://): {address!r}")
    return scheme


def inproc(run_id: str, name: str) -> str:
    return f"inproc://{run_id}/{name}"


def ipc(run_dir: Path, name: str) -> str:
    path = str(run_dir / name.replace("/", "-"))
    if len(path) > _IPC_MAX_PATH:
        raise ValueError(f"ipc socket path too long for Unix sockets ({len(path)} > {_IPC_MAX_PATH}): {path}")
    return f"ipc://{path}"


def tcp(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def new_run_dir() -> Path:
    """A short private directory for ipc sockets (short: socket paths have a length limit)."""
    base = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
    return Path(tempfile.mkdtemp(prefix="flotilla-", dir=base))


FIRST_FREE_PORT = 20000
"""Free ports are picked at or above this (clear of the common services' ports) and below the kernel's ephemeral
range: a port the OS hands out from that range may be taken by any outgoing connection (a ZeroMQ connect, an HTTP
client) in the moment between the check and the bind of the actor it was given to."""

_rng = random.Random()  # its own generator: a program that seeds `random` must not make two processes pick alike


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default (elsewhere the IANA range starts higher)


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now (tests and auto-assigned topologies)."""
    return free_port_block(1, host)


def free_port_block(n: int, host: str = "127.0.0.1") -> int:
    """The first of `n` consecutive ports that are free right now, below the ephemeral range (FIRST_FREE_PORT says
    why); where that range leaves no room, a port the OS picks (n == 1 only)."""
    high = _ephemeral_start()
    if high - n > FIRST_FREE_PORT:
        for _ in range(200):
            base = _rng.randrange(FIRST_FREE_PORT, high - n)
            try:
                for port in range(base, base + n):
                    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                        s.bind((host, port))
            except OSError:
                continue
            return base
    if n != 1:
        raise RuntimeError(f"no {n} consecutive free ports on {host} in [{FIRST_FREE_PORT}, {high})")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
