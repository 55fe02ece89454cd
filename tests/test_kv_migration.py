"""KVMigrationActor's memory seam: what the data plane may register, and the honest refusal of GPU KV."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from flotilla.actors.kv_migration import KVMemory
from flotilla.transport.kv_transfer import KVTransferError
from flotilla.transport.endpoints import free_tcp_port


def _caches(device: str = "cpu", layers: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(9, 2, 4, 2, 8, device=device) for _ in range(layers)]


def test_a_cpu_kv_cache_is_one_region_per_layer_with_its_block_bytes():
    mem = KVMemory.of_runner(_caches(), "dlslime_tcp")
    assert len(mem.caches) == 2 and mem.block_bytes == 2 * 4 * 2 * 8 * 4


def test_a_device_kv_cache_over_dlslime_tcp_is_refused_at_start_with_the_reason():
    # "meta" stands in for cuda here: any non-CPU cache needs staging that is not built
    with pytest.raises(KVTransferError, match="CPU memory only: GPU KV migration .* not implemented"):
        KVMemory.of_runner(_caches("meta"), "dlslime_tcp")
    assert KVMemory.of_runner(_caches("meta"), "local").block_bytes > 0  # a local copy handles device tensors


def test_layers_with_different_block_sizes_are_refused():
    with pytest.raises(ValueError, match="same block size"):
        KVMemory([torch.zeros(9, 2, 4, 2, 8), torch.zeros(9, 2, 4, 2, 4)])


def test_serve_refuses_a_lone_prefill_engine_and_points_to_engines():
    out = subprocess.run([sys.executable, "-m", "flotilla", "serve", "--role", "prefill", "--port",
                          str(free_tcp_port())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--engines prefill,decode" in out.stderr
    out = subprocess.run([sys.executable, "-m", "flotilla", "serve", "--engines", "prefill,both", "--port",
                          str(free_tcp_port())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "prefill engines need decode engines" in out.stderr
