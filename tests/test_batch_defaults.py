"""max_num_seqs and max_num_batched_tokens default as vLLM's do for the GPU and for offline or serving use: the rule,
and what `flotilla serve`'s flags and the offline LLM's options build from it (the GPU stood in for where there is
none)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from flotilla.config import EngineConfig, batch_defaults
from flotilla.server import engine_client
from flotilla.server.cli import add_serve_arguments, engine_config_from_args
from helpers_tiny_models import write_tiny_qwen35_model

GIB = 2**30
H100 = (80 * GIB, "NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize(("device", "offline", "hybrid", "expected"), [
    (H100, True, False, (1024, 16384)),
    (H100, False, False, (1024, 8192)),
    ((141 * GIB, "NVIDIA H200"), True, False, (1024, 16384)),
    (H100, True, True, (256, 16384)),  # (a hybrid model's state slots: one per sequence)
    ((80 * GIB, "NVIDIA A100-SXM4-80GB"), True, False, (256, 8192)),
    ((48 * GIB, "NVIDIA L40S"), True, False, (256, 8192)),
    ((0, ""), True, False, (256, 8192)),
])
def test_the_rule_follows_vllms_by_device_and_use(device, offline, hybrid, expected):
    got = batch_defaults(*device, offline=offline, hybrid=hybrid)
    assert (got["max_num_seqs"], got["max_num_batched_tokens"]) == expected


@pytest.fixture
def on_an_h100(monkeypatch):
    monkeypatch.setattr(engine_client, "gpu_memory", lambda device: H100 if device != "cpu" else (0, ""))


def _serve_config(argv: list[str], offline: bool = False) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    return engine_config_from_args(args, args.model, offline=offline)


def _limits(config: EngineConfig) -> tuple[int, int]:
    return config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens


def test_serve_flags_left_unset_take_the_gpus_defaults_and_given_ones_stay(on_an_h100):
    assert _limits(_serve_config([])) == (1024, 8192)
    assert _limits(_serve_config([], offline=True)) == (1024, 16384)
    assert _limits(_serve_config(["--max-num-seqs", "8"])) == (8, 8192)
    assert _limits(_serve_config(["--max-num-batched-tokens", "512"], offline=True)) == (1024, 512)
    assert _limits(_serve_config(["--device", "cpu"])) == (256, 8192)


def test_on_cpu_the_configs_own_defaults_hold():
    # (this machine's GPU, if it has one, is what the engine would run on: the test asks for the CPU)
    assert _limits(_serve_config(["--device", "cpu"], offline=True)) == (256, 8192)
    assert _limits(engine_client.with_device_batch_defaults(EngineConfig.from_options(device="cpu"), (),
                                                            offline=True)) == (256, 8192)


def test_a_hybrid_model_keeps_256_sequences_on_a_large_gpu(on_an_h100, tmp_path):
    hybrid = write_tiny_qwen35_model(tmp_path / "qwen35")
    assert _limits(_serve_config([str(hybrid)], offline=True)) == (256, 16384)


def test_the_offline_llms_options_name_what_is_given(on_an_h100, monkeypatch):
    """LLM(**options) resolves the same way (options it is given win), and LLM(config=...) is taken as it is."""
    built: list[EngineConfig] = []

    class Stop(Exception):
        pass

    def capture(config, *args, **kwargs):
        built.append(config)
        raise Stop

    from flotilla import llm

    monkeypatch.setattr(llm, "EngineClient", capture)
    for options in ({}, {"max_num_seqs": 64}):
        with pytest.raises(Stop):
            llm.LLM(placement="inline", **options)
    with pytest.raises(Stop):
        llm.LLM(placement="inline", config=EngineConfig())
    assert [_limits(c) for c in built] == [(1024, 16384), (64, 16384), (256, 8192)]


def test_the_gpu_read_is_the_one_the_worker_will_run_on(monkeypatch):
    """auto and cuda mean the first GPU, cuda:N the Nth; cpu, or no GPU at all, reads none."""
    import torch

    read: list[int] = []

    class Props:
        total_memory, name = 80 * GIB, "NVIDIA H100 80GB HBM3"

    monkeypatch.setattr(engine_client, "gpu_driver_present", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: read.append(index) or Props())
    for device in ("auto", "cuda", "cuda:1"):
        assert engine_client.gpu_memory(device) == H100
    assert engine_client.gpu_memory("cpu") == (0, "") and read == [0, 0, 1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert engine_client.gpu_memory("auto") == (0, "") and read == [0, 0, 1]


def test_a_machine_without_a_gpu_driver_learns_it_has_no_gpu_without_importing_torch():
    """The front end reads the GPU for these defaults; where no driver's files are, torch (~1.6 s of CPU) stays out of
    its process."""
    code = ("import sys; from flotilla.server import engine_client as e; e.GPU_DRIVER_FILES = ('/nonexistent',); "
            "assert e.gpu_memory('auto') == (0, ''), 'a GPU read'; assert 'torch' not in sys.modules, 'torch imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
