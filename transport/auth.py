"""Who may talk to an actor: CURVE authentication of the control plane's tcp:// endpoints.

Every socket of a deployment that binds or connects an authenticated address uses one cluster key, a CURVE keypair
in a file that every host of the deployment holds (`flotilla keygen PATH` makes one): a bound socket is a CURVE
server with it, a connecting socket a CURVE client with it, and the context's ZAP handler accepts only clients that
present that same public key. A peer without the key, or with another one, never completes the handshake, so none
of its messages reaches an inbox; each refusal is logged, at most one line per peer (or endpoint) and reason every
REFUSAL_LOG_INTERVAL_S.

Which addresses (`--auth`): auto (the default) authenticates tcp:// addresses beyond loopback, on every tcp://
address, off none. ipc:// (a socket in a private run directory) and inproc:// are never authenticated. Both ends
decide from the same address string (the endpoints table every process shares), so they always agree.

The settings are process-wide: `configure` once at start (the `flotilla` command does, from its flags), and the
runtime hands them to the actor processes it spawns (`child_arguments`).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import queue
import stat
import threading
import time
from pathlib import Path
from typing import Literal

import msgspec
import zmq
import zmq.auth
import zmq.utils.z85
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

AuthMode = Literal["auto", "on", "off"]
MODES: tuple[AuthMode, ...] = ("auto", "on", "off")

REFUSAL_LOG_INTERVAL_S = 10.0
"""A refused peer keeps reconnecting (every RECONNECT_IVL): one log line per peer and reason this often, seconds."""
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's ZAP handler about each CURVE handshake (fixed by the ZAP spec, RFC 27)."""
_POLL_MS = 50
"""How long the auth thread waits before it looks for newly watched sockets, milliseconds."""
_FAILED_HANDSHAKE = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
"""The monitor events of a refused handshake (a ZAP refusal is logged by the ZAP handler, with the peer's address)."""


class AuthError(RuntimeError):
    """An address needs the cluster key and there is none, or the key file is unusable."""


class AuthSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How this process authenticates its control-plane sockets."""

    mode: AuthMode = "auto"
    """auto: tcp:// beyond loopback; on: every tcp://; off: none."""
    key_file: str | None = None
    """The cluster key file (absolute path), or None."""


class ClusterKey(msgspec.Struct, frozen=True):
    """The deployment's CURVE keypair, Z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes


_settings = AuthSettings()
_key: ClusterKey | None = None
_guards: dict[int, _Guard] = {}  # id of a zmq context's underlying handle -> its ZAP handler and watcher
_guards_lock = threading.Lock()
_warned_open: set[str] = set()


# ---- the key file ---------------------------------------------------------------------------------------------

_KEY_FILE = """\
#   flotilla cluster key (ZeroMQ CURVE certificate): every actor and front end of one deployment
#   authenticates with it. Keep it secret: copy it to each host with mode 0600, never into a shared folder.
metadata
curve
    public-key = "{public}"
    secret-key = "{secret}"
"""


def create_key_file(path: str | Path) -> ClusterKey:
    """Write a fresh cluster key to `path` (mode 0600); FileExistsError rather than replace an existing one."""
    public, secret = zmq.curve_keypair()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(_KEY_FILE.format(public=public.decode(), secret=secret.decode()))
    return ClusterKey(public, secret)


def load_key_file(path: str | Path) -> ClusterKey:
    """The cluster key in `path`; AuthError saying how to make one when it is missing or not a key."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        public, secret = zmq.auth.load_certificate(path)
    except FileNotFoundError:
        raise AuthError(f"no cluster key file at {path}: create one with `flotilla keygen {path}` and copy it to "
                        "every host of the deployment") from None
    except (OSError, ValueError) as e:
        raise AuthError(f"cannot read the cluster key file {path}: {e}") from None
    if not public or not secret:
        raise AuthError(f"{path} holds no CURVE secret key (make one with `flotilla keygen PATH`)")
    if zmq.curve_public(secret) != public:
        raise AuthError(f"{path}: its public key does not belong to its secret key")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("the cluster key file %s is readable by other users (chmod 600 it)", path)
    return ClusterKey(public, secret)


