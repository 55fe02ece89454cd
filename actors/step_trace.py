"""A per-step timeline of the worker, for finding where an end-to-end run spends its time.

With `--step-trace /path/trace.jsonl` (WorkerConfig.step_trace) the worker (rank 0) appends one JSON line per step:
its number, sequences, tokens, whether it was a pure decode step, and three host clock readings (seconds,
time.perf_counter of that process): the plan arrived, its launch returned, its results were ready. Steps
whose plan arrived after the previous step's results (`gap_ms` > 0) left the device idle waiting for the
scheduler. Off (no file, no cost beyond one attribute check) when the option is unset.
"""

from __future__ import annotations

import json
import time

from flotilla.transport.messages import StepPlan


BATCH_BUCKETS = (192, 128, 64, 32, 16, 8, 4, 2, 1)


class StepTrace:
    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1 << 16)  # noqa: SIM115 (closed by close())
        self._open: dict[int, dict] = {}
        self._last_done = 0.0

    @classmethod
    def for_rank(cls, path: str | None, rank: int) -> StepTrace | None:
        """The trace rank 0 writes to `path` (WorkerConfig.step_trace); None: no trace."""
        return cls(path) if path and rank == 0 else None

    def arrived(self, plan: StepPlan) -> None:
        n = len(plan.rids)
        tokens = int(plan.num_new_tokens.sum()) if n else 0
        self._open[plan.step] = {"step": plan.step, "seqs": n, "tokens": tokens, "decode": n > 0 and tokens == n,
                                 "arrived": time.perf_counter()}

    def launched(self, step: int) -> None:
        if step in self._open:
            self._open[step]["launched"] = time.perf_counter()

    def done(self, step: int) -> None:
        row = self._open.pop(step, None)
        if row is None:
            return
        now = time.perf_counter()
        row.setdefault("launched", now)  # (a launch that raised: its failure is its result)
        row["done"] = now
        row["gap_ms"] = round(max(0.0, row["arrived"] - self._last_done) * 1000, 3) if self._last_done else 0.0
        self._last_done = now
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


def summarize(path: str) -> dict:
    """Where a traced run's time went: per kind of step (pure decode, or with prompt tokens), how many steps,
    their tokens, the wall time between consecutive results and the host time of their launches (plan arrived to
    launch returned: staging, and a structured step's masks); plus the time the worker waited for plans."""
    rows = [json.loads(line) for line in open(path)]
    done = {r["step"]: r["done"] for r in rows}

    def wall(r: dict) -> float:  # since the previous step's results (or, with none, since this plan arrived)
        return r["done"] - done.get(r["step"] - 1, r["arrived"])

    out: dict = {"steps": len(rows)}
    for kind, sel in (("decode", [r for r in rows if r["decode"]]),
                      ("prefill_or_mixed", [r for r in rows if not r["decode"]])):
        total = sum(map(wall, sel))
        launch = sum(r["launched"] - r["arrived"] for r in sel)  # (the runner's host time from plan to queued step)
        out[kind] = {"steps": len(sel), "tokens": sum(r["tokens"] for r in sel), "seqs": sum(r["seqs"] for r in sel),
                     "wall_s": round(total, 3), "ms_per_step": round(1000 * total / max(1, len(sel)), 3),
                     "launch_ms_per_step": round(1000 * launch / max(1, len(sel)), 3)}
    # decode steps by batch size (those after another step): where a draining batch (nano) spends its decode time
    by_batch: dict[int, list[float]] = {}
    for r in rows:
        if r["decode"] and r["step"] - 1 in done:
            by_batch.setdefault(next(b for b in BATCH_BUCKETS if r["seqs"] >= b), []).append(wall(r))
    out["decode_by_batch"] = {f">={lo}": {"steps": len(v), "wall_s": round(sum(v), 3),
                                          "ms_per_step": round(1000 * sum(v) / len(v), 3)}
                              for lo, v in sorted(by_batch.items(), reverse=True)}
    out["plan_wait_s"] = round(sum(r["gap_ms"] for r in rows) / 1000, 3)
    if rows:
        out["span_s"] = round(rows[-1]["done"] - rows[0]["arrived"], 3)
    return out


if __name__ == "__main__":
    import sys
    print(json.dumps(summarize(sys.argv[1])))
