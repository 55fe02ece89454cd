"""Prefill-decode disaggregation end to end: real processes, ZeroMQ, dlslime TCP, the openai client.

One deployment for the module, started the way an operator would (`flotilla launch DEPLOYMENT.toml
--model M --port P`): a front end + router and three engines (1 prefill, 2 decode), each engine's actors
in their own processes; the service registry is a real redis-server when one is installed. A colocated
engine (`flotilla serve --single-process`) gives the reference outputs. The tests run in file order;
the last three kill a decode engine (decoding, then mid-migration), then the prefill engine, and see each
restarted.
"""

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
from flotilla.scripts.launch import load_deployment, serve_argv
from helpers_engine import write_tiny_engine_model
from helpers_optional import optional, require
from helpers_server import start_servers

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)

openai = require("openai", "the deployment is tested through the real openai client")
require("dlslime", "the KV data plane needs dlslime (and Debian's libibverbs1)")
redis = optional("redis")  # checks the registry when redis_url is not None (a redis-server and this client)


@pytest.fixture(scope="module")
def redis_url():
    with pdh.redis_server() as url:  # None without redis-server: the deployment then uses the in-memory registry
        yield url


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_tiny_engine_model(tmp_path_factory.mktemp("pd") / "m")


@pytest.fixture(scope="module")
def servers(model, redis_url, tmp_path_factory):
    toml = tmp_path_factory.mktemp("pd-topo") / "pd-1p2d.toml"
    registry = redis_url or "memory"
    toml.write_text(f'name = "pd-1p2d"\nengines = ["prefill", "decode", "decode"]\nregistry = "{registry}"\n'
                    '[engine]\nblock_size = 4\nkv_cache_blocks = 160\nmax_num_seqs = 16\n'
                    'kv_transfer_backend = "dlslime_tcp"\n')
    pd, colocated = start_servers(((str(toml), "--model", str(model)), {"command": "launch", "timeout": 180}),
                                  ((str(model), "--single-process", *pdh.ENGINE_OPTIONS), {"timeout": 180}))
    yield pd, colocated
    colocated.stop()
    assert pd.stop() == 0, "".join(pd.log[-30:])


def test_the_shipped_1p1d_deployment_describes_one_prefill_and_one_decode_engine():
    dep = load_deployment(Path(__file__).parent.parent / "examples/topologies/pd-1p1d.toml")
    assert dep is not None and dep.engines == ["prefill", "decode"]
    argv = serve_argv(dep, "/models/x", 9000, trace=False)
    assert argv[:1] == ["/models/x"] and argv[argv.index("--port") + 1] == "9000"
    assert argv[argv.index("--engines") + 1] == "prefill,decode"


def test_1p2d_gives_the_colocated_greedy_outputs_and_moves_kv_over_dlslime(servers):
    pd, colocated = servers
    reqs = pdh.requests(32)
    expected = pdh.run_all(colocated.url, reqs)
    got = pdh.run_all(pd.url, reqs)
    for r, e, g in zip(reqs, expected, got):
        assert g == e, r
    m = pdh.wait_idle(pd.url, ["prefill-0", "decode-0", "decode-1"])  # prefill's pinned blocks were all released
    moved = [pdh.engine_metric(m, "flotilla_kv_migration_bytes_total", d) for d in ("decode-0", "decode-1")]
    assert all(b > 0 for b in moved), moved  # the router used both decode engines, KV crossed dlslime TCP
    assert not [k for k in m if k.startswith("flotilla_kv_migration_bytes_total") and 'engine="prefill-0"' in k
                and m[k] > 0]
    routed = {e: pdh.engine_metric(m, "flotilla_engine_requests_routed_total", e)
              for e in ("prefill-0", "decode-0", "decode-1")}
    assert routed["prefill-0"] == 32 and routed["decode-0"] + routed["decode-1"] == 32, routed
    registered = [x for x in pd.log if re.search(r"engine (prefill|decode)-\d \(\w+\) registered", x)]
    assert len(registered) == 3 and all("kv_backend=dlslime_tcp kv_endpoint=127.0.0.1:" in x for x in registered)


