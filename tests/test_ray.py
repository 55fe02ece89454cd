"""Ray placement on a real two-node Ray cluster started by the test (ray.cluster_utils: two raylets on this
machine, four CPUs each): an engine whose processes are Ray actors gives the local engine's greedy tokens, with
tensor parallelism across the nodes; a prefill engine and a decode engine placed by Ray on two nodes, each with a
front end of its own sharing a Redis registry, answer as one engine does; a Ray actor
that is killed ends the requests in flight with an error naming it, and the engine's teardown gives everything
back to the cluster."""

from __future__ import annotations

import re
import threading
import time

import pytest
from flotilla import LLM, SamplingParams
from helpers_engine import write_tiny_tokenizer
from helpers_optional import needs, require
from helpers_server import cluster_key
from helpers_tiny_models import random_tokens, write_tiny_model

ray = require("ray", "Ray placement's tests run a real Ray cluster")

pytestmark = pytest.mark.slow
CPUS_PER_NODE = 4
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    """The cluster key: Ray's nodes listen on this machine's address, beyond loopback, so the control plane
    authenticates (in this process, its Ray actors, and a served front end given --auth-key-file)."""
    with cluster_key(tmp_path_factory.mktemp("key") / "cluster.key") as path:
        yield path


@pytest.fixture(scope="module")
def cluster(key_file):
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": CPUS_PER_NODE, "include_dashboard": False})
    c.add_node(num_cpus=CPUS_PER_NODE)
    c.wait_for_nodes()
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = write_tiny_model(tmp_path_factory.mktemp("ray") / "m", "qwen3")
    write_tiny_tokenizer(d, vocab_size=320)
    return d


@pytest.fixture(scope="module")
def prompts():
    return [random_tokens(n, seed=n) for n in (5, 17, 30)]


@pytest.fixture(scope="module")
def local(folder, prompts):
    with LLM(str(folder), block_size=4, kv_cache_blocks=128) as llm:
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS,
                                                             use_tqdm=False)]


def test_a_tensor_parallel_engine_placed_by_ray_across_two_nodes_gives_the_local_tokens(cluster, folder, prompts,
                                                                                       local):
    with LLM(str(folder), distributed_executor_backend="ray", ray_address=cluster.address, tensor_parallel_size=2,
             block_size=4, kv_cache_blocks=128) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        hosts = llm.client.runtime.ray.hosts
        # five processes of one CPU each (tokenizer, scheduler, two workers, detokenizer) on nodes of four: both
        assert len(hosts) == 5 and len({h.node for h in hosts}) == 2
        assert {k for h in hosts for k in h.keys} >= {"worker/0", "worker/1", "scheduler/0"}
    assert [o.outputs[0].token_ids for o in outs] == local
    assert ray.util.placement_group_table() and all(pg["state"] == "REMOVED"
                                                    for pg in ray.util.placement_group_table().values())