# ---- process-wide settings ------------------------------------------------------------------------------------

def configure(settings: AuthSettings) -> None:
    """Set this process's auth settings (loading the key file now, so a bad one fails at start)."""
    global _settings, _key
    key = load_key_file(settings.key_file) if settings.key_file and settings.mode != "off" else None
    _settings, _key = settings, key


def settings() -> AuthSettings:
    return _settings


def add_auth_arguments(p: argparse.ArgumentParser) -> None:
    """--auth and --auth-key-file, for every command that runs actors or front ends."""
    g = p.add_argument_group("control-plane authentication")
    g.add_argument("--auth", choices=MODES, default="auto",
                   help="which control-plane (ZeroMQ) endpoints require the cluster key: auto = tcp:// addresses "
                        "beyond loopback (multi-host topologies, --engine-host), on = every tcp:// address, off = "
                        "none (only on a network where every host that reaches these ports may submit, abort and "
                        "stop work); ipc:// and inproc:// never do")
    g.add_argument("--auth-key-file", default=None, metavar="PATH",
                   help="the cluster key (`flotilla keygen PATH` makes one; every host of the deployment needs the "
                        "same file); required when an endpoint needs authentication")


def settings_from_args(args: argparse.Namespace) -> AuthSettings:
    key_file = getattr(args, "auth_key_file", None)
    return AuthSettings(mode=getattr(args, "auth", "auto"),
                        key_file=str(Path(key_file).resolve()) if key_file else None)


def child_arguments() -> list[str]:
    """The `flotilla actor` flags that give a spawned actor this process's settings."""
    args = ["--auth", _settings.mode]
    if _settings.key_file:
        args += ["--auth-key-file", _settings.key_file]
    return args


def _loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may be reached from elsewhere


def needs_auth(address: str) -> bool:
    """Whether sockets at `address` authenticate, under this process's settings."""
    scheme, _, rest = address.partition("://")
    if scheme != "tcp" or _settings.mode == "off":
        return False
    return _settings.mode == "on" or not _loopback(rest.rpartition(":")[0])


def require_key(address: str) -> ClusterKey:
    """The cluster key, or the AuthError that tells the user how to give one."""
    if _key is None:
        where = "is reachable beyond this host, so it" if _settings.mode == "auto" else "(--auth on)"
        raise AuthError(f"{address} {where} only talks to peers holding the cluster key, and none was given: "
                        "create one with `flotilla keygen PATH`, copy it to every host of the "
                        "deployment and pass --auth-key-file PATH (or --auth off, on a network where anyone who "
                        "reaches the port may submit, abort and stop work)")
    return _key


# ---- sockets --------------------------------------------------------------------------------------------------

def secure(sock: zmq.Socket, address: str, server: bool) -> None:
    """Make `sock` authenticate at `address` when the settings say it must (call before bind / connect): a bound
    (server) socket accepts only peers with the cluster key and logs the ones it refuses; a connecting (client)
    socket presents the key."""
    if not needs_auth(address):
        if server and address.startswith("tcp://") and _settings.mode == "off" and address not in _warned_open:
            _warned_open.add(address)
            log.warning("%s accepts messages from any peer that reaches it (--auth off)", address)
        return
    key = require_key(address)
    if server:
        _guard(sock.context).watch(sock)
        sock.curve_secretkey = key.secret
        sock.curve_publickey = key.public
        sock.curve_server = True
    else:
        sock.curve_serverkey = key.public
        sock.curve_publickey = key.public
        sock.curve_secretkey = key.secret


def release(ctx: zmq.Context) -> None:
    """Forget a context's guard before the context ends (its thread ends with the context)."""
    with _guards_lock:
        _guards.pop(ctx.underlying, None)