def test_aborted_streams_free_nothing_early_and_everything_in_the_end(servers):
    pd, colocated = servers
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def abort_early(i: int) -> None:
        stream = client.completions.create(model="m", prompt=pdh.prompt(i), max_tokens=60, temperature=0, stream=True)
        if i % 3:
            next(iter(stream))  # after the migration: the decode side runs it
        stream.close()  # i % 3 == 0: at once, likely before or during the migration

    keep = pdh.requests(12, offset=40)
    with ThreadPoolExecutor(16) as pool:
        aborted = [pool.submit(abort_early, i) for i in range(24)]
        kept = pool.submit(pdh.run_all, pd.url, keep)
        for f in aborted:
            f.result()
        got = kept.result()
    # the requests that ran beside the aborts read only their own KV
    assert got == pdh.run_all(colocated.url, keep)
    pdh.wait_idle(pd.url, ["prefill-0", "decode-0", "decode-1"])


def test_engines_register_in_redis_and_come_back_when_their_entry_expires(servers, redis_url):
    if redis_url is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    r = redis.Redis.from_url(redis_url)
    try:
        entries = {k.decode(): v for k, v in ((k, r.get(k)) for k in r.scan_iter("flotilla:engine:*"))}
        assert set(entries) == {f"flotilla:engine:{e}" for e in ("prefill-0", "decode-0", "decode-1")}
        assert b'"role":"prefill"' in entries["flotilla:engine:prefill-0"]
        assert b'"kv_capacity_tokens":640' in entries["flotilla:engine:decode-0"]
        assert b"scheduler/0" in entries["flotilla:engine:decode-0"]
        r.delete("flotilla:engine:decode-0")  # as if its entry expired (a partition, a stalled heartbeat)
        deadline = time.monotonic() + 5
        while not r.exists("flotilla:engine:decode-0"):
            assert time.monotonic() < deadline, "the engine did not register again"
            time.sleep(0.05)
    finally:
        r.close()


def test_killing_a_decode_engine_fails_its_requests_clearly_and_the_rest_keep_serving(servers, redis_url):
    pd, colocated = servers
    line = next(x for x in pd.log if "engine decode-1 (decode) registered" in x)
    worker_pid = int(re.search(r"worker/0=pid:(\d+)", line).group(1))
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="none", max_retries=0, timeout=60)
    # ignore_eos: every request is still decoding when the engine dies
    reqs = [{"kind": "completion", "stream": True, "prompt": pdh.prompt(60 + i), "max_tokens": 150,
             "extra_body": {"ignore_eos": True}} for i in range(8)]
    expected = pdh.run_all(colocated.url, reqs)
    streams = [client.completions.create(model="m", prompt=r["prompt"], max_tokens=150, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True}) for r in reqs]
    firsts = [next(iter(s)).choices[0].text for s in streams]  # every request is decoding now
    os.kill(worker_pid, signal.SIGKILL)

    def finish(i: int) -> str | Exception:
        try:
            return firsts[i] + "".join(c.choices[0].text for c in streams[i] if c.choices)
        except openai.APIError as e:
            return e

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(finish, range(8)))
    failed = [o for o in outcomes if isinstance(o, Exception)]
    assert failed and len(failed) < len(outcomes), outcomes  # the router had spread them over both decoders
    for o in failed:
        assert "engine decode-1" in str(o) and "killed by signal 9" in str(o), o
    for o, e in zip(outcomes, expected):
        if not isinstance(o, Exception):
            assert o == e
    # the router and the other engines keep serving while the dead engine, out of the registry, is restarted
    assert urllib.request.urlopen(pd.url + "/health", timeout=10).status == 200
    reqs = pdh.requests(6, offset=80)
    assert pdh.run_all(pd.url, reqs) == pdh.run_all(colocated.url, reqs)
    # decode-1 comes back (new processes, new addresses) and is routed to again
    m = pdh.wait_restarted(pd, "decode-1")
    if redis_url is not None:
        r = redis.Redis.from_url(redis_url)
        try:
            assert r.exists("flotilla:engine:decode-1") and r.exists("flotilla:engine:decode-0")
        finally:
            r.close()
    routed = pdh.engine_metric(m, "flotilla_engine_requests_routed_total", "decode-1")
    reqs = pdh.requests(16, offset=100)
    assert pdh.run_all(pd.url, reqs) == pdh.run_all(colocated.url, reqs)
    m = pdh.wait_idle(pd.url, ["prefill-0", "decode-0", "decode-1"])  # the dead engine's transfers were released too
    assert pdh.engine_metric(m, "flotilla_engine_requests_routed_total", "decode-1") > routed