def test_a_killed_ray_actor_ends_the_requests_in_flight_with_its_name_and_the_engine_is_placed_again(
        cluster, folder, prompts, local):
    from flotilla.server.engine_client import EngineDeadError, RequestFailed

    with LLM(str(folder), distributed_executor_backend="ray", ray_address=cluster.address, block_size=4,
             kv_cache_blocks=128) as llm:
        llm.client.max_restarts, llm.client.restart_backoff_s = 1, 0.1  # (flotilla serve's --engine-restarts)
        first = llm.client.runtime
        worker = next(h for h in first.ray.hosts if "worker" in h.names)
        failure: list[BaseException] = []

        def generate() -> None:
            try:
                llm.generate([{"prompt_token_ids": random_tokens(9, seed=i)} for i in range(64)],
                             SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True), use_tqdm=False)
            except BaseException as e:  # noqa: BLE001
                failure.append(e)

        thread = threading.Thread(target=generate)
        thread.start()
        deadline = time.monotonic() + 30
        while (llm.client.stats is None or not llm.client.stats.num_running) and time.monotonic() < deadline:
            time.sleep(0.05)  # (until the scheduler reports sequences running)
        assert llm.client.stats.num_running, "no sequence started"
        started = time.monotonic()
        ray.kill(worker.handle)
        thread.join(timeout=30)
        assert not thread.is_alive(), "the request hung after its worker died"
        assert time.monotonic() - started < 20
        assert failure and isinstance(failure[0], EngineDeadError | RequestFailed)
        assert "worker/0" in str(failure[0]) and "Ray actor died" in str(failure[0])
        deadline = time.monotonic() + 60
        while not (llm.client.alive and llm.client.runtime is not first) and time.monotonic() < deadline:
            time.sleep(0.05)  # (the failed engine's placement group goes, a new one is placed)
        assert llm.client.alive and llm.client.restarts == 1
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == local
        groups = list(ray.util.placement_group_table().values())
        assert sum(pg["state"] == "CREATED" for pg in groups) == 1, groups


def test_a_host_actor_picks_its_ports_below_the_ephemeral_range_and_its_errors_name_their_cause(cluster):
    """A host's ports come from below the range outgoing connections take theirs from (which could take one before
    the actor binds it); what a host's run raises is the failure's reason, not only Ray's wrapper."""
    from flotilla.actors.ray_placement import RayHost, ray_failure
    from flotilla.transport import endpoints

    ray.init(address=cluster.address, ignore_reinit_error=True, include_dashboard=False)
    host = ray.remote(RayHost).options(num_cpus=1).remote()
    try:
        _, _, ports = ray.get(host.node.remote(6))
        assert len(set(ports)) == 6
        assert all(endpoints.FIRST_FREE_PORT <= p < endpoints._ephemeral_start() for p in ports), ports
        with pytest.raises(ray.exceptions.RayTaskError) as failed:
            ray.get(host.run.remote("not a topology", "{}", "worker", 0, False, False, "INFO", "off", None))
        assert re.fullmatch(r"its Ray actor failed \(\w*DecodeError: .+\)", ray_failure(failed.value))
    finally:
        ray.kill(host)
    assert ray_failure(ray.exceptions.RayActorError()).startswith("its Ray actor died (RayActorError: ")


DRIVER = """
import asyncio, signal, sys, time
import ray
from flotilla.actors.ray_placement import exit_if_connected, keep_signal_handlers

async def main():
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await asyncio.to_thread(ray.init, address=sys.argv[1], include_dashboard=False, configure_logging=False)
    keep_signal_handlers()
    print("connected", flush=True)
    await stop.wait()
    time.sleep(4)  # (a graceful stop longer than the 3 s abort that abseil's handler arms)
    print("stopped", flush=True)

asyncio.run(main())
exit_if_connected(0)
"""


