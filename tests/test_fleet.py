"""Several colocated engines behind one front end: the router spreads requests (data parallelism)."""

from __future__ import annotations

import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers_engine import write_tiny_engine_model
from helpers_optional import needs, optional
from helpers_server import start_server

openai = optional("openai")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_tiny_engine_model(tmp_path_factory.mktemp("dp") / "m")
    srv = start_server(str(model), "--engines", "both,both", "--single-process", "--block-size", "4",
                       "--kv-cache-blocks", "64", timeout=120)
    yield srv
    assert srv.stop() == 0


@needs("openai", "the test talks to the server through the real openai client")
def test_two_colocated_engines_share_the_load_and_answer_alike(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    prompts = ["The quick brown fox", "What is the capital of France?"] * 8

    def run(p: str) -> str:
        return client.completions.create(model="m", prompt=p, max_tokens=10, temperature=0).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(run, prompts))
    assert len({o for o, p in zip(outs, prompts) if p == prompts[0]}) == 1  # whichever engine ran it
    assert len({o for o, p in zip(outs, prompts) if p == prompts[1]}) == 1
    text = urllib.request.urlopen(server.url + "/metrics", timeout=10).read().decode()
    routed = {line.split('engine="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("flotilla_engine_requests_routed_total{")}
    assert set(routed) == {"engine-0", "engine-1"} and sum(routed.values()) == len(prompts)
    assert min(routed.values()) >= 4, routed  # least loaded first: neither engine took (almost) everything


def test_an_unreachable_registry_is_a_clear_error_before_any_model_loads(tmp_path):
    import subprocess
    import sys

    from flotilla.transport.endpoints import free_tcp_port

    port = free_tcp_port()  # nothing listens there
    out = subprocess.run([sys.executable, "-m", "flotilla", "serve", "--engines", "both", "--registry",
                          f"redis://127.0.0.1:{port}/0", "--port", str(free_tcp_port())],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and f"cannot reach the registry redis://127.0.0.1:{port}/0" in out.stderr
    assert "Traceback" not in out.stderr and "loaded" not in out.stderr  # checked before the engines start


def test_each_engine_of_a_fleet_gets_its_own_gpus_when_there_are_enough(monkeypatch):
    import torch

    from flotilla.config import EngineConfig
    from flotilla.server import engine_client
    from flotilla.server.cli import fleet_engines

    monkeypatch.setattr(engine_client, "gpu_driver_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)

    def devices(spec, **opts):
        return [cfg.worker.device for _, cfg in fleet_engines(spec, EngineConfig.from_options(**opts), None)]

    assert devices("prefill,decode") == ["cuda:0", "cuda:1"]
    assert devices("prefill,decode", device="cuda:2") == ["cuda:2", "cuda:3"]
    assert devices("prefill,decode", tensor_parallel_size=2) == ["cuda:0", "cuda:2"]
    assert devices("both,both,both", tensor_parallel_size=2) == ["auto"] * 3  # 6 GPUs wanted, 4 there: shared
    assert devices("prefill,decode", device="cpu") == ["cpu", "cpu"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert devices("prefill,decode") == ["auto", "auto"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_client, "gpu_driver_present", lambda: False)  # (no driver: torch is not asked)
    assert devices("prefill,decode") == ["auto", "auto"]


def test_engines_beside_an_encoder_engine_read_its_embeddings_and_an_encoder_alone_is_refused():
    from flotilla.config import EngineConfig
    from flotilla.server.cli import fleet_engines

    engines = fleet_engines("encoder,prefill,decode", EngineConfig(), None)
    assert [(n, c.disagg.role, c.worker.image_encoder) for n, c in engines] == [
        ("encoder-0", "encoder", "step"), ("prefill-0", "prefill", "remote"), ("decode-0", "decode", "remote")]
    with pytest.raises(ValueError, match="encoder engines run the vision tower for other engines' prefills"):
        fleet_engines("encoder", EngineConfig(), None)
    with pytest.raises(ValueError, match="roles prefill, decode, both or encoder"):
        fleet_engines("vision", EngineConfig(), None)


def test_request_ids_of_two_front_ends_started_alike_differ(monkeypatch):
    """Front ends of several nodes send requests to the same engines, and an engine refuses an id it already runs:
    two fleets with the same pid and start second (containers started together) still mint different ids."""
    import os as os_mod
    import time as time_mod

    from flotilla.config import EngineConfig
    from flotilla.server.fleet import Fleet

    monkeypatch.setattr(os_mod, "getpid", lambda: 7)
    monkeypatch.setattr(time_mod, "time", lambda: 1_800_000_000.0)
    config = EngineConfig.from_options()
    a, b = (Fleet([("engine-0", config)], "m") for _ in range(2))
    assert a.new_rid() != b.new_rid()
