"""KV data plane: range math, the same-process copy engine, and dlslime TCP between two real processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch
from flotilla.transport.kv_transfer import (
    MAX_RANGES_PER_CALL,
    MIN_GATHER_UNIT,
    EndpointInfo,
    KVTransferError,
    LocalCopyEngine,
    RegionInfo,
    copy_ranges,
    create_kv_transfer_engine,
    kv_block_bytes,
    kv_block_ranges,
    kv_block_table,
    kv_layer_offsets,
    merge_ranges,
    merge_table,
    plan_reads,
    split_ranges,
    validate_ranges,
)
from helpers_optional import require


def _region(name: str, length: int) -> RegionInfo:
    return RegionInfo(name=name, engine_id="e", backend="local", length=length)


# ---------------------------------------------------------------------------------------------
# range math


def test_merge_joins_only_ranges_adjacent_on_both_sides() -> None:
    ranges = [(200, 1200, 50), (0, 1000, 100), (100, 1100, 100), (300, 1250, 10), (310, 5000, 10)]
    assert merge_ranges(ranges) == [(0, 1000, 250), (300, 1250, 10), (310, 5000, 10)]
    # local adjacency alone is not enough: (250..) follows (200, 1200, 50) locally but not remotely
    assert merge_ranges([(200, 1200, 50), (250, 1300, 50)]) == [(200, 1200, 50), (250, 1300, 50)]
    assert merge_ranges([]) == []


def test_split_and_plan_never_exceed_the_per_call_limit() -> None:
    ranges = [(i * 20, i * 30, 10) for i in range(70)]  # no two adjacent: nothing merges
    calls = split_ranges(ranges)
    assert [len(c) for c in calls] == [32, 32, 6]
    assert [r for c in calls for r in c] == ranges
    planned = plan_reads(ranges, _region("l", 70 * 20), _region("r", 70 * 30))
    assert all(len(c) <= MAX_RANGES_PER_CALL for c in planned)
    assert sum(len(c) for c in planned) == 70
    adjacent = [(i * 10, i * 10, 10) for i in range(100)]
    assert plan_reads(adjacent, _region("l", 1000), _region("r", 1000)) == [[(0, 0, 1000)]]
    with pytest.raises(ValueError):
        split_ranges(ranges, 0)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ((90, 0, 20), r"range #1 \(local_offset=90, remote_offset=0, length=20\) leaves local region 'l' of 100"),
        ((0, 190, 20), r"range #1 \(local_offset=0, remote_offset=190, length=20\) leaves remote region 'r' of 200"),
        ((0, 0, 0), r"range #1 .*length must be positive"),
        ((-1, 0, 5), r"range #1 .*must not be negative"),
    ],
)
def test_validation_names_the_bad_range(bad: tuple[int, int, int], message: str) -> None:
    with pytest.raises(KVTransferError, match=message):
        validate_ranges([(0, 0, 10), bad, (20, 20, 10)], _region("l", 100), _region("r", 200))


def test_block_ranges_merge_consecutive_blocks_per_layer() -> None:
    pairs = [(9, 3), (0, 5), (2, 7), (1, 6), (4, 8)]  # src 0,1,2 -> dst 5,6,7 is one run; 4->8 and 9->3 alone
    ranges = kv_block_ranges(pairs, local_layer_offsets=[0, 10_000], remote_layer_offsets=[0, 20_000], block_bytes=100)
    assert ranges == [
        (500, 0, 300), (800, 400, 100), (300, 900, 100),
        (10_500, 20_000, 300), (10_800, 20_400, 100), (10_300, 20_900, 100),
    ]  # fmt: skip
    with pytest.raises(KVTransferError, match="negative block id"):
        kv_block_ranges([(-1, 0)], [0], [0], 100)
    with pytest.raises(ValueError):
        kv_block_ranges([(0, 0)], [0, 1], [0], 100)
    # the same ranges as an array, built at once (the KV-migration actor's), and planned at once
    table = kv_block_table(pairs, [0, 10_000], [0, 20_000], 100)
    assert table.dtype == np.int64 and sorted(map(tuple, table.tolist())) == sorted(ranges)
    with pytest.raises(KVTransferError, match="negative block id"):
        kv_block_table([(-1, 0)], [0], [0], 100)
    rng = np.random.default_rng(1)
    many = [(int(s), int(d)) for s, d in zip(rng.permutation(64)[:40], rng.permutation(64)[:40])]
    many += [(70 + i, 80 + i) for i in range(5)]  # a run
    listed = kv_block_ranges(many, [0, 9_000], [0, 9_000], 100)
    local, remote = _region("l", 18_000), _region("r", 18_000)
    assert [list(map(tuple, c.tolist())) for c in plan_reads(kv_block_table(many, [0, 9_000], [0, 9_000], 100), local,
                                                             remote, 16)] == plan_reads(listed, local, remote, 16)
    assert merge_table(np.asarray(listed)).tolist() == [list(r) for r in merge_ranges(listed)]
    with pytest.raises(KVTransferError, match=r"range #\d+ .* leaves local region"):
        plan_reads(kv_block_table(many, [0, 9_000], [0, 9_000], 250), local, remote)


# ---------------------------------------------------------------------------------------------
# LocalCopyEngine on the real KV layout


def _kv_caches(num_layers: int, num_blocks: int, fill: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """All layers in one allocation, one [num_blocks, 2, block_size, kv_heads, head_dim] view per layer."""
    shape = (num_layers, num_blocks, 2, 4, 2, 8)
    storage = torch.randn(shape, dtype=torch.float16) if fill else torch.zeros(shape, dtype=torch.float16)
    return storage, [storage[layer] for layer in range(num_layers)]


@pytest.mark.parametrize("unit", [4096, 1024 + 256, 40, 3])  # (8-byte words; bytes; below the gather's unit)
def test_copy_ranges_moves_exactly_the_ranges_in_one_gather_or_one_copy_each(unit: int, monkeypatch) -> None:
    rng = np.random.default_rng(unit)
    src = torch.from_numpy(rng.integers(0, 256, 64 * unit, dtype=np.uint8))
    dst = torch.zeros(48 * unit + 5, dtype=torch.uint8)  # (a length that is no multiple of the unit)
    # blocks of one or two units at even unit indices: disjoint, in scattered order, some merged where they run on
    pairs = zip(2 * rng.permutation(24)[:16], 2 * rng.permutation(32)[:16], rng.integers(1, 3, 16))
    ranges = merge_ranges([(int(d) * unit, int(s) * unit, int(n) * unit) for d, s, n in pairs])
    want = dst.clone()
    for d, s, n in ranges:
        want[d:d + n] = src[s:s + n]
    gathers = []
    real = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda self, *a: gathers.append(1) or real(self, *a))
    copy_ranges(dst, src, ranges)
    assert torch.equal(dst, want)
    assert len(gathers) == (1 if unit >= MIN_GATHER_UNIT else 0)


@pytest.mark.parametrize("build", [kv_block_ranges, kv_block_table])  # (ranges as tuples, or as one array)
def test_local_copy_engine_copies_exactly_the_requested_blocks(build) -> None:
    src_storage, src_layers = _kv_caches(3, 16, fill=True)
    dst_storage, dst_layers = _kv_caches(3, 12, fill=False)
    prefill, decode = LocalCopyEngine(), LocalCopyEngine()
    with prefill, decode:
        remote = prefill.register("kv", src_storage)
        local = decode.register("kv", dst_storage)
        decode.connect(prefill.endpoint_info())
        pairs = [(3, 0), (4, 1), (5, 2), (10, 7), (0, 11), (15, 5)]
        ranges = build(
            pairs,
            kv_layer_offsets(dst_layers, dst_storage.data_ptr()),
            kv_layer_offsets(src_layers, src_storage.data_ptr()),
            kv_block_bytes(src_layers[0]),
        )
        asyncio.run(decode.read(remote, ranges, local))
        copied = {dst for _, dst in pairs}
        for layer in range(3):
            for src, dst in pairs:
                assert torch.equal(dst_layers[layer][dst], src_layers[layer][src])
            for dst in set(range(12)) - copied:
                assert not dst_layers[layer][dst].any(), f"block {dst} of layer {layer} was written"
        assert decode.bytes_read == len(pairs) * 3 * kv_block_bytes(src_layers[0])


def test_local_copy_engine_errors() -> None:
    prefill, decode = LocalCopyEngine(), LocalCopyEngine()
    remote = prefill.register("kv", torch.ones(64, dtype=torch.uint8))
    local = decode.register("kv", np.zeros(32, dtype=np.uint8))
    with pytest.raises(KVTransferError, match="already registered"):
        decode.register("kv", bytearray(8))
    with pytest.raises(KVTransferError, match="not connected"):
        asyncio.run(decode.read(remote, [(0, 0, 8)], local))
    decode.connect(prefill.endpoint_info())
    with pytest.raises(KVTransferError, match="leaves local region 'kv' of 32"):
        asyncio.run(decode.read(remote, [(0, 0, 8), (30, 0, 8)], local))
    asyncio.run(decode.read(remote, [(0, 8, 8)], "kv"))
    assert decode._regions["kv"][1][:8].tolist() == [1] * 8
    prefill.close()
    with pytest.raises(KVTransferError, match="gone"):
        asyncio.run(decode.read(remote, [(0, 0, 8)], local))
    with pytest.raises(KVTransferError, match="not in this process"):
        decode.connect(prefill.endpoint_info())
    decode.close()
    with pytest.raises(KVTransferError, match="closed"):
        decode.register("x", bytearray(8))
    with pytest.raises(KVTransferError, match="unknown KV transfer backend"):
        create_kv_transfer_engine("carrier-pigeon")


def test_messages_round_trip_over_msgpack() -> None:
    info = EndpointInfo(backend="dlslime_tcp", engine_id="x", host="10.0.0.2", port=5555)
    region = RegionInfo(name="kv", engine_id="x", backend="dlslime_tcp", length=1 << 30, addr=0x7F0000001000)
    wire = msgspec.msgpack.encode((info, region))
    assert msgspec.msgpack.decode(wire, type=tuple[EndpointInfo, RegionInfo]) == (info, region)


# ---------------------------------------------------------------------------------------------
# dlslime TCP between two real processes

PEER_SIZE = 1 << 20
PEER_SEED = 1234

# The peer: registers a buffer of seeded random bytes, prints its endpoint and region, serves until stdin closes.
PEER_SCRIPT = """
import sys
import msgspec, numpy as np
from flotilla.transport.kv_transfer import create_kv_transfer_engine
engine = create_kv_transfer_engine("dlslime_tcp", host="127.0.0.1")
data = np.random.default_rng(int(sys.argv[2])).integers(0, 256, int(sys.argv[1]), dtype=np.uint8)
region = engine.register("kv", data)
sys.stdout.write(msgspec.json.encode([engine.endpoint_info(), region]).decode() + "\\n")
sys.stdout.flush()
sys.stdin.read()
engine.close()
"""


@pytest.fixture
def peer(tmp_path: os.PathLike[str]) -> Iterator[tuple[subprocess.Popen[bytes], EndpointInfo, RegionInfo]]:
    require("dlslime", "the dlslime TCP tests need dlslime (optional extra `pd`) and Debian's libibverbs1")
    proc = subprocess.Popen(
        [sys.executable, "-c", PEER_SCRIPT, str(PEER_SIZE), str(PEER_SEED)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=tmp_path,  # keep the checkout's top-level modules from shadowing the standard library
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, f"peer exited with {proc.wait(10)} before announcing itself"
        info, region = msgspec.json.decode(line, type=tuple[EndpointInfo, RegionInfo])
        yield proc, info, region
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(10)


def test_dlslime_reads_scattered_blocks_from_another_process(peer) -> None:
    _, info, remote = peer
    expected = np.random.default_rng(PEER_SEED).integers(0, 256, PEER_SIZE, dtype=np.uint8)
    local_buf = np.zeros(PEER_SIZE // 2, dtype=np.uint8)
    block = 4096
    # 40 scattered single blocks (remote order shuffled) plus a run of 6 adjacent ones: > 32 ranges after merging
    rng = np.random.default_rng(7)
    remote_blocks = rng.permutation(PEER_SIZE // block)[:40]
    ranges = [(2 * i * block, int(b) * block, block) for i, b in enumerate(remote_blocks)]
    ranges += [(100 * block + i * block, 200 * block + i * block, block) for i in range(6)]
    ranges.append((127 * block + 5, 3, 1000))  # unaligned
    engine = create_kv_transfer_engine("dlslime_tcp", host="127.0.0.1", timeout_s=10.0)
    with engine:
        local = engine.register("kv", local_buf)
        engine.connect(info)
        assert len(plan_reads(ranges, local, remote)) == 2
        asyncio.run(engine.read(remote, ranges, local))
        touched = np.zeros(local_buf.size, dtype=bool)
        for local_off, remote_off, length in ranges:
            assert np.array_equal(local_buf[local_off : local_off + length], expected[remote_off : remote_off + length])
            touched[local_off : local_off + length] = True
        assert not local_buf[~touched].any(), "bytes outside the requested ranges were written"
        assert engine.bytes_read == sum(r[2] for r in ranges)
        with pytest.raises(KVTransferError, match="leaves remote region 'kv'"):
            asyncio.run(engine.read(remote, [(0, PEER_SIZE - 10, 20)], local))


def test_dlslime_read_from_a_dead_peer_raises(peer) -> None:
    proc, info, remote = peer
    engine = create_kv_transfer_engine("dlslime_tcp", host="127.0.0.1", timeout_s=5.0)
    with engine:
        local = engine.register("kv", np.zeros(8192, dtype=np.uint8))
        engine.connect(info)
        asyncio.run(engine.read(remote, [(0, 0, 4096)], local))  # a warm pooled connection to the peer
        proc.kill()
        proc.wait(10)

        async def read_dead() -> None:  # the outer bound only catches a hang past the engine's own timeout
            await asyncio.wait_for(engine.read(remote, [(0, 0, 4096), (4096, 8192, 4096)], local), 15.0)

        with pytest.raises(KVTransferError):
            asyncio.run(read_dead())
        with pytest.raises(KVTransferError, match="not connected"):  # the failed peer was dropped
            asyncio.run(engine.read(remote, [(0, 0, 16)], local))
        with pytest.raises(KVTransferError, match="cannot reach"):
            engine.connect(info)


def _wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Until every thread of `pid` is stopped (SIGSTOP), as /proc tells."""
    deadline = time.monotonic() + timeout
    tasks = f"/proc/{pid}/task"
    while not all(open(f"{tasks}/{t}/stat").read().rsplit(")", 1)[1].split()[0] == "T" for t in os.listdir(tasks)):
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.005)


