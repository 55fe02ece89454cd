"""The torch_dist KV data plane between two real processes: gloo on CPU (and NCCL on two GPUs, marked gpu).

The peer process plays the prefill rank: it registers layers of seeded random blocks, announces a pair for
"decode", builds it, then sends the blocks named on each stdin line. This process plays the decode rank.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import msgspec
import pytest
import torch

from flotilla.transport.kv_transfer import EndpointInfo, KVTransferError, RegionInfo, create_kv_transfer_engine
from flotilla.transport.kv_transfer_torch import check_pairs, rounds

LAYERS, BLOCKS, BLOCK_BYTES, SEED = 3, 40, 512, 99

# The prefill rank: announce one pair, then for each stdin line [block ids, round_blocks] send those blocks and
# print "sent" (or "error: ..." when it refuses).
PEER_SCRIPT = """
import asyncio, sys
import msgspec, torch
from flotilla.transport.kv_transfer import KVTransferError, create_kv_transfer_engine
layers, blocks, block_bytes, seed = (int(a) for a in sys.argv[1:5])
device = sys.argv[5]
engine = create_kv_transfer_engine("torch_dist", host="127.0.0.1", timeout_s=10.0)
gen = torch.Generator().manual_seed(seed)
caches = [torch.randint(0, 256, (blocks, block_bytes), dtype=torch.uint8, generator=gen).to(device)
          for _ in range(layers)]
regions = [engine.register(f"kv.layer{i}", c) for i, c in enumerate(caches)]
print(msgspec.json.encode([engine.listen("decode"), regions]).decode(), flush=True)

async def main():
    await engine.accept("decode")
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        ids, round_blocks = msgspec.json.decode(line)
        try:
            await engine.send_blocks("decode", [r.name for r in regions], ids, block_bytes, round_blocks)
            print("sent", flush=True)
        except KVTransferError as e:
            print(f"error: {e}", flush=True)

