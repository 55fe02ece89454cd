"""A dead or hung engine under load: `flotilla serve` on a tiny model, its actors killed (SIGKILL) or frozen
(SIGSTOP, caught by missed heartbeats) one at a time under 20 streams (each actor once). Every stream ends with a clear error, the
server keeps answering (/health 503 with Retry-After, then 200), the restarted engine gives the same greedy text,
and nothing is left behind: no old process, run directory or file descriptor, no KV block in use."""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import helpers_pd as pdh
import pytest
from helpers_engine import write_tiny_engine_model
from helpers_procs import alive, wait_gone
from helpers_server import Server, start_server
from helpers_optional import require

openai = require("openai", "the streams are read through the real openai client")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]
OPTIONS = ["--kv-cache-blocks", "512", "--max-num-seqs", "32", "--heartbeat-timeout", "2",
           "--engine-restart-backoff", "0.25"]  # (four failures in a row: 0.25 + 0.5 + 1 + 2 s of waiting)
STREAMS = 20
GREEDY = [{"kind": "completion", "stream": False, "prompt": pdh.prompt(i), "max_tokens": 12} for i in range(4)]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_engine_model(tmp_path_factory.mktemp("restarts") / "m")


@pytest.fixture(scope="module")
def served(model):
    """(server, its greedy answers, the file descriptors it holds once serving, the failures so far): one server for
    the four failures, each after the first checking that those before it left nothing."""
    srv = start_server(str(model), "--engine-restarts", "6", *OPTIONS, timeout=180)
    expected = greedy_texts(srv.url)
    state = {"fds": None, "failures": 0}
    yield srv, expected, state
    children = srv.child_pids()
    assert srv.stop() == 0, "".join(srv.log[-30:])
    assert not wait_gone(children), "an engine process outlived the server"


def greedy_texts(url: str) -> list[str]:
    """GREEDY's answers, through a client closed afterwards: the front end closes its connections at once, not at its
    keep-alive timeout, so its file descriptors settle as soon as the requests end."""
    with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60) as client, \
            ThreadPoolExecutor(len(GREEDY)) as pool:
        return list(pool.map(lambda r: pdh.run(client, r), GREEDY))


def actor_pids(srv: Server) -> dict[str, int]:
    """The server's actor processes by actor name (their command line: `flotilla actor NAME ...`)."""
    out = {}
    for pid in srv.child_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"actor" in argv:
            for name in argv[argv.index(b"actor") + 1].decode().split(","):
                out[name] = pid
    return out


def run_dir_of(pid: int) -> Path:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return Path(argv[argv.index("--topology") + 1]).parent


def settled_fds(pid: int, at_most: int = 0, timeout: float = 5.0) -> int:
    """The process's open file descriptors, once at most `at_most` + 2 (closed connections take a moment)."""
    deadline = time.monotonic() + timeout
    while (n := len(os.listdir(f"/proc/{pid}/fd"))) > at_most + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


def gauge(m: dict[str, float], name: str) -> float:
    return next(v for k, v in m.items() if k.startswith(name + "{"))


def health(url: str) -> tuple[int, str | None]:
    try:
        r = urllib.request.urlopen(url + "/health", timeout=10)
        return r.status, None
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Retry-After")


# every actor once, each signal on two, all on one server (each failure checks the ones before left nothing)
@pytest.mark.parametrize("sig,actor", [("SIGKILL", "worker"), ("SIGKILL", "tokenizer"),
                                       ("SIGSTOP", "scheduler"), ("SIGSTOP", "detokenizer")])
def test_an_actor_killed_or_frozen_under_load_ends_its_streams_and_the_engine_comes_back(served, sig, actor):
    srv, expected, state = served
    signum = getattr(signal, sig)
    pids = actor_pids(srv)
    assert actor in pids, pids
    run_dir = run_dir_of(pids[actor])
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
    # ignore_eos and the whole context: every stream is still decoding when the actor goes
    def start(i: int):
        s = client.completions.create(model="m", prompt=pdh.prompt(i), max_tokens=180, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        assert next(iter(s)).choices[0].text is not None
        return s

    with ThreadPoolExecutor(STREAMS) as pool:  # all at once: none is near its end when the actor goes
        streams = list(pool.map(start, range(STREAMS)))
    killed_at = time.monotonic()
    os.kill(pids[actor], signum)

    def finish(s) -> Exception | None:
        try:
            for _ in s:
                pass
        except openai.APIError as e:
            return e
        return None

    with ThreadPoolExecutor(STREAMS) as pool:
        outcomes = list(pool.map(finish, streams))
    ended_s = time.monotonic() - killed_at
    failed = [o for o in outcomes if o is not None]
    if not (signum == signal.SIGSTOP and actor == "tokenizer"):  # (past a frozen tokenizer a stream
        assert len(failed) == STREAMS, outcomes                   # may still run to its end)
    reason = "killed by signal 9" if signum == signal.SIGKILL else "no heartbeat"
    assert all(f"actor {actor}/0 failed" in str(o) and reason in str(o) for o in failed), failed[:1]
    assert ended_s < 15, f"the streams took {ended_s:.1f} s to end"
    # the front end keeps answering: 503 with Retry-After while the engine restarts, 200 once it is back
    deadline = time.monotonic() + 10
    while (got := health(srv.url))[0] == 200:  # (a frozen actor is noticed when its heartbeats stop)
        assert time.monotonic() < deadline, "the failure was not noticed"
        time.sleep(0.05)
    status, retry = got
    assert status == 503 and retry is not None and int(retry) >= 1, (status, retry)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="m", prompt="x", max_tokens=2)
    assert err.value.status_code == 503 and err.value.response.headers.get("Retry-After")
    assert err.value.body["code"] == "engine_restarting", err.value.body
    pdh.wait_health(srv.url, 200, timeout=60)
    state["failures"] += 1
    # the same greedy text, and nothing of the old engine left
    assert greedy_texts(srv.url) == expected
    assert not wait_gone(list(pids.values())), "an actor of the failed engine is still running"
    assert not run_dir.exists(), f"the failed engine's run directory {run_dir} is still there"
    new = actor_pids(srv)
    assert set(new) == set(pids) and not set(new.values()) & set(pids.values()), (pids, new)
    client.close()
    if state["fds"] is None:  # after the first restart; a leak grows with each further one
        state["fds"] = settled_fds(srv.proc.pid)
    assert settled_fds(srv.proc.pid, state["fds"]) <= state["fds"] + 2, \
        f"the front end holds {settled_fds(srv.proc.pid)} file descriptors, {state['fds']} after the first restart"
    m = pdh.metrics(srv.url)
    assert pdh.engine_metric(m, "flotilla_engine_failures_total", "engine") == state["failures"]
    assert pdh.engine_metric(m, "flotilla_engine_restarts_total", "engine") == state["failures"]
    assert gauge(m, "flotilla_num_requests_running") == 0 and gauge(m, "flotilla_kv_cache_usage_perc") == 0
    assert any(re.search(rf"actor {actor}/0 failed", x) for x in srv.log)
    assert any("engine engine restarted" in x for x in srv.log)


def test_with_no_restarts_the_server_exits_at_the_first_failure(model):
    srv = start_server(str(model), "--engine-restarts", "0", *OPTIONS, timeout=180)
    worker = actor_pids(srv)["worker"]
    os.kill(worker, signal.SIGKILL)
    assert srv.proc.wait(timeout=30) == 1, "".join(srv.log[-30:])
    assert not alive(worker)