def test_dlslime_read_from_a_hung_peer_times_out(peer) -> None:
    proc, info, remote = peer
    engine = create_kv_transfer_engine("dlslime_tcp", host="127.0.0.1", timeout_s=0.5)
    with engine:
        local = engine.register("kv", np.zeros(4096, dtype=np.uint8))
        engine.connect(info)
        os.kill(proc.pid, signal.SIGSTOP)  # accepts connections (kernel backlog) but never answers
        _wait_stopped(proc.pid)  # the signal lands asynchronously: a read issued at once could still be served

        async def read_hung() -> None:
            await asyncio.wait_for(engine.read(remote, [(0, 0, 4096)], local), 10.0)

        with pytest.raises(KVTransferError, match="timed out"):
            asyncio.run(read_hung())


def test_dlslime_engine_rejects_unsafe_setups() -> None:
    require("dlslime", "the dlslime TCP tests need dlslime (optional extra `pd`) and Debian's libibverbs1")
    with pytest.raises(KVTransferError, match="wildcard"):
        create_kv_transfer_engine("dlslime_tcp", host="0.0.0.0")
    with pytest.raises(KVTransferError, match="cannot bind"):
        create_kv_transfer_engine("dlslime_tcp", host="192.0.2.1")  # TEST-NET-1: not a local address
    with create_kv_transfer_engine("dlslime_tcp") as engine, pytest.raises(KVTransferError, match="CPU memory only"):
        engine.register("kv", torch.empty(64, dtype=torch.uint8, device="meta"))
