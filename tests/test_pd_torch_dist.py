"""Prefill-decode disaggregation with the torch_dist KV backend end to end: real processes, gloo on CPU.

One deployment (`flotilla launch`): a front end + router, two prefill engines and one decode engine, each
engine's actors in their own processes, KV moving over a 2-rank gloo group per (prefill, decode) pair. A
colocated engine gives the reference greedy outputs. The last test kills a prefill engine: the decode
engine's pair with it breaks, and the rest keep serving. (Over NCCL the same runs on GPUs, one per engine;
tests/test_kv_transfer_torch.py has the two-GPU backend test.)
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import helpers_pd as pdh
import pytest
from helpers_engine import write_tiny_engine_model
from helpers_optional import require
from helpers_server import start_server, start_servers

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)

openai = require("openai", "the deployment is tested through the real openai client")

ENGINES = ["prefill-0", "prefill-1", "decode-0"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = write_tiny_engine_model(tmp_path_factory.mktemp("pd-torch") / "m")
    toml = tmp_path_factory.mktemp("pd-torch-topo") / "pd-2p1d.toml"
    toml.write_text('name = "pd-2p1d-torch"\nengines = ["prefill", "prefill", "decode"]\n'
                    '[engine]\nblock_size = 4\nkv_cache_blocks = 160\nmax_num_seqs = 16\n'
                    'kv_transfer_backend = "torch_dist"\nkv_staging_blocks = 8\nkv_transfer_timeout_s = 10\n')
    pd, colocated = start_servers(((str(toml), "--model", str(model)), {"command": "launch", "timeout": 180}),
                                  ((str(model), "--single-process", *pdh.ENGINE_OPTIONS), {"timeout": 180}))
    yield pd, colocated
    colocated.stop()
    assert pd.stop() == 0, "".join(pd.log[-30:])


def test_greedy_outputs_match_a_colocated_engine_and_kv_moves_over_torch_dist(servers):
    pd, colocated = servers
    reqs = pdh.requests(24)
    expected = pdh.run_all(colocated.url, reqs)
    assert pdh.run_all(pd.url, reqs) == expected
    m = pdh.wait_idle(pd.url, ENGINES)  # every pinned prefill block was released
    assert pdh.engine_metric(m, "flotilla_kv_migration_bytes_total", "decode-0") > 0
    routed = {e: pdh.engine_metric(m, "flotilla_engine_requests_routed_total", e) for e in ENGINES}
    assert routed["prefill-0"] > 0 and routed["prefill-1"] > 0 and routed["decode-0"] == 24, routed
    registered = [x for x in pd.log if re.search(r"engine (prefill|decode)-\d \(\w+\) registered", x)]
    assert len(registered) == 3
    assert all(re.search(r"kv_backend=torch_dist kv_endpoint=127\.0\.0\.1\s*$", x) for x in registered)
    assert not [x for x in pd.log if "migration from" in x and "failed" in x]


def test_tight_caches_on_both_sides_still_serve_every_request(servers, tmp_path):
    """Its own deployment, 1 prefill + 1 decode engine of 28 KV blocks of 4 tokens each, and 32 requests at once.
    Were the decode side to reserve a prompt's blocks as its request arrives, blocks reserved for prompts not yet
    computed and prefill blocks pinned for prompts with no decode room would wait on each other and most of these
    requests would hang. Every one gets the colocated engine's output."""
    _, colocated = servers
    model = write_tiny_engine_model(tmp_path / "m")  # the module's model: the same seed, the same weights
    toml = tmp_path / "pd-tight.toml"
    toml.write_text('name = "pd-tight"\nengines = ["prefill", "decode"]\n'
                    '[engine]\nblock_size = 4\nkv_cache_blocks = 28\nmax_num_seqs = 16\n'
                    'kv_transfer_backend = "torch_dist"\nkv_staging_blocks = 8\nkv_transfer_timeout_s = 10\n')
    pd = start_server(str(toml), "--model", str(model), command="launch", timeout=180)
    try:
        reqs = pdh.requests(32, offset=3)
        client = openai.OpenAI(base_url=pd.url + "/v1", api_key="none", max_retries=0, timeout=60)
        with ThreadPoolExecutor(32) as pool:
            got = list(pool.map(lambda r: pdh.run(client, r), reqs))
        assert got == pdh.run_all(colocated.url, reqs)
        pdh.wait_idle(pd.url, ["prefill-0", "decode-0"])
    finally:
        assert pd.stop() == 0, "".join(pd.log[-30:])


def test_aborted_streams_free_nothing_early_and_everything_in_the_end(servers):
    pd, colocated = servers
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def abort_early(i: int) -> None:
        stream = client.completions.create(model="m", prompt=pdh.prompt(i), max_tokens=60, temperature=0, stream=True)
        if i % 3:
            next(iter(stream))
        stream.close()

    keep = pdh.requests(8, offset=40)
    with ThreadPoolExecutor(16) as pool:
        aborted = [pool.submit(abort_early, i) for i in range(12)]
        kept = pool.submit(pdh.run_all, pd.url, keep)
        for f in aborted:
            f.result()
        got = kept.result()
    assert got == pdh.run_all(colocated.url, keep)
    pdh.wait_idle(pd.url, ENGINES)


def test_a_prefill_engine_that_dies_fails_only_its_requests_and_the_rest_keep_serving(servers):
    pd, colocated = servers
    line = next(x for x in pd.log if "engine prefill-1 (prefill) registered" in x)
    worker_pid = int(re.search(r"worker/0=pid:(\d+)", line).group(1))  # its KV-migration actor lives there too
    reqs = [{"kind": "completion", "stream": False, "prompt": pdh.prompt(60 + i), "max_tokens": 40,
             "extra_body": {"ignore_eos": True}} for i in range(16)]
    expected = pdh.run_all(colocated.url, reqs)
    client = openai.OpenAI(base_url=pd.url + "/v1", api_key="none", max_retries=0, timeout=60)

    def run(r: dict) -> str | Exception:
        try:
            return pdh.run(client, r)
        except openai.APIError as e:
            return e

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(run, r) for r in reqs]
        time.sleep(0.05)  # some are likely at prefill-1 or migrating from it; none has to be
        os.kill(worker_pid, signal.SIGKILL)
        outcomes = [f.result() for f in futures]
    for o, e in zip(outcomes, expected):
        if isinstance(o, Exception):
            assert "prefill-1" in str(o), o  # a clear error naming the engine that died
        else:
            assert o == e
    # the decode engine's pair with the dead engine is gone; with the other prefill engine it keeps serving
    assert urllib.request.urlopen(pd.url + "/health", timeout=10).status == 200
    more = pdh.requests(8, offset=80)
    assert pdh.run_all(pd.url, more) == pdh.run_all(colocated.url, more)
    # every KV block is free again (a migration waiting on the dead engine fails within kv_transfer_timeout_s),
    # and no transfer is held: those that ended before their KVReady got the fleet's notice for the dead engine
    pdh.wait_idle(pd.url, ["prefill-0"], timeout=40)
    m = pdh.wait_idle(pd.url, ["decode-0"], timeout=40)
    assert pdh.engine_metric(m, "flotilla_engine_alive", "decode-0") == 1
    pdh.wait_restarted(pd, "prefill-1")  # the dead engine comes back (its death counted once)
