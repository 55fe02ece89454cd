"""Process checks for tests that start real processes."""

from __future__ import annotations

import time
from pathlib import Path


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (a zombie has exited; it only awaits reaping)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Wait until none of the pids is alive; returns the ones still alive at the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def describe_process(pid: int) -> str:
    """What a process that should be gone is doing: its command line, state, parent and kernel wait channel."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        status = {k: v.strip() for k, _, v in (line.partition(":") for line in
                                               Path(f"/proc/{pid}/status").read_text().splitlines())}
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError as e:
        return f"{pid}: {e}"
    return f"{pid} {cmd!r} state={status.get('State')} ppid={status.get('PPid')} " \
           f"sigcgt={status.get('SigCgt')} sigblk={status.get('SigBlk')} wchan={wchan}"


