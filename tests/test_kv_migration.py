"""KVMigrationActor: two of them in one process (a prefill rank and a decode rank over fake runners' KV
caches), on the local copy and on real dlslime TCP: every migrated block lands exactly, nothing else is
touched, more than 32 ranges take several calls, and failures come back as MigrationDone errors. Plus the
memory seam: what the data plane may register, and the honest refusal of GPU KV."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import types
from collections.abc import Callable

import numpy as np
import pytest
import torch
import uvloop

from flotilla.actors import worker as worker_module
from flotilla.actors.base import RuntimeOptions
from flotilla.actors import kv_migration
from flotilla.actors.kv_memory import KVMemory, zeroed_cache
from flotilla.actors.kv_migration import KVMigrationActor
from flotilla.actors.runtime import Runtime
from flotilla.actors.topology import ActorSpec, Topology
from flotilla.config import DisaggConfig, EngineConfig
from flotilla.transport.channels import Inbox, Outbox
from flotilla.transport.endpoints import free_tcp_port
from flotilla.transport.kv_transfer import KVTransferError
from flotilla.transport.kv_transfer_torch import TorchDistEngine
from flotilla.transport.messages import KVReadyEvent, MigrateKVCmd, MigrationDoneEvent
from helpers_optional import require

NUM_BLOCKS, BS, HEADS, DIM, LAYERS = 96, 4, 2, 8, 3


def _need_dlslime() -> None:
    require("dlslime", "needs dlslime and Debian's libibverbs1")


def _fake_runner(name: str, caches: list[torch.Tensor]) -> None:
    worker_module._LOCAL_RUNNERS[(name, 0)] = types.SimpleNamespace(kv_caches=caches, state_pools=[],
                                                                    num_state_slots=0)


async def _migrate(backend: str, cmds_of, decode_dim: int = DIM, timeout_s: float = 10.0,
                   staging: tuple[str, str] = ("auto", "auto"),
                   dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32), between=None,
                   devices: tuple[str, str] = ("cpu", "cpu"), block_shape: tuple[int, ...] | None = None,
                   announce: Callable[[MigrateKVCmd], np.ndarray] | None = lambda cmd: cmd.src_block_ids,
                   one_allocation: tuple[bool, bool] = (False, False)):
    """Run a prefill and a decode migration actor inline; feed the decode one the commands `cmds_of(src)`
    builds; return (prefill caches, decode caches, MigrationDone events). dtypes: the two caches'.
    between: called with the number of commands done so far, after each (then they go one at a time).
    devices: where the two caches live (the returned ones are CPU copies). block_shape: one block of both caches
    (default: the GQA layout [2, BS, HEADS, DIM]). announce: the blocks the prefill scheduler's KVReadyEvent names for
    each command's transfer, sent to the prefill actor first (as SchedulerActor does); None: no announcement.
    one_allocation: each side's layers are views of one tensor (as the worker allocates them), else apart."""
    torch.manual_seed(0)
    src_block = block_shape or (2, BS, HEADS, DIM)
    dst_block = block_shape or (2, BS, HEADS, decode_dim)
    if one_allocation[0]:
        pre = list(torch.randn(LAYERS, NUM_BLOCKS + 1, *src_block).to(dtypes[0]).to(devices[0]).unbind(0))
    else:
        pre = [torch.randn(NUM_BLOCKS + 1, *src_block).to(dtypes[0]).to(devices[0]) for _ in range(LAYERS)]
    if one_allocation[1]:
        dec = list(torch.zeros(LAYERS, NUM_BLOCKS + 1, *dst_block, dtype=dtypes[1], device=devices[1]).unbind(0))
    else:
        dec = [torch.zeros(NUM_BLOCKS + 1, *dst_block, dtype=dtypes[1], device=devices[1]) for _ in range(LAYERS)]
    _fake_runner("pw", pre)
    _fake_runner("dw", dec)
    def config(workers: str, stage: str) -> dict:
        engine = EngineConfig(disagg=DisaggConfig(kv_transfer_backend=backend, kv_transfer_timeout_s=timeout_s,
                                                  kv_staging=stage, kv_staging_blocks=16))
        return {"engine": engine.to_dict(), "scheduler": "sched", "workers": workers}

    topo = Topology(name="kvm", placement="inline", clients=["sched"], options=RuntimeOptions(ready_timeout_s=20),
                    actors=[ActorSpec(name="p_kv", kind="kv_migration", config=config("pw", staging[0])),
                            ActorSpec(name="d_kv", kind="kv_migration", config=config("dw", staging[1]))])
    rt = Runtime(topo)
    await rt.start()
    inbox = Inbox(rt.zmq, rt.endpoints.of("sched"), (MigrationDoneEvent,))
    out = Outbox(rt.zmq, rt.endpoints.of("d_kv"))
    prefill_scheduler = Outbox(rt.zmq, rt.endpoints.of("p_kv"))
    try:
        cmds = cmds_of(rt.endpoints.of("p_kv"))
        for cmd in cmds if announce is not None else []:
            await prefill_scheduler.send(KVReadyEvent(transfer_id=cmd.transfer_id, block_ids=announce(cmd),
                                                      num_tokens=0, first_token=0, src_engine="p"))
        if between is None:
            for cmd in cmds:
                await out.send(cmd)
            done = [await asyncio.wait_for(inbox.recv(), timeout_s + 10) for _ in cmds]
        else:
            done = []
            for cmd in cmds:
                await out.send(cmd)
                done.append(await asyncio.wait_for(inbox.recv(), timeout_s + 10))
                between(len(done))
    finally:
        inbox.close()
        out.close()
        prefill_scheduler.close()
        await rt.stop()
        for name in ("pw", "dw"):
            worker_module._LOCAL_RUNNERS.pop((name, 0), None)
    return [p.cpu() for p in pre], [d.cpu() for d in dec], done


