"""The whole GPU test suite (`pytest -m gpu`) on the GPU machine, in shards that fit a time budget per command.

On the GPU machine, from the checkout root (scripts/dev/gpu_suite.sh sets the bundle up first):

    python3 -m flotilla.scripts.dev.gpu_suite --cache-dir .gpu-suite --out "$OUT"

Each call collects the marked tests, groups them by file (a file's tests share one pytest process, so its module and
session fixtures compile their kernels once), and splits the files, in the order --order gives, into contiguous
shards of at most --shard-minutes, balanced by each test's duration in the last run that ran it. It restores the
JIT caches (FlashInfer, Triton, DeepGEMM) from --cache-dir, runs the shards that are still to run (--shard) one
pytest process each until --budget-s would be passed, then writes to --out: summary.md (passed / failed / skipped
with reasons per shard, the slowest tests, the totals; also printed), suite.json (the plan, every shard's results,
the durations), suite.log (pytest's output) and the caches as archives split into parts of at most
gpu_caches.PART_BYTES, each named by its content (a cache that did not change is not written again).

The next call continues the same run with the shards still to run, and once every shard has run, it begins a new
run (planned again from the durations). A shard cut by the budget goes on where it was cut: the next call runs its
tests that had not finished. The state and archives also stay in --cache-dir, so a next call on the same machine
needs nothing copied back; on another machine, copy what came back into --cache-dir first.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from flotilla.scripts.dev.gpu_caches import (
    PART_BYTES,
    archive_cache,
    jit_cache_dirs,
    prune,
    restore_caches,
    tree_digest,
)

STATE = "suite.json"
SUMMARY = "summary.md"
LOG = "suite.log"
DEFAULT_TEST_S = 5.0  # a test with no recorded duration (new, or never reached)
SLOWEST = 15
# pytest's outcome words in its -v lines, and what this script calls them
VERBOSE_OUTCOMES = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped",
                    "XFAIL": "xfailed", "XPASS": "passed"}
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "not run")


# ---------------------------------------------------------------------------------------------------------------
# planning


def file_of(nodeid: str) -> str:
    return nodeid.partition("::")[0]


def group_by_file(nodeids: list[str]) -> dict[str, list[str]]:
    """Test ids by file, files in the order they first appear (pytest's collection order)."""
    out: dict[str, list[str]] = {}
    for nodeid in nodeids:
        out.setdefault(file_of(nodeid), []).append(nodeid)
    return out


def parse_order(text: str) -> str:
    if text in ("file", "reverse") or re.fullmatch(r"shuffle:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected file, reverse or shuffle:SEED")


def order_files(files: list[str], order: str) -> list[str]:
    """The files in the run's order: as collected, reversed, or shuffled by a seeded generator."""
    if order == "file":
        return list(files)
    if order == "reverse":
        return list(reversed(files))
    out = list(files)
    random.Random(int(order.partition(":")[2])).shuffle(out)
    return out


def estimate_s(nodeids: list[str], durations: dict[str, float], default_s: float = DEFAULT_TEST_S) -> float:
    return sum(durations.get(n, default_s) for n in nodeids)


def plan_shards(files: list[str], weights: dict[str, float], bound_s: float) -> list[list[str]]:
    """Split the files, in their order, into the fewest contiguous shards of at most bound_s each (a file longer than
    that is a shard of its own), and among those splits the one whose longest shard is shortest."""
    if not files:
        return []
    w = [weights[f] for f in files]
    n = len(files)

    def cost(i: int, j: int) -> float:  # files[i:j] as one shard
        load = sum(w[i:j])
        return load if load <= bound_s or j - i == 1 else float("inf")

    # the fewest shards, greedily (optimal for contiguous parts)
    count, load, size = 1, 0.0, 0
    for x in w:
        if size and load + x > bound_s:
            count, load, size = count + 1, 0.0, 0
        load, size = load + x, size + 1
    # best[k][j]: the smallest longest shard splitting files[:j] into k shards; cut[k][j] where the last one starts
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    for k in range(1, count + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                value = max(best[k - 1][i], cost(i, j))
                if value <= best[k][j]:  # ties: the later cut (earlier shards fuller)
                    best[k][j], cut[k][j] = value, i
    shards, j = [], n
    for k in range(count, 0, -1):
        i = cut[k][j]
        shards.append(files[i:j])
        j = i
    return shards[::-1]


def tests_digest(nodeids: list[str]) -> str:
    return hashlib.sha256("\n".join(sorted(nodeids)).encode()).hexdigest()[:16]


def make_plan(nodeids: list[str], durations: dict[str, float], order: str, shard_minutes: float) -> dict:
    by_file = group_by_file(nodeids)
    files = order_files(list(by_file), order)
    weights = {f: estimate_s(by_file[f], durations) for f in files}
    shards = plan_shards(files, weights, shard_minutes * 60)
    return {"order": order, "shard_minutes": shard_minutes, "tests": tests_digest(nodeids), "made": _now(),
            "shards": shards, "estimate_s": [round(sum(weights[f] for f in s), 1) for s in shards],
            "tests_per_shard": [sum(len(by_file[f]) for f in s) for s in shards]}


def plan_fits(plan: dict | None, nodeids: list[str], order: str, shard_minutes: float) -> bool:
    return (plan is not None and plan["order"] == order and plan["shard_minutes"] == shard_minutes
            and plan["tests"] == tests_digest(nodeids))


def pending_shards(state: dict) -> list[int]:
    """The plan's shards that have no complete result in this run."""
    done = {int(k) for k, r in state.get("results", {}).items() if r.get("complete")}
    return [k for k in range(len(state["plan"]["shards"])) if k not in done]


def select_shards(spec: str, state: dict) -> list[int]:
    count = len(state["plan"]["shards"])
    if spec == "all":
        return list(range(count))
    if spec == "pending":
        return pending_shards(state)
    wanted = [int(x) for x in spec.split(",")]
    if any(not 0 <= k < count for k in wanted):
        raise SystemExit(f"--shard {spec}: the plan has shards 0-{count - 1}")
    return wanted


# ---------------------------------------------------------------------------------------------------------------
# results


@dataclass
class TestResult:
    outcome: str  # one of OUTCOMES
    seconds: float = 0.0
    message: str = ""


def junit_key(nodeid: str) -> tuple[str, str]:
    """The (classname, name) pytest's junitxml writes for a test id (its mangle_test_address)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def parse_junit(text: str, nodeids: list[str]) -> dict[str, TestResult]:
    """The results in a junit XML file pytest wrote, by test id (of those given); an entry without a name (the test
    that was running when pytest was interrupted) is left out."""
    by_key = {junit_key(n): n for n in nodeids}
    out = {}
    for case in ET.fromstring(text).iter("testcase"):
        nodeid = by_key.get((case.get("classname", ""), case.get("name", "")))
        if nodeid is None:
            continue
        seconds = float(case.get("time") or 0.0)
        tags = {child.tag: child for child in case}
        if "failure" in tags:
            result = TestResult("failed", seconds, tags["failure"].get("message", ""))
        elif "error" in tags:
            result = TestResult("error", seconds, tags["error"].get("message", ""))
        elif "skipped" in tags:
            skipped = tags["skipped"]
            kind = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
            result = TestResult(kind, seconds, skipped.get("message", ""))
        else:
            result = TestResult("passed", seconds)
        out[nodeid] = result
    return out


def parse_verbose_log(text: str, nodeids: list[str]) -> tuple[dict[str, TestResult], str | None]:
    """What pytest -v printed as each test ended (when it was killed before it wrote its junit file), and the test it
    had begun last without an outcome (the one the kill cut)."""
    known = set(nodeids)
    out: dict[str, TestResult] = {}
    running = None
    for line in text.splitlines():
        nodeid, _, rest = line.partition(" ")
        while nodeid not in known and rest:  # test ids can hold spaces (parameters)
            more, _, rest = rest.partition(" ")
            nodeid = f"{nodeid} {more}"
        if nodeid not in known:
            continue
        word = rest.split()[0] if rest.split() else ""
        if word in VERBOSE_OUTCOMES:
            if nodeid not in out or word in ("FAILED", "ERROR"):  # a teardown's ERROR follows the call's PASSED
                out[nodeid] = TestResult(VERBOSE_OUTCOMES[word])
            running = None if running == nodeid else running
        else:
            running = nodeid
    return out, (running if running not in out else None)


def shard_record(nodeids: list[str], results: dict[str, TestResult], wall_s: float, exit_code: int | None,
                 cut: bool, running: str | None, log_tail: str) -> dict:
    tests = {}
    for n in nodeids:
        r = results.get(n)
        if r is None:
            r = TestResult("not run", 0.0, "cut at the budget" if cut else "pytest did not report it")
            if n == running:
                r.message = "running when the budget ran out"
        tests[n] = [r.outcome, round(r.seconds, 2), r.message[:500]]
    # a shard is complete when pytest ended on its own, or when every test reported before the budget cut it (the
    # process may outlive its last test: teardown, exit)
    complete = (not cut and exit_code in (0, 1)) or all(t[0] != "not run" for t in tests.values())
    return {"ran": _now(), "wall_s": round(wall_s, 1), "exit": exit_code, "cut": cut, "complete": complete,
            "tests": tests, "log_tail": "" if complete else log_tail[-3000:]}


def resumed_results(record: dict | None, nodeids: list[str]) -> dict[str, TestResult]:
    """The results a shard cut by the budget already has (its tests that ran before the cut): the next call runs only
    the rest of it, not the whole shard again."""
    if not record or record.get("complete") or not record.get("cut"):
        return {}
    return {n: TestResult(*record["tests"][n]) for n in nodeids
            if n in record["tests"] and record["tests"][n][0] != "not run"}


def merge_durations(durations: dict[str, float], record: dict) -> dict[str, float]:
    """The durations with this shard's tests that ran replacing theirs (a test not reached keeps its last one)."""
    out = dict(durations)
    for nodeid, (outcome, seconds, _) in record["tests"].items():
        if outcome != "not run":
            out[nodeid] = seconds
    return out


# ---------------------------------------------------------------------------------------------------------------
# summary


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:200]


def summarize(state: dict, ran_now: list[int], budget_s: float, elapsed_s: float, notes: list[str]) -> str:
    plan = state["plan"]
    results = state.get("results", {})
    total = Counter()
    lines = [f"# GPU suite: {sum(plan['tests_per_shard'])} tests in {len(plan['shards'])} shards "
             f"(order {plan['order']}, shards of at most {plan['shard_minutes']:g} min)", "",
             f"run begun {state['run_begun']}; this call ran shards {', '.join(map(str, ran_now)) or 'none'} "
             f"in {elapsed_s:.0f} s of its {budget_s:.0f} s; shards still to run: "
             f"{', '.join(map(str, pending_shards(state))) or 'none'}", ""]
    lines += [f"- {note}" for note in notes] + ([""] if notes else [])
    lines += ["| shard | files | tests | planned s | wall s | " + " | ".join(OUTCOMES) + " | ran |",
              "|" + "---|" * (len(OUTCOMES) + 6)]
    failures, skips, slow = [], [], []
    for k, files in enumerate(plan["shards"]):
        r = results.get(str(k))
        if r is None:
            lines.append(f"| {k} | {len(files)} | {plan['tests_per_shard'][k]} | {plan['estimate_s'][k]:.0f} | - | "
                         + " | ".join("-" for _ in OUTCOMES) + " | not yet |")
            continue
        counts = Counter(outcome for outcome, _, _ in r["tests"].values())
        total.update(counts)
        when = "this call" if k in ran_now else r["ran"]
        state_word = "" if r["complete"] else (" (cut by the budget)" if r["cut"] else f" (pytest exit {r['exit']})")
        lines.append(f"| {k} | {len(files)} | {len(r['tests'])} | {plan['estimate_s'][k]:.0f} | {r['wall_s']:.0f} | "
                     + " | ".join(str(counts.get(o, 0)) for o in OUTCOMES) + f" | {when}{state_word} |")
        reasons = Counter()
        for nodeid, (outcome, seconds, message) in r["tests"].items():
            if outcome in ("failed", "error"):
                failures.append(f"- shard {k}: {outcome} {nodeid}: {_first_line(message)}")
            elif outcome == "skipped":
                reasons[_first_line(message)] += 1
            elif outcome == "not run" and message == "running when the budget ran out":
                failures.append(f"- shard {k}: cut while running {nodeid}")
            slow.append((seconds, nodeid, k))
        skips += [f"- shard {k}: {n} x {reason}" for reason, n in reasons.most_common()]
        if not r["complete"] and r.get("log_tail"):
            failures.append(f"- shard {k}: the end of its log:\n\n```\n{r['log_tail'][-1500:]}\n```")
    lines.append("| total | | {} | {:.0f} | {:.0f} | ".format(
        sum(len(r["tests"]) for r in results.values()), sum(plan["estimate_s"]),
        sum(r["wall_s"] for r in results.values())) + " | ".join(str(total.get(o, 0)) for o in OUTCOMES) + " | |")
    lines += ["", "## Failures", *(failures or ["none"]), "", "## Skipped (reasons)", *(skips or ["none"]), "",
              f"## The {SLOWEST} slowest tests", "| s | test | shard |", "|---|---|---|"]
    lines += [f"| {s:.1f} | {n} | {k} |" for s, n, k in sorted(slow, key=lambda x: -x[0])[:SLOWEST]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------
# running


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def split_pytest_args(args: list[str]) -> tuple[list[str], list[str]]:
    """pytest's arguments as (targets: paths and test ids, which choose what is collected; options, which the
    collection and every shard get)."""
    targets = [a for a in args if not a.startswith("-") and Path(a.partition("::")[0]).exists()]
    return targets, [a for a in args if a not in targets]


def collect(marker: str, targets: list[str], options: list[str], environ: dict[str, str]) -> tuple[list[str], str]:
    """The test ids pytest collects under the mark, and its collection errors (with its output's end) if any."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "--continue-on-collection-errors", "-m", marker, *options, *targets],
                         capture_output=True, text=True, env=environ, check=False)
    ids = [line for line in out.stdout.splitlines() if "::" in line and file_of(line).endswith(".py")
           and not line.startswith(("SKIPPED", "ERROR", "FAILED"))]
    errors = [line for line in out.stdout.splitlines() if line.startswith("ERROR ")]
    if out.returncode not in (0, 5) and not errors:  # 5: nothing collected
        errors = [f"pytest --collect-only exited {out.returncode}"]
    return ids, "\n".join(errors) + ("\n" + out.stdout[-2000:] + out.stderr[-2000:] if errors else "")


def run_shard(nodeids: list[str], marker: str, options: list[str], xml: Path, log, deadline: float,
              environ: dict[str, str]) -> tuple[int | None, bool, float, str]:
    """One pytest process over the tests, in their order; at the deadline it is interrupted (SIGINT: pytest still
    writes its junit file), and killed 20 s later. Returns (exit status, cut, seconds, its output)."""
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", marker, f"--junitxml={xml}",
           *options, *nodeids]
    t0 = time.monotonic()
    text = io.StringIO()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environ,
                            start_new_session=True, preexec_fn=_default_sigint)
    cut = False

    def interrupt() -> None:
        nonlocal cut
        cut = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)

    timer = threading.Timer(max(deadline - time.monotonic(), 1.0), interrupt)
    killer = threading.Timer(max(deadline - time.monotonic(), 1.0) + 20, lambda: _kill(proc))
    timer.start()
    killer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            text.write(line)
            log.write(line)
        proc.wait()
    finally:
        timer.cancel()
        killer.cancel()
    return proc.returncode, cut, time.monotonic() - t0, text.getvalue()


def _default_sigint() -> None:
    """In the pytest child before it starts: SIGINT's default action, so that Python installs its KeyboardInterrupt
    handler even where this process was started with SIGINT ignored (a shell's background job, nohup)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python3 -m flotilla.scripts.dev.gpu_suite", description=__doc__.split("\n\n")[0])
    p.add_argument("--shard", default="pending",
                   help="which shards this call runs: pending (those this run has not finished; once every shard "
                        "has run, a new run begins with all of them), all, or K[,K...] (default pending)")
    p.add_argument("--shard-minutes", type=float, default=9.0, help="the longest a shard is planned to take")
    p.add_argument("--order", type=parse_order, default="file",
                   help="the files' order: file (as collected), reverse, or shuffle:SEED (default file)")
    p.add_argument("--replan", action="store_true", help="begin a new run: plan afresh and forget earlier results")
    p.add_argument("--budget-s", type=float, default=560.0,
                   help="seconds this call may take: no shard starts that its estimate says would pass it, and one "
                        "running when it comes is interrupted (default 560)")
    p.add_argument("--reserve-s", type=float, default=20.0,
                   help="seconds kept from the budget to save the caches and write the summary (default 20)")
    p.add_argument("--cache-dir", type=Path, default=Path(".gpu-suite"),
                   help="where the last call's suite.json and cache archives are (default .gpu-suite)")
    p.add_argument("--out", type=Path, help="where this call writes its files (required unless --prune)")
    p.add_argument("--prune", action="store_true",
                   help="here, after copying a call's files into --cache-dir: delete the cache archives its suite.json "
                        "no longer names (so the carried folder holds only what the next call restores), then exit")
    p.add_argument("--cache-max-mb", type=float, default=32.0,
                   help="the most the cache archives may take together (a cache that would pass it is not saved)")
    p.add_argument("--no-caches", action="store_true", help="neither restore nor save the JIT caches")
    p.add_argument("--restore", action="store_true",
                   help="on the GPU machine: restore the JIT caches --cache-dir carries, then exit (before other "
                        "work in the same command, so that it compiles nothing the suite already did)")
    p.add_argument("--marker", default="gpu", help="the pytest mark expression (default gpu)")
    p.add_argument("pytest_args", nargs="*", metavar="-- PYTEST_ARGS",
                   help="after --, pytest's: paths or test ids choose what is collected (default tests); options "
                        "(-k EXPR, -x, --timeout N) go to the collection and to every shard")
    args = p.parse_args(argv)
    if args.out is None and not (args.prune or args.restore):
        p.error("--out is required")
    args.targets, args.options = split_pytest_args(args.pytest_args)
    args.targets = args.targets or ["tests"]
    return args


def main(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.prune:
        for name in prune(args.cache_dir, STATE):
            print(f"deleted {args.cache_dir / name}")
        return 0
    environ = dict(os.environ if environ is None else environ)
    t0 = time.monotonic()
    deadline = t0 + args.budget_s - args.reserve_s
    state_file = args.cache_dir / STATE
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    notes = []

    dirs = jit_cache_dirs(environ)
    caches = state.get("caches", {})  # name -> {"digest", "parts"}: the archives in --cache-dir
    if args.restore:
        print("\n".join(restore_caches(args.cache_dir, caches, dirs)), flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.no_caches:
        notes += restore_caches(args.cache_dir, caches, dirs)

    nodeids, collection_errors = collect(args.marker, args.targets, args.options, environ)
    if collection_errors:
        notes.append(f"collection errors (their tests are in no shard):\n\n```\n{collection_errors}\n```")
    durations = state.get("durations", {})
    plan = state.get("plan")
    if args.replan or not plan_fits(plan, nodeids, args.order, args.shard_minutes):
        if plan is not None:
            notes.append("planned afresh: " + ("--replan" if args.replan else "the tests, --order or --shard-minutes "
                                              "differ from the last plan's"))
        state.update(plan=make_plan(nodeids, durations, args.order, args.shard_minutes), results={},
                     run_begun=_now())
    elif args.shard == "pending" and not pending_shards(state):
        notes.append("every shard of the last run has run: a new run begins, planned from its durations")
        state.update(plan=make_plan(nodeids, durations, args.order, args.shard_minutes), results={},
                     run_begun=_now())
    plan = state["plan"]
    by_file = group_by_file(nodeids)

    ran: list[int] = []
    started = False
    with (args.out / LOG).open("w") as log:
        for k in select_shards(args.shard, state):
            shard_ids = [n for f in plan["shards"][k] for n in by_file[f]]
            earlier = resumed_results(state.get("results", {}).get(str(k)), shard_ids)
            todo = [n for n in shard_ids if n not in earlier]
            left = deadline - time.monotonic()
            planned = estimate_s(todo, durations) if earlier else plan["estimate_s"][k]
            if started and planned > left:  # (the call's first pytest starts whatever its estimate)
                notes.append(f"shard {k} (planned {planned:.0f} s) left for the next call: "
                             f"{max(left, 0):.0f} s of the budget remain")
                break
            log.write(f"===== shard {k}: {len(todo)} tests in {len(plan['shards'][k])} files"
                      + (f" (resumed: {len(earlier)} ran in an earlier call)" if earlier else "") + "\n")
            log.flush()
            xml = args.out / f"shard-{k}.xml"
            if todo:
                started = True
                code, cut, wall, text = run_shard(todo, args.marker, args.options, xml, log, deadline, environ)
            else:  # (every test had its result when the budget cut the shard: pytest with no ids would run them all)
                code, cut, wall, text = 0, False, 0.0, ""
            results, running = parse_verbose_log(text, todo)
            if xml.is_file():
                with contextlib.suppress(ET.ParseError):
                    results.update(parse_junit(xml.read_text(), todo))
                xml.unlink()
            results.update(earlier)
            if earlier:  # the shard's time is that of every call that ran part of it
                wall += state["results"][str(k)]["wall_s"]
            record = shard_record(shard_ids, results, wall, code, cut, running, text)
            state.setdefault("results", {})[str(k)] = record
            state["durations"] = durations = merge_durations(durations, record)
            ran.append(k)
            print(f"shard {k}: exit {code} in {wall:.0f} s" + (" (cut by the budget)" if cut else ""), flush=True)
            if cut:
                break

    if not args.no_caches:
        used = 0
        for name, root in dirs.items():
            digest = tree_digest(root)
            if digest is None:
                continue
            if caches.get(name, {}).get("digest") == digest:
                used += sum((args.cache_dir / p).stat().st_size for p in caches[name]["parts"])
                notes.append(f"the {name} cache did not change: not written again")
                continue
            parts = archive_cache(name, root, digest, args.out)
            size = sum((args.out / p).stat().st_size for p in parts)
            if used + size > args.cache_max_mb * 2**20:
                for p in parts:
                    (args.out / p).unlink()
                notes.append(f"the {name} cache ({size / 2**20:.1f} MiB) would pass --cache-max-mb: not saved")
                continue
            used += size
            caches[name] = {"digest": digest, "parts": parts}
            notes.append(f"saved the {name} cache: {size / 2**20:.1f} MiB in {len(parts)} part(s)")
    state["caches"] = caches

    log_path = args.out / LOG
    if log_path.stat().st_size > PART_BYTES:  # (no result file is larger than the parts): keep the end
        with log_path.open("rb") as f:
            f.seek(-PART_BYTES, os.SEEK_END)
            tail = f.read()
        log_path.write_bytes(b"(the log's beginning is left out)\n" + tail)
    (args.out / STATE).write_text(json.dumps(state, indent=1))
    keep_in_cache_dir(args.cache_dir, args.out, state)
    summary = summarize(state, ran, args.budget_s, time.monotonic() - t0, notes)
    (args.out / SUMMARY).write_text(summary)
    print(summary, flush=True)
    failed = any(o in ("failed", "error") for r in state.get("results", {}).values()
                 for o, _, _ in r["tests"].values())
    return 1 if failed or collection_errors else 0


def keep_in_cache_dir(cache_dir: Path, out: Path, state: dict) -> None:
    """The state and the cache archives it names into cache_dir too (the archives it no longer names dropped), so a
    later call on the same machine goes on from them whether or not what came back was copied in first."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    for part in (p for archive in state.get("caches", {}).values() for p in archive["parts"]):
        if (out / part).is_file() and not (cache_dir / part).is_file():
            shutil.copyfile(out / part, cache_dir / part)
    (cache_dir / STATE).write_text(json.dumps(state, indent=1))
    prune(cache_dir, STATE)


if __name__ == "__main__":
    sys.exit(main())
