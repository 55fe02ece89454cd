"""Start `flotilla serve` as a real subprocess and stop it the way an operator would."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from flotilla.transport.endpoints import free_tcp_port


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def child_pids(self) -> list[int]:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait; returns the exit code (kills it if it does not stop)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def start_server(*args: str, timeout: float = 120.0, command: str = "serve") -> Server:
    """`flotilla serve ARGS --port <free>` (or another command that ends up serving, e.g. `launch` of a
    deployment file); returns once the ready line is logged (fails with the log if not)."""
    port = free_tcp_port()
    proc = subprocess.Popen([sys.executable, "-m", "flotilla", command, "--port", str(port), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    server = Server(proc, port)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in iter(proc.stderr.readline, ""):
            server.log.append(line)
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
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
    raise AssertionError("server did not become ready:\n" + "".join(server.log[-40:]))
