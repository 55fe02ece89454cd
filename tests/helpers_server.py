"""Start `flotilla serve` as a real subprocess and stop it the way an operator would."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flotilla.transport.endpoints import free_tcp_port


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: list[str] = field(default_factory=list)
    pump: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def child_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait; returns the exit code. One that does not stop in time is asked for its threads' stacks
        (SIGUSR1: faulthandler, flotilla/__main__.py), it and its children are killed, and AssertionError carries
        the stacks and the end of its log (a hang in CI then says where)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            children = self.child_pids()
            for pid in [self.proc.pid, *children]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
            time.sleep(1.0)  # (the stacks arrive on the log's pipe)
            for pid in [self.proc.pid, *children]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"the server (pid {self.proc.pid}, children {children}) did not stop within "
                                 f"{timeout} s of SIGTERM; its stacks and log:\n" + "".join(self.log[-600:]))
        if self.pump is not None:
            self.pump.join(timeout=5)
        # pytest shows a test's captured stderr only when it fails: then the server's side of it is there too
        sys.stderr.write(f"---- the server's log (pid {self.proc.pid}, exit {code}), its last 300 lines ----\n"
                         + "".join(self.log[-300:]))
        return code


def start_server(*args: str, timeout: float = 120.0, command: str = "serve") -> Server:
    """`flotilla serve ARGS --port <free>` (or another command that ends up serving, e.g. `launch` of a
    deployment file); returns once the ready line is logged (fails with the log if not). A port that another process
    took between its pick and the bind (the server's, or one an actor was given) is picked again: a new start."""
    for _ in range(3):
        server = _start_server(free_tcp_port(), args, timeout, command)
        if server.proc.returncode is None:
            return server
        if not any(f"('127.0.0.1', {server.port}): address already in use" in line
                   or "ZMQError: Address already in use" in line for line in server.log):
            break
    raise AssertionError("server did not become ready:\n" + "".join(server.log[-40:]))


def _start_server(port: int, args: Sequence[str], timeout: float, command: str) -> Server:
    """The server, ready; or, when it did not become ready, killed (its returncode set)."""
    proc = subprocess.Popen([sys.executable, "-m", "flotilla", command, "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Server(proc, port)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in iter(proc.stderr.readline, ""):
            server.log.append(line)
            lines.put(line)

    pumping = server.pump = threading.Thread(target=pump, daemon=True)
    pumping.start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if re.search(r"flotilla ready: http://", line):
            return server
    proc.kill()
    proc.wait()
    pumping.join(timeout=10)  # the whole log, for the caller's message
    return server


def start_servers(*specs: tuple[Sequence[str], dict[str, Any]]) -> list[Server]:
    """start_server(*args, **kwargs) for each (args, kwargs), all at once (each start waits on its own process, so the
    suite spends one start-up, not several); if any fails, the ones that started are stopped and its error raised."""
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start_server, *args, **kwargs) for args, kwargs in specs]
    started, error = [], None
    for f in futures:
        try:
            started.append(f.result())
        except BaseException as e:  # noqa: BLE001 (re-raised below, after the others are stopped)
            error = error or e
    if error is not None:
        for server in started:
            server.stop()
        raise error
    return started


@contextlib.contextmanager
def cluster_key(path: Path) -> Iterator[Path]:
    """A new cluster key at `path`, configured for this process while the block runs: endpoints on an address beyond
    loopback (a Ray node's) authenticate, in this process and in the processes and Ray actors it starts."""
    from flotilla.transport import auth

    auth.create_key_file(path)
    saved = auth.settings()
    auth.configure(auth.AuthSettings(mode="auto", key_file=str(path)))
    try:
        yield path
    finally:
        auth.configure(saved)