def _guard(ctx: zmq.Context) -> _Guard:
    with _guards_lock:
        guard = _guards.get(ctx.underlying)
        if guard is None or not guard.alive:  # (a context terminated without end_context may have left one)
            assert _key is not None
            guard = _guards[ctx.underlying] = _Guard(ctx, _key)
        return guard


class _Limiter:
    """At most one line per key every `interval_s`, saying how many were held back."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def warn(self, key: tuple[str, str], text: str) -> None:
        now = time.monotonic()
        last, held = self._last.get(key, (-self.interval_s, 0))
        if now - last < self.interval_s:
            self._last[key] = (last, held + 1)
            return
        self._last[key] = (now, 0)
        more = f" ({held} more since the last line)" if held else ""
        log.warning("%s%s", text, more)


class _Guard:
    """One zmq context's ZAP handler (accepts the cluster key only) and watcher of its authenticated sockets'
    failed handshakes, on a thread of its own: a handshake must not wait for a busy event loop. The thread ends
    when the context is terminated (its sockets then get ETERM)."""

    def __init__(self, ctx: zmq.Context, key: ClusterKey) -> None:
        self._ctx = zmq.Context.shadow(ctx.underlying)
        self._public = zmq.utils.z85.decode(key.public)
        self._zap = self._ctx.socket(zmq.REP)
        self._zap.linger = 0
        self._zap.bind(ZAP_ENDPOINT)
        self._watch: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._count = 0
        self._limiter = _Limiter()
        self.alive = True
        """False once the context was terminated and the thread ended."""
        threading.Thread(target=self._run, name="flotilla-auth", daemon=True).start()

    def watch(self, sock: zmq.Socket) -> None:
        """Log `sock`'s failed handshakes (a peer without the key, or with another one)."""
        self._count += 1
        address = f"inproc://flotilla-auth-monitor-{id(self):x}-{self._count}"
        sock.monitor(address, _FAILED_HANDSHAKE)
        self._watch.put(address)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._zap, zmq.POLLIN)
        monitors: list[zmq.Socket] = []
        try:
            while True:
                while not self._watch.empty():
                    mon = self._ctx.socket(zmq.PAIR)
                    mon.linger = 0
                    mon.connect(self._watch.get())
                    monitors.append(mon)
                    poller.register(mon, zmq.POLLIN)
                for sock, _ in poller.poll(_POLL_MS):
                    if sock is self._zap:
                        self._answer(sock.recv_multipart())
                    else:
                        self._handshake_failed(parse_monitor_message(sock.recv_multipart()))
        except zmq.ContextTerminated:
            pass
        finally:
            self.alive = False
            for s in (self._zap, *monitors):
                s.close(linger=0)

    def _answer(self, frames: list[bytes]) -> None:
        version, request_id, _domain, address, _identity, mechanism, *credentials = frames
        ok = mechanism == b"CURVE" and credentials[:1] == [self._public]
        if not ok:
            peer = address.decode(errors="replace") or "?"
            self._limiter.warn((peer, "key"), f"refused a peer at {peer}: it presented another key than the "
                                              "cluster key")
        self._zap.send_multipart([version, request_id, b"200" if ok else b"400", b"OK" if ok else b"unknown key",
                                  b"", b""])

    def _handshake_failed(self, event: dict) -> None:
        endpoint = event["endpoint"].decode(errors="replace")
        value = event["value"]
        if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # the peer hung up first: a ZeroMQ peer without the key saw our CURVE greeting, or no ZeroMQ peer at all
            why = f"it broke the handshake off ({os.strerror(value)}): no key, or not a ZeroMQ peer"
        elif value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            why = "it sent no key (no CURVE)"
        elif value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            why = "its key is not the cluster key"
        else:
            why = f"its handshake failed (ZMTP error {value:#x})"
        self._limiter.warn((endpoint, why), f"refused a peer on {endpoint}: {why}")
