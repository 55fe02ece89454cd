"""CURVE authentication of tcp endpoints (transport/auth.py): real ZeroMQ sockets, real actor processes, loopback."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import stat
import subprocess
import sys
import threading
import time

import pytest
import uvloop
import zmq

from flotilla.transport import auth
from flotilla.transport.channels import Inbox, Outbox, end_context, new_context
from flotilla.transport.codec import Encoder
from flotilla.transport.endpoints import free_port_block, free_tcp_port
from flotilla.transport.messages import PingRequest, PongResult

REFUSALS = {"no key": "it sent no key|it broke the handshake off", "wrong server key": "its key is not the cluster key",
            "own client key": "presented another key than the cluster key"}
"""Each kind of peer without the cluster key, and the refusal it causes (a peer without a key sees the server's CURVE
greeting and may hang up before the server sees its NULL one)."""


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "cluster.key"
    auth.create_key_file(path)
    return path


@pytest.fixture
def auth_on(key_file):
    """This process authenticates every tcp address with the key (restored to the defaults afterwards)."""
    auth.configure(auth.AuthSettings(mode="on", key_file=str(key_file)))
    yield auth.load_key_file(key_file)
    auth.configure(auth.AuthSettings())


def keyless_peers(address: str, key: auth.ClusterKey) -> tuple[zmq.Context, dict[str, zmq.Socket]]:
    """PUSH sockets in a context of their own that do not hold the cluster key: none at all, a guessed server key,
    and the right server key with a client key of their own."""
    ctx = zmq.Context()
    peers = {name: ctx.socket(zmq.PUSH) for name in REFUSALS}
    own_public, own_secret = zmq.curve_keypair()
    for name, sock in peers.items():
        sock.linger = 0
        if name != "no key":
            sock.curve_serverkey = own_public if name == "wrong server key" else key.public
            sock.curve_publickey, sock.curve_secretkey = own_public, own_secret
        sock.connect(address)
    return ctx, peers


def test_needs_auth_by_mode_and_address():
    try:
        auth.configure(auth.AuthSettings(mode="auto"))
        assert auth.needs_auth("tcp://10.1.2.3:5000") and auth.needs_auth("tcp://node7:5000")
        assert not any(auth.needs_auth(a) for a in ("tcp://127.0.0.1:5000", "tcp://localhost:1", "tcp://[::1]:1",
                                                    "tcp://127.8.0.1:2", "ipc:///tmp/x", "inproc://x"))
        auth.configure(auth.AuthSettings(mode="on"))
        assert auth.needs_auth("tcp://127.0.0.1:5000") and not auth.needs_auth("ipc:///tmp/x")
        auth.configure(auth.AuthSettings(mode="off"))
        assert not auth.needs_auth("tcp://10.1.2.3:5000")
    finally:
        auth.configure(auth.AuthSettings())


def test_key_file_is_private_and_never_replaced(key_file):
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    key = auth.load_key_file(key_file)
    assert zmq.curve_public(key.secret) == key.public
    with pytest.raises(FileExistsError):
        auth.create_key_file(key_file)
    assert auth.load_key_file(key_file) == key
    with pytest.raises(auth.AuthError, match="flotilla keygen"):
        auth.load_key_file(key_file.parent / "missing.key")


def test_an_address_beyond_loopback_without_the_key_is_refused():
    auth.configure(auth.AuthSettings())
    ctx = new_context()
    try:
        with pytest.raises(auth.AuthError, match="--auth-key-file"):
            Inbox(ctx, "tcp://192.0.2.1:5000", (PingRequest,))  # refused before it binds
        with pytest.raises(auth.AuthError, match="flotilla keygen"):
            Outbox(ctx, "tcp://192.0.2.1:5000")
    finally:
        end_context(ctx)


def test_an_inbox_accepts_only_peers_with_the_cluster_key(auth_on, caplog):
    caplog.set_level(logging.WARNING, logger="flotilla.transport.auth")

    async def main() -> list[int]:
        ctx = new_context()
        inbox = Inbox(ctx, "tcp://127.0.0.1:0", (PingRequest,))
        bad_ctx, peers = keyless_peers(inbox.address, auth_on)
        good = Outbox(ctx, inbox.address)
        try:
            for seq, sock in enumerate(peers.values()):
                sock.send_multipart(Encoder().encode(PingRequest(seq=seq)))
            deadline = time.monotonic() + 10
            while not all(any(re.search(text, r.getMessage()) for r in caplog.records) for text in REFUSALS.values()):
                assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
                await asyncio.sleep(0.02)
            await good.send(PingRequest(seq=100))
            got = [(await asyncio.wait_for(inbox.recv(), 10)).seq]
            # a refused peer keeps retrying: give its message time to arrive, were it ever let in
            with pytest.raises(TimeoutError):
                got.append((await asyncio.wait_for(inbox.recv(), 0.5)).seq)
            return got
        finally:
            bad_ctx.destroy(linger=0)
            good.close()
            inbox.close()
            end_context(ctx)

    assert uvloop.run(main()) == [100]
    lines = [r.getMessage() for r in caplog.records]
    assert all("refused a peer" in line for line in lines), lines
    # each peer reconnects every ~50 ms; the log says so once per peer and reason, not once per attempt
    assert len(lines) <= len(REFUSALS) + 1, lines


class StderrLines:
    """Every line a process writes to stderr, read by one thread; `wait_for` a pattern with a deadline."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._new = threading.Condition()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in iter(proc.stderr.readline, ""):
            with self._new:
                self.lines.append(line)
                self._new.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        with self._new:
            while not (hits := [x for x in self.lines if re.search(pattern, x)]):
                left = deadline - time.monotonic()
                assert left > 0, f"never saw {pattern!r} on stderr:\n{''.join(self.lines)[-4000:]}"
                self._new.wait(left)
            return hits[0]


