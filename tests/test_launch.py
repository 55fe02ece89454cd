"""`flotilla launch`, `flotilla actor` and the CLI's help, as a user runs them: real subprocesses."""

from __future__ import annotations

import asyncio
import json
import os
import re
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import uvloop

from flotilla.transport import auth
from flotilla.transport.channels import Inbox, Outbox, end_context, new_context
from flotilla.transport.endpoints import free_port_block, free_tcp_port
from flotilla.transport.messages import PingRequest, PongResult
from helpers_procs import alive, describe_process, wait_gone

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGY = """
name = "t"
placement = "process"
[options]
heartbeat_interval_s = 0.1
heartbeat_timeout_s = 3.0
stop_grace_s = 5.0
[[actors]]
name = "relay"
kind = "relay"
config = {{ peer = "{peer}" }}
[[actors]]
name = "echo"
kind = "echo"
count = 2
"""


def flotilla(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flotilla", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def read_until(proc: subprocess.Popen, pattern: str, timeout: float = 60.0, stream: str = "stdout") -> str:
    """Collect lines until one matches; fail with everything seen if it never does."""
    lines: queue.Queue[str] = queue.Queue()
    pipe = getattr(proc, stream)
    threading.Thread(target=lambda: [lines.put(x) for x in iter(pipe.readline, "")] and None, daemon=True).start()
    seen = ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            if proc.poll() is not None and lines.empty():
                break
            continue
        seen += line
        if re.search(pattern, line):
            return seen
    why = ""
    if proc.poll() is not None:  # it exited: say how, with its stderr (a launcher that failed says why there)
        why = f"\nthe process exited with {proc.returncode}"
        if stream == "stdout" and proc.stderr is not None:
            why += ":\n" + proc.stderr.read()[-4000:]
    raise AssertionError(f"never saw {pattern!r}; {stream} so far:\n{seen}{why}")


def pids_from_table(out: str) -> dict[str, int]:
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^(\w+/\d+)\s+(\d+)\s", out, re.M)}


@pytest.fixture
def topology(tmp_path):
    def make(peer: str = "echo") -> Path:
        path = tmp_path / "topo.toml"
        path.write_text(TOPOLOGY.format(peer=peer))
        return path
    return make


def test_launch_starts_every_actor_and_sigterm_stops_them_all(topology):
    proc = flotilla("launch", str(topology()))
    try:
        out = read_until(proc, r"^endpoints: ")
        pids = pids_from_table(out)
        assert set(pids) == {"relay/0", "echo/0", "echo/1"}
        assert all(alive(p) for p in pids.values())
        endpoints = json.loads(Path(out.strip().splitlines()[-1].split(": ", 1)[1]).read_text())
        assert set(endpoints["actors"]) == {"relay/0", "echo/0", "echo/1"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert not wait_gone(list(pids.values()))


def test_launch_exits_nonzero_and_leaves_nothing_when_a_child_dies_at_start(topology):
    proc = flotilla("launch", str(topology(peer="nobody")))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "relay/0 failed" in err and "nobody" in err
    assert "ready" not in out


def test_killing_the_launcher_takes_its_children_with_it(topology):
    proc = flotilla("launch", str(topology()))
    pids = pids_from_table(read_until(proc, r"^endpoints: "))
    proc.kill()
    proc.wait()
    left = wait_gone(list(pids.values()))
    assert not left, [describe_process(p) for p in left]


def test_an_orphan_whose_stop_hangs_is_ended_after_the_grace(tmp_path):
    # the launcher is killed, its child's stop hangs (blocked outside Python's reach): the alarm armed by the
    # death signal ends it after stop_grace_s, long before the hang would
    path = tmp_path / "hang.toml"
    path.write_text(TOPOLOGY.split("[[actors]]")[0].replace("stop_grace_s = 5.0", "stop_grace_s = 1.0")
                    + '[[actors]]\nname = "echo"\nkind = "echo"\nconfig = { hang_on_stop_s = 60 }\n')
    proc = flotilla("launch", str(path))
    pids = pids_from_table(read_until(proc, r"^endpoints: "))
    proc.kill()
    proc.wait()
    left = wait_gone(list(pids.values()), timeout=20)
    assert not left, [describe_process(p) for p in left]


def test_a_child_killed_later_tears_the_topology_down(topology):
    proc = flotilla("launch", str(topology()))
    pids = pids_from_table(read_until(proc, r"^endpoints: "))
    os.kill(pids["echo/0"], signal.SIGKILL)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 1 and "echo/0 failed" in err
    assert not wait_gone(list(pids.values()))


def test_one_actor_started_by_hand_joins_a_running_topology(topology):
    topo = topology()
    proc = flotilla("launch", str(topo), "--external", "echo")
    hand: list[subprocess.Popen] = []
    try:
        # the launcher waits for the hand-started echoes; it tells where the endpoints are
        line = read_until(proc, r"waiting for external actor 'echo'", timeout=30, stream="stderr")
        endpoints = re.search(r"--endpoints (\S+)`", line).group(1)
        hand = [flotilla("actor", "echo", "--topology", str(topo), "--endpoints", endpoints, "--instance", str(i),
                         "--trace") for i in range(2)]
        pids = pids_from_table(read_until(proc, r"^endpoints: "))
        assert pids["echo/0"] == hand[0].pid and pids["echo/1"] == hand[1].pid
        # SIGUSR1 (faulthandler, as in every flotilla process): its threads' stacks on stderr, and it runs on
        os.kill(hand[1].pid, signal.SIGUSR1)
        read_until(hand[1], r"most recent call first", timeout=30, stream="stderr")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        for h in hand:  # the launcher's StopCmd reaches hand-started actors too
            assert h.wait(timeout=15) == 0
    finally:
        proc.kill()
        for h in hand:
            h.kill()


def test_actor_against_scripted_peers_prints_traffic(tmp_path, topology):
    script = tmp_path / "msgs.jsonl"
    script.write_text('# ping the relay twice\n'
                      '{"type": "PingRequest", "seq": 1, "payload": [1, 2, 3], "reply_to": "inproc://nowhere"}\n'
                      '{"type": "PingRequest", "seq": 2}\n')
    proc = flotilla("actor", "relay", "--topology", str(topology()), "--script", str(script), "--trace",
                    "--idle", "0.5")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    # the echo instances are sinks here; they receive the relayed pings with payload + 1, in turn
    assert re.search(r"echo-?/?0 <- PingRequest\{\"seq\":1.*int32\[3\]\[2, 3, 4\]", out), out
    assert re.search(r"echo-?/?1 <- PingRequest\{\"seq\":2", out), out
    assert "relay/0 <- " in err and "relay/0 -> " in err  # --trace: every message in and out


def test_help_explains_every_command():
    for args in ([], ["actor"], ["launch"], ["bench"], ["serve"], ["generate"]):
        r = subprocess.run([sys.executable, "-m", "flotilla", *args, "--help"], capture_output=True, text=True)
        assert r.returncode == 0 and "usage: flotilla" in r.stdout, (args, r.stderr)
    top = subprocess.run([sys.executable, "-m", "flotilla", "--help"], capture_output=True, text=True).stdout
    assert all(c in top for c in ("serve", "generate", "actor", "launch", "bench"))
    actor = subprocess.run([sys.executable, "-m", "flotilla", "actor", "--help"], capture_output=True, text=True).stdout
    assert "--trace" in actor and "--script" in actor and "--endpoints" in actor
    r = subprocess.run([sys.executable, "-m", "flotilla", "launch", "/nonexistent.toml"], capture_output=True, text=True)
    assert r.returncode == 2 and "not found" in r.stderr


def two_host_topology(path: Path, heartbeat_timeout_s: float) -> tuple[Path, int, int]:
    """A relay on "127.0.0.1" and two echo instances on "localhost", the names standing for two hosts: each
    launcher starts only the actors placed on it. Returns (path, relay port, first echo port)."""
    base = free_port_block(4)  # supervisor, relay, echo/0, echo/1: none can be taken by an outgoing connection
    sup, relay, echo = base, base + 1, base + 2
    path.write_text(f"""
name = "two"
placement = "process"
transport = "tcp"
supervisor_host = "127.0.0.1"
supervisor_port = {sup}
[options]
heartbeat_interval_s = 0.1
heartbeat_timeout_s = {heartbeat_timeout_s}
[[actors]]
name = "relay"
kind = "relay"
host = "127.0.0.1"
port = {relay}
config = {{ peer = "echo" }}
[[actors]]
name = "echo"
kind = "echo"
count = 2
host = "localhost"
port = {echo}
""")
    return path, relay, echo


@pytest.mark.parametrize("authenticated", [False, True], ids=["loopback-open", "auth-on"])
def test_a_topology_over_two_hosts_runs_with_one_launcher_per_host(tmp_path, authenticated):
    # heartbeat timeout 20 s: on a loaded machine an echo actor of the second launcher can be silent for seconds
    # after it is ready; the test is about two launchers, not about how fast a loaded machine schedules a heartbeat
    topo, relay, _ = two_host_topology(tmp_path / "two-hosts.toml", heartbeat_timeout_s=20.0)
    flags: list[str] = []
    if authenticated:  # every tcp socket of both launchers, their actors and this client holds the cluster key
        key = tmp_path / "cluster.key"
        auth.create_key_file(key)
        flags = ["--auth", "on", "--auth-key-file", str(key)]
        auth.configure(auth.AuthSettings(mode="on", key_file=str(key)))
    primary = flotilla("launch", str(topo), "--host", "127.0.0.1", *flags)
    secondary = flotilla("launch", str(topo), "--host", "localhost", *flags)
    try:
        read_until(secondary, r"started 2 actor process")
        try:
            pids = pids_from_table(read_until(primary, r"^relay/0 "))
        except AssertionError as exc:  # say what the other host's launcher saw too
            secondary.kill()
            raise AssertionError(f"{exc}\nthe other launcher's stderr:\n{secondary.stderr.read()[-4000:]}") from None
        assert set(pids) == {"relay/0", "echo/0", "echo/1"}
        reply = uvloop_ping(f"tcp://127.0.0.1:{relay}")
        assert reply == [(0, [2, 3, 4], "echo/0"), (1, [2, 3, 4], "echo/1")]
        primary.send_signal(signal.SIGTERM)
        assert primary.wait(timeout=30) == 0
        assert secondary.wait(timeout=30) == 0  # its actors were stopped by the primary; it follows
    finally:
        primary.kill()
        secondary.kill()
        auth.configure(auth.AuthSettings())
    assert not wait_gone(list(pids.values()))


def test_an_actor_failing_on_another_host_stops_the_primary_with_its_reason(tmp_path):
    # echo/1's port is taken, so its process exits; the primary hears why from the other launcher instead of
    # waiting out a heartbeat timeout (600 s here: without the report the primary would still be waiting)
    topo, _, echo = two_host_topology(tmp_path / "two-hosts.toml", heartbeat_timeout_s=600.0)
    topo.write_text(topo.read_text().replace("[options]", "[options]\nready_timeout_s = 600.0"))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", echo + 1))
        taken.listen()
        primary = flotilla("launch", str(topo), "--host", "127.0.0.1")
        secondary = flotilla("launch", str(topo), "--host", "localhost")
        try:
            assert secondary.wait(timeout=60) == 1
            assert primary.wait(timeout=60) == 1
            err = primary.stderr.read()
        finally:
            primary.kill()
            secondary.kill()
    assert "actor echo/1 failed" in err and "on another host" in err, err
    assert "Address already in use" in err or "address in use" in err.lower(), err


def uvloop_ping(relay_address: str) -> list[tuple[int, list[int], str]]:
    """Two pings through the relay from a client outside the topology; the pongs, sorted."""

    async def main():
        ctx = new_context()
        me = f"tcp://127.0.0.1:{free_tcp_port()}"
        inbox, out = Inbox(ctx, me, (PongResult,)), Outbox(ctx, relay_address)
        for seq in range(2):
            await out.send(PingRequest(seq=seq, payload=np.array([1, 2, 3], np.int32), reply_to=me))
        got = [await asyncio.wait_for(inbox.recv(), 20) for _ in range(2)]
        inbox.close()
        out.close()
        end_context(ctx)
        return sorted((p.seq, p.payload.tolist(), p.echoed_by) for p in got)

    return uvloop.run(main())
