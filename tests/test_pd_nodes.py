"""Prefill-decode disaggregation over two nodes: two front ends that share a real Redis registry and route to each
other's engines. Node "a" runs a prefill engine only, node "b" a decode engine only (two `flotilla serve`
processes, each with its own engine processes, as two machines would run them; their actors listen on TCP). A
request to either front end is prefilled on a's engine and decoded on b's; the text comes back to the front end
that took it. A colocated engine gives the reference outputs. The tests run in file order; the fourth kills
node b's decode engine twice (restarted once, then node b exits).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import helpers_pd as pdh
import pytest
from flotilla.scripts.launch import load_deployment, serve_argv
from flotilla.transport.endpoints import free_tcp_port
from flotilla.transport.registry import RedisRegistry
from helpers_engine import set_max_positions, write_tiny_engine_model
from helpers_optional import require
from helpers_server import start_server, start_servers

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)

openai = require("openai", "the nodes are tested through the real openai client")
require("dlslime", "the KV data plane needs dlslime (and Debian's libibverbs1)")


@pytest.fixture(scope="module")
def redis_url():
    with pdh.redis_server() as url:
        if url is None:
            pytest.skip("needs redis-server (the registry two nodes share)")
        yield url


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny model with 2,048 positions (its 256 would end a stream at its RoPE table): streams that are killed
    mid-way must outlast the kill on a fast machine (a 150-token one can end before it)."""
    return set_max_positions(write_tiny_engine_model(tmp_path_factory.mktemp("pd-nodes") / "m"), 2048)


def test_the_shipped_two_node_deployment_names_its_node_and_engine_host():
    dep = load_deployment(Path(__file__).parent.parent / "examples/topologies/pd-two-nodes.toml")
    assert dep is not None and dep.engines == ["prefill"] and dep.registry.startswith("redis://")
    argv = serve_argv(dep, "/models/x", None, trace=False)
    assert argv[argv.index("--node-name") + 1] == "nodeA" and argv[argv.index("--engine-host") + 1] == "10.0.0.1"
    assert argv[argv.index("--kv-host") + 1] == "10.0.0.1"


LONG = ["--max-model-len", "1024", "--kv-cache-blocks", "1024"]
"""Room on the decode node for the four 900-token streams that its engine's death cuts off."""


def node_argv(model, redis_url: str, name: str, engines: str) -> list[str]:
    return [str(model), *pdh.ENGINE_OPTIONS, "--registry", redis_url, "--node-name", name, "--engines", engines,
            "--engine-host", "127.0.0.1", "--kv-transfer-backend", "dlslime_tcp", "--kv-host", "127.0.0.1"]


@pytest.fixture(scope="module")
def nodes(model, redis_url):
    a = start_server(*node_argv(model, redis_url, "a", "prefill"), timeout=180)
    started = [a]
    try:
        pdh.wait_health(a.url, 503)  # a prefill engine alone serves nothing: no decode engine anywhere yet
        b, colocated = start_servers(([*node_argv(model, redis_url, "b", "decode"), *LONG, "--engine-restarts", "1"],
                                      {"timeout": 180}),
                                     ((str(model), "--single-process", *pdh.ENGINE_OPTIONS), {"timeout": 180}))
        started += [b, colocated]
        pdh.wait_health(a.url, 200, timeout=60)  # node a has found node b's decode engine in the registry
    except BaseException:
        for s in started:
            s.stop()
        raise
    yield a, b, colocated
    colocated.stop()
    b.stop()  # (the last test kills its engine: it has exited by then)
    assert a.stop() == 0, "".join(a.log[-30:])


def test_either_node_serves_with_the_other_nodes_engine_and_gives_the_colocated_outputs(nodes):
    a, b, colocated = nodes
    for node in (a, b):  # each front end found the other node's engine in the registry
        pdh.wait_health(node.url, 200)
    reqs_a, reqs_b = pdh.requests(16), pdh.requests(16, offset=16)
    expected = pdh.run_all(colocated.url, reqs_a + reqs_b)
    with ThreadPoolExecutor(2) as pool:
        got_a, got_b = pool.map(lambda nr: pdh.run_all(*nr), [(a.url, reqs_a), (b.url, reqs_b)])
    assert got_a + got_b == expected
    # each front end routed its 16 to a's prefill engine and b's decode engine, one local and one remote
    for node in (a, b):
        m = pdh.metrics(node.url)
        for engine in ("a-prefill-0", "b-decode-0"):
            assert pdh.engine_metric(m, "flotilla_engine_requests_routed_total", engine) == 16
    # the KV crossed dlslime TCP into b's decode engine (its own front end reports its stats), and every block of
    # both engines is free again: a's pinned prompts were released, whichever front end routed them
    m_b = pdh.wait_idle(b.url, ["b-decode-0"])
    assert pdh.engine_metric(m_b, "flotilla_kv_migration_bytes_total", "b-decode-0") > 0
    pdh.wait_idle(a.url, ["a-prefill-0"])
    assert any("routing to engine b-decode-0 (decode) of another node" in x for x in a.log)