def launch(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flotilla", "launch", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_a_peer_without_the_key_cannot_get_a_message_accepted_by_a_tcp_bound_actor(tmp_path, key_file, auth_on):
    base = free_port_block(2)
    topo = tmp_path / "echo.toml"
    topo.write_text(f"""
name = "auth"
placement = "process"
transport = "tcp"
supervisor_port = {base}
[options]
heartbeat_interval_s = 0.1
[[actors]]
name = "echo"
kind = "echo"
port = {base + 1}
""")
    echo = f"tcp://127.0.0.1:{base + 1}"
    proc = launch(str(topo), "--auth", "on", "--auth-key-file", str(key_file))
    stderr = StderrLines(proc)
    try:
        stdout = ""
        for line in iter(proc.stdout.readline, ""):  # the launcher prints its table once every actor is ready
            stdout += line
            if line.startswith("echo/0 "):
                break
        assert "echo/0 " in stdout, f"{stdout}{''.join(stderr.lines)[-4000:]}"

        async def main() -> tuple[list[int], str]:
            ctx = new_context()
            me = f"tcp://127.0.0.1:{free_tcp_port()}"
            inbox = Inbox(ctx, me, (PongResult,))
            bad_ctx, peers = keyless_peers(echo, auth_on)
            good = Outbox(ctx, echo)
            try:
                for seq, sock in enumerate(peers.values()):
                    try:  # (a PUSH whose handshake was refused already has no pipe: a blocking send would wait forever)
                        sock.send_multipart(Encoder().encode(PingRequest(seq=seq, reply_to=me)), flags=zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # the refusal below is the handshake's, logged whether or not a message was queued
                errors = ""
                for text in REFUSALS.values():  # the actor's process logs each refusal (the launcher relays it)
                    errors += await asyncio.to_thread(stderr.wait_for, text, 15)
                await good.send(PingRequest(seq=100, reply_to=me))
                got = [(await asyncio.wait_for(inbox.recv(), 10)).seq]
                with pytest.raises(TimeoutError):
                    got.append((await asyncio.wait_for(inbox.recv(), 0.5)).seq)
                return got, errors
            finally:
                bad_ctx.destroy(linger=0)
                good.close()
                inbox.close()
                end_context(ctx)

        got, errors = uvloop.run(main())
        assert got == [100]
        assert f"refused a peer on {echo}" in errors, errors
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_launch_beyond_loopback_without_the_key_refuses_to_start(tmp_path):
    base = free_port_block(3)
    topo = tmp_path / "two.toml"
    topo.write_text(f"""
name = "two"
placement = "process"
transport = "tcp"
supervisor_port = {base}
[[actors]]
name = "relay"
kind = "relay"
port = {base + 1}
config = {{ peer = "echo" }}
[[actors]]
name = "echo"
kind = "echo"
host = "192.0.2.1"
port = {base + 2}
""")
    proc = launch(str(topo), "--host", "127.0.0.1")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2, err
    assert "flotilla keygen" in err and "--auth-key-file" in err and "Traceback" not in err, err
    proc = launch(str(topo), "--host", "127.0.0.1", "--auth-key-file", str(tmp_path / "missing.key"))
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "no cluster key file" in err, err