def _cmd(tid: str, src_kv: str, src: list[int], dst: list[int]) -> MigrateKVCmd:
    return MigrateKVCmd(transfer_id=tid, src_engine="p", src_block_ids=np.asarray(src, np.int32),
                        dst_block_ids=np.asarray(dst, np.int32), src_kv=[src_kv])


@pytest.mark.parametrize("backend,staging", [
    ("local", ("auto", "auto")), ("dlslime_tcp", ("auto", "auto")), ("torch_dist", ("auto", "auto")),
    # host staging buffers (what a GPU KV cache needs under dlslime TCP), on either side or both
    ("dlslime_tcp", ("always", "always")), ("dlslime_tcp", ("always", "never")), ("local", ("never", "always")),
])
def test_migrated_blocks_land_exactly_and_nothing_else_is_touched(backend, staging):
    if backend == "dlslime_tcp":
        _need_dlslime()
    # 40 scattered pairs (40 ranges a layer: more than one call of 32; staged: 3 rounds of <= 16 blocks),
    # a contiguous run, an empty command
    scattered = (list(range(1, 81, 2)), list(range(90, 50, -1)))
    run = (list(range(82, 90)), list(range(0, 8)))

    def cmds(src_kv):
        return [_cmd("a", src_kv, *scattered), _cmd("b", src_kv, *run), _cmd("c", src_kv, [], [])]

    pre, dec, done = uvloop.run(_migrate(backend, cmds, staging=staging))
    by_id = {d.transfer_id: d for d in done}
    assert all(d.error is None for d in done), done
    block_bytes = 2 * BS * HEADS * DIM * 4
    assert by_id["a"].num_bytes == 40 * LAYERS * block_bytes and by_id["c"].num_bytes == 0
    moved = dict(zip(scattered[1] + run[1], scattered[0] + run[0]))
    for p, d in zip(pre, dec):
        for dst in range(NUM_BLOCKS + 1):
            if dst in moved:
                assert torch.equal(d[dst], p[moved[dst]]), dst
            else:
                assert not d[dst].any(), dst