def test_a_driver_connected_to_ray_takes_sigterm_as_its_own_however_long_it_stops(cluster, tmp_path):
    """A front end connects to Ray from a thread, its SIGTERM handler set by its event loop: once connected, a SIGTERM
    reaches that handler and a stop of 4 s ends cleanly (behind Ray's abseil handler, which a connection puts in
    front of it, the process aborted 3 s after the signal)."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), cluster.address], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        lines = iter(proc.stdout.readline, "")
        assert any(line.strip() == "connected" for line in lines)  # (after Ray's own lines)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0 and "stopped" in out, (proc.returncode, out[-2000:])
    finally:
        proc.kill()


def test_flotilla_launch_places_a_topology_on_the_cluster_and_sigterm_gives_it_back(cluster, key_file, tmp_path):
    """`flotilla launch` of a topology with placement ray (the relay and echoes of the pingpong example), its cluster
    from --ray-address: every actor ready in a Ray host process of its own; SIGTERM stops them and frees the
    placement group."""
    import signal

    from test_launch import flotilla, pids_from_table, read_until

    path = tmp_path / "ray.toml"
    path.write_text('name = "pp"\nplacement = "ray"\n\n[[actors]]\nname = "relay"\nkind = "relay"\n'
                    'config = { peer = "echo" }\n\n[[actors]]\nname = "echo"\nkind = "echo"\ncount = 2\n')
    proc = flotilla("launch", str(path), "--ray-address", cluster.address, "--auth-key-file", str(key_file))
    try:
        out = read_until(proc, r"^relay/0\s", timeout=120)  # (the table's last row, after "ready: 3 actor(s)")
        assert "ready: 3 actor" in out
        pids = pids_from_table(out)
        assert set(pids) == {"relay/0", "echo/0", "echo/1"} and len(set(pids.values())) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    deadline = time.monotonic() + 20
    while any(pg["state"] != "REMOVED" for pg in ray.util.placement_group_table().values()):
        assert time.monotonic() < deadline, ray.util.placement_group_table()
        time.sleep(0.1)


@needs("openai", "the front ends are asked through the real openai client")
@needs("dlslime", "the KV data plane's TCP transport (and Debian's libibverbs1)")
def test_front_ends_sharing_a_redis_registry_route_to_each_others_ray_placed_engines(cluster, folder, key_file):
    """Two nodes' front ends, each with one engine placed by Ray (a's prefill, b's decode), share a real Redis
    registry: what the engines register there are their Ray nodes' addresses, which the other front end reaches,
    so each front end serves through both engines and gives the colocated outputs. Each engine is packed on one node
    (STRICT_PACK: four processes, a node's four CPUs), so the pair spans both and the KV moves between the nodes'
    data planes over dlslime."""
    import helpers_pd as pdh
    from helpers_server import start_server, start_servers

    with pdh.redis_server() as url:
        if url is None:
            pytest.skip("needs redis-server and the redis client (the registry both nodes share)")
        common = ["--block-size", "4", "--kv-cache-blocks", "160", "--max-num-seqs", "8", "--served-model-name", "m"]

        def node(name: str, engines: str) -> list[str]:
            return [str(folder), "--engines", engines, "--registry", url, "--node-name", name,
                    "--kv-transfer-backend", "dlslime_tcp", "--distributed-executor-backend", "ray",
                    "--ray-address", cluster.address, "--ray-placement-strategy", "STRICT_PACK",
                    "--auth-key-file", str(key_file), *common]

        a = start_server(*node("a", "prefill"), timeout=300)
        try:
            b, colocated = start_servers((node("b", "decode"), {"timeout": 300}),
                                         ((str(folder), "--single-process", *common), {"timeout": 180}))
            try:
                for front in (a, b):
                    pdh.wait_health(front.url, 200, timeout=30)
                reqs = pdh.requests(8, offset=5)
                want = pdh.run_all(colocated.url, reqs)
                assert pdh.run_all(a.url, reqs) == want and pdh.run_all(b.url, reqs) == want
                assert any("routing to engine b-decode-0 (decode) of another node" in x for x in a.log)
                assert any("routing to engine a-prefill-0 (prefill) of another node" in x for x in b.log)
                m = pdh.wait_idle(b.url, ["b-decode-0"])
                assert pdh.engine_metric(m, "flotilla_kv_migration_bytes_total", "b-decode-0") > 0
                placed = {line.split(" placed by Ray")[0].split()[-1]: re.findall(r"node (\w+) ", line)
                          for front in (a, b) for line in front.log if " placed by Ray (STRICT_PACK)" in line}
                assert placed.keys() == {"a-prefill-0", "b-decode-0"} and all(len(v) == 1 for v in placed.values())
                assert placed["a-prefill-0"] != placed["b-decode-0"], placed
            finally:
                colocated.stop()
                assert b.stop() == 0, "".join(b.log[-30:])
        finally:
            assert a.stop() == 0, "".join(a.log[-30:])
