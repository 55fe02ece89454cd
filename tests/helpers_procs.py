"""Process checks for tests that start real processes."""

from __future__ import annotations

import time


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