@pytest.mark.parametrize("backend", ["local", "dlslime_tcp", "torch_dist"])
@pytest.mark.parametrize("one_allocation", [(True, True), (True, False), (False, True)])
def test_layers_of_one_allocation_are_one_region_read_in_one_call(backend, one_allocation, monkeypatch):
    """The worker's layers are views of one tensor: both sides one region, a migration is one read of every layer's
    ranges; with the other side apart, a read per layer; torch_dist sends per layer either way."""
    if backend == "dlslime_tcp":
        _need_dlslime()
    from flotilla.transport.kv_transfer import KVTransferEngine

    calls, read = [], KVTransferEngine.read

    async def counted(self, remote, ranges, local, *args, **kwargs):
        calls.append((remote.name, local.name))
        return await read(self, remote, ranges, local, *args, **kwargs)

    monkeypatch.setattr(KVTransferEngine, "read", counted)
    scattered = (list(range(1, 61, 2)), list(range(90, 60, -1)))
    pre, dec, done = uvloop.run(_migrate(backend, lambda src_kv: [_cmd("a", src_kv, *scattered)],
                                         one_allocation=one_allocation))
    assert done[0].error is None, done
    moved = dict(zip(scattered[1], scattered[0]))
    for p, d in zip(pre, dec):
        for dst in range(NUM_BLOCKS + 1):
            assert torch.equal(d[dst], p[moved[dst]]) if dst in moved else not d[dst].any(), dst
    if backend == "torch_dist":
        assert calls == []
    elif one_allocation == (True, True):
        assert calls == [("kv", "kv")]
    else:
        assert len(calls) == LAYERS and {"kv"} & {name for pair in calls for name in pair}


def test_only_layers_back_to_back_in_one_storage_are_one_tensor():
    whole = torch.randn(3, 9, 2, 4, 2, 8)
    mem = KVMemory(list(whole.unbind(0)))
    assert mem.whole is not None and mem.whole.data_ptr() == whole.data_ptr() and torch.equal(mem.whole, whole)
    assert KVMemory(_caches()).whole is None  # separate allocations
    spaced = torch.zeros(5, 9, 2, 4, 2, 8)
    assert KVMemory([spaced[0], spaced[2]]).whole is None  # one storage, a gap between
    assert KVMemory([whole[1], whole[0]]).whole is None  # out of order


@pytest.mark.parametrize("backend,staging", [("local", ("auto", "auto")), ("torch_dist", ("auto", "auto")),
                                             ("dlslime_tcp", ("always", "always"))])
def test_an_mla_latent_cache_migrates_block_for_block(backend, staging):
    """DeepSeek-V3's cache, [num_blocks, block_size, kv_lora_rank + rope_dim] per layer, moves like GQA's."""
    if backend == "dlslime_tcp":
        _need_dlslime()
    pairs = (list(range(1, 41, 2)) + [60, 61, 62], list(range(70, 50, -1)) + [3, 4, 5])
    pre, dec, done = uvloop.run(_migrate(backend, lambda src_kv: [_cmd("m", src_kv, *pairs)], staging=staging,
                                         block_shape=(BS, 24)))
    assert done[0].error is None, done
    assert done[0].num_bytes == len(pairs[0]) * LAYERS * BS * 24 * 4
    moved = dict(zip(pairs[1], pairs[0]))
    for p, d in zip(pre, dec):
        for dst in range(NUM_BLOCKS + 1):
            assert torch.equal(d[dst], p[moved[dst]]) if dst in moved else not d[dst].any(), dst


@pytest.mark.parametrize("backend", ["local", "torch_dist"])
def test_the_prefill_rank_serves_only_transfers_its_scheduler_announced(backend, monkeypatch):
    # staged (local) and torch_dist migrations ask the prefill rank for each transfer's blocks
    monkeypatch.setattr(kv_migration, "ANNOUNCE_GRACE_S", 0.2)
    staging = ("always", "always") if backend == "local" else ("auto", "auto")
    _, dec, done = uvloop.run(_migrate(backend, lambda src: [_cmd("t-secret", src, [5, 6], [1, 2])], staging=staging,
                                       announce=None))
    assert done[0].error is not None and "was not announced" in done[0].error, done
    _, dec2, done2 = uvloop.run(_migrate(backend, lambda src: [_cmd("t1", src, [5, 6, 7], [1, 2, 3])],
                                         staging=staging, announce=lambda cmd: cmd.src_block_ids[:2]))
    assert done2[0].error is not None and "not the ones transfer t1 holds" in done2[0].error, done2
    assert not any(d.any() for d in dec + dec2)  # nothing was read
    pre, dec, done = uvloop.run(_migrate(backend, lambda src: [_cmd("t2", src, [5, 6], [1, 2])], staging=staging))
    assert done[0].error is None and torch.equal(dec[0][1:3], pre[0][5:7])


