"""scripts/dev/bench_migration.py at toy size on CPU (gloo): every path runs, the JSON says what moved, the decode
cache really holds the source blocks bit for bit afterwards, and a wrong byte is caught."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import uvloop

from flotilla.scripts.dev import bench_migration as bm
from flotilla.transport import kv_transfer

TOY = ["--device", "cpu", "--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--block-size", "4",
       "--blocks", "40", "--prompts", "5", "--spare-blocks", "8", "--repeat", "1", "--warmup", "0"]


def test_every_path_runs_and_the_json_reports_bit_exact_moves(tmp_path, capsys):
    out = tmp_path / "m.json"
    assert bm.main([*TOY, "--round-blocks", "3,16", "--poll-caps", "0.0002", "--json", str(out)]) == 0
    assert (kv_transfer.POLL_MIN_S, kv_transfer.POLL_MAX_S) == (0.0001, 0.005)  # restored after the capped rows
    report = json.loads(out.read_text())
    block_bytes = 2 * 4 * 2 * 16 * 2  # K and V, block_size, heads, head_dim, bf16
    assert report["shape"]["block_bytes"] == block_bytes
    assert report["workload"] == {"prompts": 5, "blocks": 40, "bytes": 40 * 2 * block_bytes, "round_blocks": [3, 16]}
    rows = [(r["path"], r["round_blocks"], r.get("poll_max_s")) for r in report["results"]]
    assert rows == [("copy", None, None), ("engine", 3, 0.005), ("engine", 16, 0.005), ("raw", 3, None),
                    ("raw", 16, None), ("actor", 3, 0.005), ("actor", 16, 0.005), ("engine", 3, 0.0002),
                    ("engine", 16, 0.0002), ("actor", 3, 0.0002), ("actor", 16, 0.0002)]
    copy = report["results"][0]
    for r in report["results"]:
        assert r["seconds"][0] > 0 and len(r["seconds"]) == 1
        # the rates are the bytes each path moved over its own time (its seconds rounded to 1 us, its GB/s to 1e-4),
        # and each against the plain copy's
        s = r["seconds"][0]
        slowest, fastest = r["bytes"] / (s + 5e-7) / 1e9, r["bytes"] / max(s - 5e-7, 1e-9) / 1e9
        assert slowest - 1e-4 <= r["gbps_median"] <= fastest + 1e-4, r
        assert r["vs_copy"] == pytest.approx(r["gbps_median"] / copy["gbps_median"], rel=0.01, abs=2e-3), r
        if r["path"] in ("engine", "actor"):
            assert r["bit_exact"] is True and r["bytes"] == 40 * 2 * block_bytes
    assert "actor rounds of 16 blocks" in capsys.readouterr().out


def test_the_actor_path_lands_every_block_and_touches_nothing_else():
    args = bm.parse_args([*TOY, "--paths", "actor", "--round-blocks", "7"])
    setup = bm.build_setup(args)
    assert len(setup.prompts) == 5 and sum(len(s) for s, _ in setup.prompts) == 40
    rows = uvloop.run(bm.run(args, setup, lambda _: None))
    assert [r["path"] for r in rows] == ["actor"]
    # MigrationDone counts each command's own bytes, even with migrations queued behind one another on a peer
    assert rows[0]["reported_bytes"] == setup.migrated_bytes
    moved = {d: s for src, dst in setup.prompts for s, d in zip(src, dst)}
    for s, d in zip(setup.src, setup.dst):  # checked here independently of the script's own check
        for block in range(d.shape[0]):
            want = s[moved[block]] if block in moved else torch.zeros_like(d[block])
            assert torch.equal(d[block].view(torch.uint8), want.view(torch.uint8)), block
    d = setup.dst[1].view(torch.uint8)
    d[setup.prompts[2][1][0], 0, 0, 0, 0] ^= 1  # one flipped bit in a migrated block
    with pytest.raises(bm.BenchError, match="layer 1: migrated blocks"):
        setup.check_landed()
    d[setup.prompts[2][1][0], 0, 0, 0, 0] ^= 1
    spare = next(b for b in range(d.shape[0]) if b not in moved)
    d[spare, 1, 0, 0, 0] = 7  # a block no migration names
    with pytest.raises(bm.BenchError, match="no migration names was written"):
        setup.check_landed()


def test_help_explains_every_flag():
    out = subprocess.run([sys.executable, "-m", "flotilla.scripts.dev.bench_migration", "--help"], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0
    for flag in ("--device", "--src-device", "--layers", "--round-blocks", "--paths", "--prompts", "--json"):
        assert flag in out.stdout
    bad = subprocess.run([sys.executable, "-m", "flotilla.scripts.dev.bench_migration", "--paths", "nope"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "paths are actor, engine, raw, copy" in bad.stderr


def test_the_default_block_size_is_the_engines():
    # the engine's block_size setting defaults to None (the model settles it): the bench must not take that
    from flotilla.config import DEFAULT_BLOCK_SIZE

    assert bm.parse_args(["--device", "cpu"]).block_size == DEFAULT_BLOCK_SIZE