def test_a_node_name_taken_in_the_registry_is_refused_before_any_model_loads(model, redis_url, nodes):
    out = subprocess.run([sys.executable, "-m", "flotilla", "serve", *node_argv(model, redis_url, "a", "prefill"),
                          "--port", str(free_tcp_port())], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 1
    assert "engine ids a-prefill-0 are registered by another front end" in out.stderr, out.stderr[-2000:]
    assert "--node-name" in out.stderr


def _kill_decode_mid_stream(a, b) -> None:
    """Kill node b's decode engine's worker while four streams through node a decode on it: each ends with an error
    naming the engine, and node a's prefill engine holds no block for the dead engine's transfers."""
    line = [x for x in b.log if "engine b-decode-0 (decode) registered" in x or "engine b-decode-0 restarted" in x][-1]
    worker_pid = int(re.search(r"worker/0=pid:(\d+)", line).group(1))
    client = openai.OpenAI(base_url=a.url + "/v1", api_key="none", max_retries=0, timeout=60)
    streams = [client.completions.create(model="m", prompt=pdh.prompt(40 + i), max_tokens=900, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True}) for i in range(4)]
    firsts = [next(iter(s)).choices[0].text for s in streams]  # every request is decoding on node b now
    assert all(firsts)
    os.kill(worker_pid, signal.SIGKILL)
    for s in streams:
        with pytest.raises(openai.APIError) as err:
            for _ in s:
                pass
        assert "engine b-decode-0" in str(err.value), err.value
    # no decode engine is left anywhere: node a says so at once rather than hang
    pdh.wait_health(a.url, 503)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="m", prompt="x", max_tokens=2)
    assert err.value.status_code == 503
    pdh.wait_idle(a.url, ["a-prefill-0"])


def test_a_dead_decode_node_is_restarted_then_exits_when_out_of_restarts(nodes):
    """Node b runs with --engine-restarts 1: its decode engine's first death is followed by a restart that node a
    finds in the registry (new addresses) and routes to with the colocated outputs; the second death in a row ends
    node b (exit status 1) so that whatever supervises it can start it again."""
    a, b, colocated = nodes
    _kill_decode_mid_stream(a, b)
    pdh.wait_health(a.url, 200, timeout=120)
    assert any("engine b-decode-0 restarted (1 since start)" in x for x in b.log)
    reqs = pdh.requests(8, offset=60)
    assert pdh.run_all(a.url, reqs) == pdh.run_all(colocated.url, reqs)
    pdh.wait_idle(a.url, ["a-prefill-0"])
    pdh.wait_idle(b.url, ["b-decode-0"])
    _kill_decode_mid_stream(a, b)
    assert b.proc.wait(timeout=30) == 1, "".join(b.log[-30:])
    assert any("engine b-decode-0: giving up after 1 restarts in a row" in x for x in b.log)


def _wait_registry_loads_zero(url: str, engines: list[str], timeout: float = 15.0) -> None:
    """Until every engine's last report to the Redis registry at `url` says it runs nothing."""
    async def loads() -> dict[str, float]:
        registry = RedisRegistry(url)
        try:
            return {e.engine_id: e.load for e in await registry.engines()}
        finally:
            await registry.close()

    deadline = time.monotonic() + timeout
    while True:
        seen = asyncio.run(loads())
        if all(seen.get(e) == 0 for e in engines):
            return
        assert time.monotonic() < deadline, f"engines still report load: {seen}"
        time.sleep(0.1)


def test_colocated_engines_of_two_nodes_share_one_front_ends_load(model, redis_url, nodes):
    """Plain data parallelism across nodes: two nodes with a colocated engine each (their own registry database),
    and requests to one front end spread over both engines with the colocated engine's outputs, streamed or not;
    every KV block of both is free afterwards. Then that front end dies mid-stream: the other node's engine aborts
    the sequences nobody reads any more (--frontend-grace-s 1 there) and keeps serving. (With a grace of 0,
    on a loaded machine d's engine may call c's front end unreachable while c serves, and the kill then finds nothing
    left to abort.)"""
    _, _, colocated = nodes
    url = redis_url.rsplit("/", 1)[0] + "/1"
    # the streams below must outlast the kill and the grace on a fast machine (180-token ones can end inside the
    # grace, leaving nothing to abort): room for four 900-token streams
    extra = [*LONG, "--frontend-grace-s", "1"]  # (c's too: unused)
    c, d = start_servers(([*node_argv(model, url, "c", "both"), *extra], {"timeout": 180}),
                         ([*node_argv(model, url, "d", "both"), *extra], {"timeout": 180}))
    try:
        pdh.wait_health(c.url, 200)
        reqs = pdh.requests(24, offset=50)
        assert pdh.run_all(c.url, reqs) == pdh.run_all(colocated.url, reqs)
        m = pdh.metrics(c.url)
        routed = {e: pdh.engine_metric(m, "flotilla_engine_requests_routed_total", e) for e in ("c-engine-0", "d-engine-0")}
        assert routed["d-engine-0"] > 0 and sum(routed.values()) == 24, routed
        pdh.wait_idle(d.url, ["d-engine-0"], transfers=False)
        pdh.wait_idle(c.url, ["c-engine-0"], transfers=False)
        # the router balances on the loads the engines last reported to the registry: until both report 0, a stale
        # load on d's would send every stream below to c's own engine, and the kill would find none to abort on d
        _wait_registry_loads_zero(url, ["c-engine-0", "d-engine-0"])
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="none", max_retries=0, timeout=60)
        streams = [client.completions.create(model="m", prompt=pdh.prompt(i), max_tokens=900, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True}) for i in range(4)]
        assert all(next(iter(s)).choices for s in streams)  # decoding, some on each engine (least loaded first)
        c.proc.kill()
        c.proc.wait(timeout=30)
        pdh.wait_idle(d.url, ["d-engine-0"], transfers=False)
        assert any(re.search(r"aborting [1-4] sequences of the front end at tcp://", x) for x in d.log), "".join(d.log[-25:])
        # c's engine died with it, unknown to d's front end until its registry entry expires: requests d routes there
        # meanwhile are routed again, to d's engine, and all give the colocated outputs
        reqs = pdh.requests(4, offset=80)
        assert pdh.run_all(d.url, reqs) == pdh.run_all(colocated.url, reqs)
    finally:
        assert d.stop() == 0, "".join(d.log[-30:])
        c.stop()
