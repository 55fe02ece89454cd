"""The cuda_ipc KV data plane (transport/kv_transfer_cuda_ipc.py): on a GPU, another process's registered memory
read through its CUDA IPC handle (scattered ranges, a region that starts inside its storage, bounds, another host
refused), the migration actor moving GPU blocks with it, and a prefill engine and a decode engine in two processes
on one GPU answering as a colocated engine does; on CPU, its refusals and its place in the configuration."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import msgspec
import pytest
import torch

from flotilla.actors.kv_memory import KVMemory
from flotilla.config import DisaggConfig, EngineConfig
from flotilla.transport.codec import Decoder, Encoder
from flotilla.transport.kv_transfer import KVTransferError, create_kv_transfer_engine
from flotilla.transport.data_plane import CudaIpcHandle, EndpointInfo, RegionInfo
from flotilla.transport.messages import KVEndpointEvent

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

EXPORTER = r"""
import sys, msgspec, torch
from flotilla.transport.kv_transfer_cuda_ipc import CudaIpcEngine
n, skip = int(sys.argv[1]), int(sys.argv[2])
backing = ((torch.arange(n + skip, device="cuda") * 7 + 3) % 251).to(torch.uint8)
engine = CudaIpcEngine(host="127.0.0.1")
region = engine.register("kv", backing[skip:])  # a region that starts inside its storage
torch.cuda.synchronize()
print(msgspec.json.encode([engine.endpoint_info(), region]).decode(), flush=True)
sys.stdin.readline()  # serve until the reader is done
engine.close()
"""


def _pattern(n: int, skip: int) -> torch.Tensor:
    return ((torch.arange(n + skip) * 7 + 3) % 251).to(torch.uint8)[skip:]


def test_without_a_gpu_cuda_ipc_is_refused_with_the_reason():
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device (the refusal is a CPU machine's)")
    with pytest.raises(KVTransferError, match="needs a CUDA device"):
        create_kv_transfer_engine("cuda_ipc")


def test_cuda_ipc_reads_the_cache_itself_never_through_staging():
    config = DisaggConfig(kv_transfer_backend="cuda_ipc")
    assert not KVMemory([torch.empty(4, 2, 4, 2, 8, device="meta")]).needs_staging(config)
    with pytest.raises(ValueError, match="kv_staging=always does not apply to cuda_ipc"):
        DisaggConfig(kv_transfer_backend="cuda_ipc", kv_staging="always")
    assert EngineConfig.from_options(kv_transfer_backend="cuda_ipc").disagg.kv_transfer_backend == "cuda_ipc"


def test_a_region_and_its_ipc_handle_cross_the_control_plane_unchanged():
    ipc = CudaIpcHandle(device_uuid="GPU-1234", handle=bytes(range(64)), storage_bytes=1 << 30, storage_offset=512,
                        offset=4096, ref_counter=b"/torch_1_2", ref_counter_offset=3)
    event = KVEndpointEvent(rank=0, key="k", endpoint=EndpointInfo(backend="cuda_ipc", engine_id="e", host_id="b"),
                            regions=[RegionInfo(name="kv.layer0", engine_id="e", backend="cuda_ipc", length=8192,
                                                addr=77, ipc=ipc)], block_bytes=512)
    back = Decoder().decode(Encoder().encode(event))
    assert back.regions[0].ipc == ipc and back.endpoint.host_id == "b" and back.regions[0].length == 8192


@pytest.mark.gpu
@needs_cuda
def test_another_process_gpu_memory_is_read_through_its_ipc_handle():
    from flotilla.transport.kv_transfer_cuda_ipc import CudaIpcEngine

    n, skip = 1 << 20, 4096 + 64
    exporter = subprocess.Popen([sys.executable, "-c", EXPORTER, str(n), str(skip)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
    try:
        line = exporter.stdout.readline()
        assert line, f"the exporting process ended ({exporter.wait(30)})"
        endpoint, region = msgspec.json.decode(line, type=tuple[EndpointInfo, RegionInfo])
        assert region.ipc is not None and region.ipc.offset > 0
        with CudaIpcEngine() as engine:
            local = torch.zeros(n, dtype=torch.uint8, device="cuda")
            mine = engine.register("dst", local)
            with pytest.raises(KVTransferError, match="not connected"):
                asyncio.run(engine.read(region, [(0, 0, 16)], mine))
            engine.connect(endpoint)
            # 40 scattered ranges (two calls of at most 32), two of them adjacent on both sides (merged)
            ranges = [(i * 20_000, (i * 37 % 50) * 20_000 + 5, 19_000) for i in range(40)]
            ranges += [(900_000, 300_000, 1000), (901_000, 301_000, 1000)]
            asyncio.run(engine.read(region, ranges, mine))
            expected, want = _pattern(n, skip), torch.zeros(n, dtype=torch.uint8)
            for lo, ro, length in ranges:
                want[lo : lo + length] = expected[ro : ro + length]
            assert torch.equal(local.cpu(), want)
            assert engine.bytes_read == sum(length for _, _, length in ranges)
            with pytest.raises(KVTransferError, match="leaves remote region"):
                asyncio.run(engine.read(region, [(0, n - 8, 16)], mine))
            with pytest.raises(KVTransferError, match="another host"):
                engine.connect(msgspec.structs.replace(endpoint, engine_id="elsewhere", host_id="other-boot-id"))
            with pytest.raises(KVTransferError, match="GPU memory only"):
                engine.register("host", torch.zeros(16, dtype=torch.uint8))
    finally:
        exporter.stdin.write("\n")
        exporter.stdin.flush()
        assert exporter.wait(30) == 0


@pytest.mark.gpu
@needs_cuda
def test_the_migration_actor_moves_gpu_blocks_with_cuda_ipc():
    from test_kv_migration import BS, DIM, HEADS, LAYERS, NUM_BLOCKS, _cmd, _migrate
    import uvloop

    pairs = (list(range(1, 81, 2)), list(range(90, 50, -1)))
    pre, dec, done = uvloop.run(_migrate("cuda_ipc", lambda src: [_cmd("a", src, *pairs)],
                                         devices=("cuda", "cuda")))
    assert done[0].error is None and done[0].num_bytes == 40 * LAYERS * 2 * BS * HEADS * DIM * 4
    moved = dict(zip(pairs[1], pairs[0]))
    for p, d in zip(pre, dec):
        for dst in range(NUM_BLOCKS + 1):
            assert torch.equal(d[dst], p[moved[dst]]) if dst in moved else not d[dst].any(), dst


@pytest.mark.gpu
@needs_cuda
def test_a_prefill_and_a_decode_engine_sharing_one_gpu_answer_as_a_colocated_engine(tmp_path):
    """Two engine processes on one GPU, each sizing its KV cache from its own share of the memory (a colocated
    server holds a third share meanwhile), KV moved device to device through CUDA IPC."""
    import helpers_pd as pdh
    from helpers_engine import write_tiny_engine_model

    model = write_tiny_engine_model(tmp_path / "m")
    common = ["--device", "cuda", "--dtype", "float32", "--block-size", "16", "--max-num-seqs", "16",
              "--max-model-len", "256", "--gpu-memory-utilization", "0.1"]
    pdh.check_pair_equals_colocated(str(model), common, backend="cuda_ipc", timeout=600)