asyncio.run(main())
engine.close()
"""


def _expected(device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    return [torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8, generator=gen).to(device)
            for _ in range(LAYERS)]


class Peer:
    def __init__(self, proc: subprocess.Popen[str], endpoint: EndpointInfo, regions: list[RegionInfo]) -> None:
        self.proc, self.endpoint, self.regions = proc, endpoint, regions

    def ask(self, ids: list[int], round_blocks: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.json.encode([ids, round_blocks]).decode() + "\n")
        self.proc.stdin.flush()

    def answer(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()


def _start_peer(tmp_path, device: str) -> Peer:
    proc = subprocess.Popen([sys.executable, "-c", PEER_SCRIPT, str(LAYERS), str(BLOCKS), str(BLOCK_BYTES),
                             str(SEED), device], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=tmp_path)  # keep the checkout's top-level modules from shadowing the stdlib
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"peer exited with {proc.wait(10)} before announcing itself"
    endpoint, regions = msgspec.json.decode(line, type=tuple[EndpointInfo, list[RegionInfo]])
    return Peer(proc, endpoint, regions)


@pytest.fixture
def peer(tmp_path) -> Iterator[Peer]:
    p = _start_peer(tmp_path, "cpu")
    try:
        yield p
    finally:
        if p.proc.poll() is None:
            os.kill(p.proc.pid, signal.SIGCONT)
            p.proc.kill()
        p.proc.wait(10)


def _decode_engine(device: str = "cpu", timeout_s: float = 10.0):
    engine = create_kv_transfer_engine("torch_dist", host="127.0.0.1", timeout_s=timeout_s)
    caches = [torch.zeros(BLOCKS + 8, BLOCK_BYTES, dtype=torch.uint8, device=device) for _ in range(LAYERS)]
    names = [engine.register(f"kv.layer{i}", c).name for i, c in enumerate(caches)]
    return engine, caches, names


def _move(engine, peer: Peer, names: list[str], pairs: list[tuple[int, int]], round_blocks: int) -> int:
    peer.ask([s for s, _ in pairs], round_blocks)
    got = asyncio.run(engine.recv_blocks(peer.regions[0], names, pairs, BLOCK_BYTES, round_blocks))
    assert peer.answer() == "sent"
    return got


def _check_landed(caches: list[torch.Tensor], expected: list[torch.Tensor], moved: dict[int, int]) -> None:
    for cache, want in zip(caches, expected):
        for dst in range(cache.shape[0]):
            if dst in moved:
                assert torch.equal(cache[dst], want[moved[dst]]), dst
            else:
                assert not cache[dst].any(), f"block {dst} was written"


def test_random_blocks_move_bit_exact_between_two_processes_over_gloo(peer) -> None:
    engine, caches, names = _decode_engine()
    with engine:
        engine.connect(peer.endpoint)
        g = torch.Generator().manual_seed(3)
        src = torch.randperm(BLOCKS, generator=g)[:25].tolist()
        dst = torch.randperm(BLOCKS + 8, generator=g)[:25].tolist()
        pairs = list(zip(src, dst))
        assert _move(engine, peer, names, pairs, round_blocks=7) == 25 * LAYERS * BLOCK_BYTES  # 4 rounds
        moved = dict(zip(dst, src))
        _check_landed(caches, _expected(), moved)
        assert engine.bytes_read == 25 * LAYERS * BLOCK_BYTES

        # blocks outside either cache are refused before anything is asked or received; the pair keeps working
        with pytest.raises(KVTransferError, match=f"block {BLOCKS} is outside the prefill cache's {BLOCKS} blocks"):
            asyncio.run(engine.recv_blocks(peer.regions[0], names, [(0, 0), (BLOCKS, 1)], BLOCK_BYTES, 4))
        with pytest.raises(KVTransferError, match=f"block {BLOCKS + 8} is outside the decode cache's"):
            asyncio.run(engine.recv_blocks(peer.regions[0], names, [(BLOCKS + 8 - 9, BLOCKS + 8)], BLOCK_BYTES, 4))
        peer.ask([1, BLOCKS + 3], 4)  # the sender checks its own ids too, and sends nothing
        assert peer.answer() == f"error: block #1 ({BLOCKS + 3}) is outside this cache's {BLOCKS} blocks"
        _move(engine, peer, names, [(BLOCKS - 1, BLOCKS + 7)], round_blocks=4)
        moved[BLOCKS + 7] = BLOCKS - 1
        _check_landed(caches, _expected(), moved)
        with pytest.raises(KVTransferError, match="no one-sided reads"):
            asyncio.run(engine.read(peer.regions[0], [(0, 0, 8)], names[0]))
        engine.disconnect(peer.endpoint.engine_id)  # out of step with the peer: nothing more on that pair
        with pytest.raises(KVTransferError, match="not connected to KV peer"):
            asyncio.run(engine.recv_blocks(peer.regions[0], names, [(0, 0)], BLOCK_BYTES, 4))


def test_a_peer_that_is_gone_or_hung_gives_a_clear_error(peer, tmp_path) -> None:
    engine, caches, names = _decode_engine(timeout_s=1.0)
    with engine:
        engine.connect(peer.endpoint)
        _move(engine, peer, names, [(0, 0)], round_blocks=1)
        os.kill(peer.proc.pid, signal.SIGSTOP)  # hung: connected, but never sends
        with pytest.raises(KVTransferError, match="timed out; the pair was dropped"):
            asyncio.run(engine.recv_blocks(peer.regions[0], names, [(1, 1)], BLOCK_BYTES, 1))
        with pytest.raises(KVTransferError, match="not connected"):
            asyncio.run(engine.recv_blocks(peer.regions[0], names, [(1, 1)], BLOCK_BYTES, 1))
        assert not caches[0][1].any()
        peer.proc.kill()
        peer.proc.wait(10)

        # a fresh peer: it dies while we wait for its blocks
        other = _start_peer(tmp_path, "cpu")
        try:
            engine.connect(other.endpoint)
            other.proc.kill()
            other.proc.wait(10)
            with pytest.raises(KVTransferError, match="the pair was dropped"):
                asyncio.run(engine.recv_blocks(other.regions[0], names, [(2, 2)], BLOCK_BYTES, 1))
            with pytest.raises(KVTransferError, match="cannot reach KV peer"):
                engine.connect(other.endpoint)  # nobody listens on its store any more
        finally:
            other.proc.kill()
            other.proc.wait(10)
        _check_landed(caches, _expected(), {0: 0})


def test_torch_dist_setup_errors() -> None:
    with pytest.raises(KVTransferError, match="wildcard"):
        create_kv_transfer_engine("torch_dist", host="0.0.0.0")
    with create_kv_transfer_engine("torch_dist") as engine:
        with pytest.raises(KVTransferError, match="register the KV memory"):
            engine.listen("x")
        engine.register("kv.layer0", torch.zeros(4, 8, dtype=torch.uint8))
        with pytest.raises(KVTransferError, match="NCCL with NCCL"):
            engine.connect(EndpointInfo(backend="torch_dist", engine_id="p", host="127.0.0.1", port=1,
                                        device="cuda:0"))
        with pytest.raises(KVTransferError, match="cannot connect a torch_dist engine to a dlslime_tcp peer"):
            engine.connect(EndpointInfo(backend="dlslime_tcp", engine_id="p", host="127.0.0.1", port=1))
        with pytest.raises(KVTransferError, match="no KV pair with nobody"):
            asyncio.run(engine.send_blocks("nobody", ["kv.layer0"], [0], 8, 1))
    with pytest.raises(KVTransferError, match="pair #1: block 5 is outside the prefill cache's 5 blocks"):
        check_pairs([(0, 0), (5, 1)], 5, 9)
    assert rounds(10, 4) == [(0, 4), (4, 8), (8, 10)] and rounds(0, 4) == []


@pytest.mark.gpu
def test_random_blocks_move_bit_exact_between_two_gpus_over_nccl(tmp_path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    p = _start_peer(tmp_path, "cuda:0")
    try:
        engine, caches, names = _decode_engine("cuda:1")
        with engine:
            engine.connect(p.endpoint)
            g = torch.Generator().manual_seed(5)
            src = torch.randperm(BLOCKS, generator=g)[:30].tolist()
            dst = torch.randperm(BLOCKS + 8, generator=g)[:30].tolist()
            pairs = list(zip(src, dst))
            assert _move(engine, p, names, pairs, round_blocks=8) == 30 * LAYERS * BLOCK_BYTES
            _check_landed(caches, _expected("cuda:1"), dict(zip(dst, src)))
            os.kill(p.proc.pid, signal.SIGKILL)  # a dead peer fails the next receive, it does not hang
            p.proc.wait(10)
            with pytest.raises(KVTransferError):
                asyncio.run(asyncio.wait_for(
                    engine.recv_blocks(p.regions[0], names, [(1, 1)], BLOCK_BYTES, 1), 60))
    finally:
        p.proc.kill()
        p.proc.wait(10)