def test_a_decode_engine_killed_mid_migration_leaves_nothing_pinned_on_the_prefill_engine(servers):
    """decode-1's KV-migration actor is stopped (SIGSTOP), so the transfers routed to it wait mid-migration with the
    prompts' blocks pinned on prefill-0; then it is killed. Every request still ends (those without a token yet are
    routed again, to decode-0, with the colocated outputs; any other with an error naming decode-1), prefill-0 holds
    no block and no transfer afterwards, and decode-1 comes back."""
    pd, colocated = servers
    line = [x for x in pd.log if "engine decode-1 (decode) registered" in x][-1]
    kv_pid = int(re.search(r"kv_migration/0=pid:(\d+)", line).group(1))
    reqs = [{"kind": "completion", "stream": False, "prompt": pdh.prompt(140 + i), "max_tokens": 20,
             "extra_body": {"ignore_eos": True}} for i in range(8)]
    expected = pdh.run_all(colocated.url, reqs)
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def outcome(r: dict) -> str:
        try:
            return pdh.run(client, r)
        except openai.APIError as e:
            return f"error: {e}"

    routed = pdh.engine_metric(pdh.metrics(pd.url), "flotilla_engine_requests_routed_total", "decode-1")
    os.kill(kv_pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(8) as pool:
            running = [pool.submit(outcome, r) for r in reqs]
            deadline = time.monotonic() + 30
            while True:  # until a transfer to decode-1 holds its prompt's blocks on prefill-0
                m = pdh.metrics(pd.url)
                if (pdh.engine_metric(m, "flotilla_engine_requests_routed_total", "decode-1") > routed
                        and pdh.engine_metric(m, "flotilla_kv_transfers_in_flight", "prefill-0", default=0) > 0):
                    break
                assert time.monotonic() < deadline, "no transfer waited on the stopped migration"
                time.sleep(0.02)
            os.kill(kv_pid, signal.SIGKILL)
            outcomes = [f.result(timeout=120) for f in running]
    finally:
        try:
            os.kill(kv_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for o, e in zip(outcomes, expected):
        assert o == e or ("engine decode-1" in o and "kv_migration/0" in o), (o, e)
    pdh.wait_idle(pd.url, ["prefill-0", "decode-0"])  # nothing pinned for the dead engine's transfers
    pdh.wait_restarted(pd, "decode-1", times=2)
    pdh.wait_idle(pd.url, ["prefill-0", "decode-0", "decode-1"])


def test_requests_past_their_migration_outlive_the_prefill_engine(servers):
    pd, colocated = servers
    line = next(x for x in pd.log if "engine prefill-0 (prefill) registered" in x)
    worker_pid = int(re.search(r"worker/0=pid:(\d+)", line).group(1))
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="none", max_retries=0, timeout=60)
    reqs = [{"kind": "completion", "stream": True, "prompt": pdh.prompt(90 + i), "max_tokens": 100,
             "extra_body": {"ignore_eos": True}} for i in range(4)]
    expected = pdh.run_all(colocated.url, reqs)
    streams = [client.completions.create(model="m", prompt=r["prompt"], max_tokens=100, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True}) for r in reqs]
    firsts = [next(iter(s)).choices[0].text for s in streams]  # their KV is on the decode engine now
    os.kill(worker_pid, signal.SIGKILL)
    # without a prefill engine nothing new can be served, and the server says so instead of hanging (polled at
    # once: the restart ends the 503s, and the streams may take longer than it)
    deadline = time.monotonic() + 15
    while True:
        try:
            urllib.request.urlopen(pd.url + "/health", timeout=10)
        except urllib.error.HTTPError as e:
            assert e.code == 503
            break
        assert time.monotonic() < deadline, "the prefill engine's death was not noticed"
        time.sleep(0.05)
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="m", prompt="x", max_tokens=2)
    assert err.value.status_code == 503 and err.value.code == "engine_restarting", err.value
    assert int(err.value.response.headers["Retry-After"]) >= 1
    got = [f + "".join(c.choices[0].text for c in s if c.choices) for f, s in zip(firsts, streams)]
    assert got == expected
    pdh.wait_idle(pd.url, ["decode-0"])
    # the prefill engine comes back, and the deployment serves as before
    pdh.wait_restarted(pd, "prefill-0")
    pdh.wait_health(pd.url, 200)
    reqs = pdh.requests(8, offset=120)
    assert pdh.run_all(pd.url, reqs) == pdh.run_all(colocated.url, reqs)
    pdh.wait_idle(pd.url, ["prefill-0", "decode-0", "decode-1"])