def test_a_layout_mismatch_and_an_absent_peer_come_back_as_migration_errors():
    def cmds(src_kv):
        return [_cmd("x", src_kv, [1, 2], [3, 4])]

    _, dec, done = uvloop.run(_migrate("local", cmds, decode_dim=DIM // 2))
    assert "bytes on the prefill engine" in done[0].error and not any(d.any() for d in dec)

    def nobody(_src_kv):
        return [_cmd("y", "inproc://nobody-listens-here", [1], [1])]

    _, _, done = uvloop.run(_migrate("local", nobody, timeout_s=0.3))
    assert done[0].transfer_id == "y" and "did not answer within 0.3 s" in done[0].error


@pytest.mark.parametrize("backend,staging", [("local", ("auto", "auto")), ("dlslime_tcp", ("always", "always")),
                                             ("torch_dist", ("auto", "auto"))])
def test_an_fp8_kv_cache_migrates_byte_for_byte_and_a_dtype_mismatch_is_refused(backend, staging):
    if backend == "dlslime_tcp":
        _need_dlslime()
    fp8 = torch.float8_e4m3fn

    def cmds(src_kv):
        return [_cmd("f", src_kv, [5, 1, 7], [0, 9, 3])]

    pre, dec, done = uvloop.run(_migrate(backend, cmds, staging=staging, dtypes=(fp8, fp8)))
    assert done[0].error is None and done[0].num_bytes == 3 * LAYERS * 2 * BS * HEADS * DIM
    for p, d in zip(pre, dec):
        assert torch.equal(d[[0, 9, 3]].view(torch.uint8), p[[5, 1, 7]].view(torch.uint8))
        assert not d[[1, 2, 4]].view(torch.uint8).any()
    # bfloat16 blocks are twice the bytes, but the dtype is what is named (torch_dist: the prefill side's pair
    # waits for a requester that refused it; a short timeout ends that wait, and the test, sooner)
    _, dec, done = uvloop.run(_migrate(backend, cmds, staging=staging, dtypes=(fp8, torch.bfloat16), timeout_s=2.0))
    assert "float8_e4m3fn" in done[0].error and "bfloat16" in done[0].error
    assert not any(d.any() for d in dec)


def test_torch_dist_refuses_blocks_outside_either_cache_and_recovers_from_a_lost_pair():
    def cmds(src_kv):
        return [_cmd("bad-src", src_kv, [2, NUM_BLOCKS + 1], [0, 1]), _cmd("bad-dst", src_kv, [3], [NUM_BLOCKS + 1]),
                _cmd("ok", src_kv, [4, 5], [6, 7]), _cmd("lost", src_kv, [8], [9]), _cmd("again", src_kv, [10], [11])]

    def between(done: int) -> None:
        if done == 3:  # the prefill side loses its pairs (as when its process restarts): abort their groups
            for engine in [o for o in gc.get_objects() if type(o) is TorchDistEngine]:
                for pair in list(engine._serving.values()):
                    pair.close()

    pre, dec, done = uvloop.run(_migrate("torch_dist", cmds, between=between))
    errors = {d.transfer_id: d.error for d in done}
    assert f"block {NUM_BLOCKS + 1} is outside the prefill cache's {NUM_BLOCKS + 1} blocks" in errors["bad-src"]
    assert f"block {NUM_BLOCKS + 1} is outside the decode cache's {NUM_BLOCKS + 1} blocks" in errors["bad-dst"]
    assert "no KV pair with" in errors["lost"] and "KV migration from p failed" in errors["lost"]
    assert errors["ok"] is None and errors["again"] is None  # a new pair is built on the next migration
    for p, d in zip(pre, dec):
        assert torch.equal(d[[6, 7, 11]], p[[4, 5, 10]])
        assert not d[[0, 1, 9]].any()


def test_migrations_queued_behind_one_that_finds_the_prefill_rank_silent_fail_without_asking_again(monkeypatch):
    # the prefill rank built the pair, then stops answering (its process is stuck, or dying): the first migration
    # waits out kv_transfer_timeout_s; the ones queued behind it on the same peer fail at once with its reason
    # instead of each asking and waiting as long (a decode engine otherwise holds their blocks for n timeouts)
    asked: list[str] = []

    async def silent(self, req) -> None:
        asked.append(req.transfer_id)

    monkeypatch.setattr(KVMigrationActor, "on_kv_send_request", silent)

    def cmds(src_kv):
        return [_cmd(f"t{i}", src_kv, [i + 1], [i + 1]) for i in range(3)]

    _, dec, done = uvloop.run(_migrate("torch_dist", cmds, timeout_s=1.0))
    assert sorted(d.transfer_id for d in done) == ["t0", "t1", "t2"]
    assert all("did not agree to send blocks within 1 s" in d.error for d in done)
    assert asked == ["t0"]
    assert not any(d.any() for d in dec)


@pytest.mark.gpu
def test_torch_dist_moves_blocks_between_two_gpus_over_nccl():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    scattered = (list(range(1, 81, 2)), list(range(90, 50, -1)))  # 40 pairs: 3 rounds of <= 16 blocks

    def cmds(src_kv):
        return [_cmd("a", src_kv, *scattered), _cmd("b", src_kv, [82, 83], [0, 1])]

    pre, dec, done = uvloop.run(_migrate("torch_dist", cmds, dtypes=(torch.bfloat16, torch.bfloat16),
                                         devices=("cuda:0", "cuda:1")))
    assert all(d.error is None for d in done), done
    moved = dict(zip(scattered[1] + [0, 1], scattered[0] + [82, 83]))
    for p, d in zip(pre, dec):
        for dst in range(NUM_BLOCKS + 1):
            assert torch.equal(d[dst], p[moved[dst]]) if dst in moved else not d[dst].any(), dst


def _caches(device: str = "cpu", layers: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(9, 2, 4, 2, 8, device=device) for _ in range(layers)]


def test_a_cpu_kv_cache_is_one_region_per_layer_with_its_block_bytes():
    mem = KVMemory(_caches())
    assert len(mem.caches) == 2 and mem.block_bytes == 2 * 4 * 2 * 8 * 4


def test_a_device_kv_cache_is_staged_through_host_memory_when_the_backend_reads_host_memory_only():
    # "meta" stands in for cuda here: a KV cache dlslime TCP cannot read
    def needs(device: str, backend: str, mode: str = "auto") -> bool:
        return KVMemory(_caches(device)).needs_staging(DisaggConfig(kv_transfer_backend=backend, kv_staging=mode))

    assert needs("meta", "dlslime_tcp") and not needs("meta", "local") and not needs("cpu", "dlslime_tcp")
    assert not needs("meta", "torch_dist")  # it sends from device memory
    with pytest.raises(ValueError, match="does not apply to torch_dist"):
        DisaggConfig(kv_transfer_backend="torch_dist", kv_staging="always")
    assert needs("cpu", "local", "always") and not needs("meta", "dlslime_tcp", "never")


def test_an_unstaged_device_cache_is_refused_by_dlslime_tcp_with_the_reason():
    _need_dlslime()
    from flotilla.transport.kv_transfer import create_kv_transfer_engine

    with create_kv_transfer_engine("dlslime_tcp") as engine:
        with pytest.raises(KVTransferError, match="CPU memory only, stage GPU blocks"):
            engine.register("kv.layer0", _caches("meta")[0])


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


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from Linux's /proc")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_cpu_cache_is_zeros_that_take_memory_only_where_written(dtype):
    """zeroed_cache on a CPU: zeros of the shape and dtype, one writable contiguous allocation, whose pages the
    process holds only once they are written (a 256 MiB cache adds a few MiB of resident memory)."""
    rss = _resident_bytes()
    shape = (4, 1024, 2, 16, 4, 64 * 4 // dtype.itemsize)  # 256 MiB
    cache = zeroed_cache(shape, dtype, torch.device("cpu"))
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    layers = cache.unbind(0)
    layers[1][7, 1] = torch.ones(16, 4, shape[-1]).to(dtype)
    assert cache[1, 7, 1].float().eq(1).all() and not cache[1, 7, 0].float().any() and not cache[3, -1].float().any()
    assert _resident_bytes() - rss < 32 << 20
