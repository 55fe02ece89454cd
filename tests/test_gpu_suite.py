"""scripts/dev/gpu_suite.py on CPU: its shard plans (balanced, bounded, in the asked order, a file's tests together),
the results it reads from pytest's junit files and -v output, and whole calls over a tiny suite of its own (shards
continued across calls, one cut by the budget, the JIT caches carried from one call to the next)."""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

from flotilla.scripts.dev import gpu_caches
from flotilla.scripts.dev import gpu_suite as gs


def _best_split(w: list[float], bound: float) -> tuple[int, float]:
    """By brute force: the fewest contiguous shards that keep the bound (a single file may pass it), and the
    smallest longest shard among those."""
    best = None
    n = len(w)
    for cuts in itertools.product([False, True], repeat=n - 1):
        shards, cur = [], [w[0]]
        for x, c in zip(w[1:], cuts):
            if c:
                shards.append(cur)
                cur = []
            cur.append(x)
        shards.append(cur)
        if any(len(s) > 1 and sum(s) > bound for s in shards):
            continue
        key = (len(shards), max(map(sum, shards)))
        best = key if best is None or key < best else best
    return best


def test_shards_are_the_fewest_within_the_bound_and_the_most_even_of_those():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        w = [rng.choice([0.0, rng.uniform(0, 60), rng.uniform(0, 300)]) for _ in range(n)]
        bound = rng.uniform(30, 400)
        files = [f"tests/test_{i}.py" for i in range(n)]
        shards = gs.plan_shards(files, dict(zip(files, w)), bound)
        assert [f for s in shards for f in s] == files  # contiguous, in order, every file once
        assert all(shards)
        loads = [sum(w[files.index(f)] for f in s) for s in shards]
        assert (len(shards), pytest.approx(max(loads))) == _best_split(w, bound), (w, bound, shards)
    # a file longer than the bound is a shard of its own; even loads beside it
    files = ["a", "b", "c", "d", "e"]
    assert gs.plan_shards(files, dict(zip(files, [3, 3, 20, 4, 2])), 10) == [["a", "b"], ["c"], ["d", "e"]]
    assert gs.plan_shards(files, dict(zip(files, [5, 5, 5, 5, 5])), 12) == [["a", "b"], ["c", "d"], ["e"]]
    assert gs.plan_shards([], {}, 10) == []


def test_orders_and_a_plan_keep_each_files_tests_together():
    files = [f"tests/test_{c}.py" for c in "abcdefgh"]
    assert gs.order_files(files, "file") == files
    assert gs.order_files(files, "reverse") == files[::-1]
    shuffled = gs.order_files(files, "shuffle:7")
    assert shuffled == gs.order_files(files, "shuffle:7") and sorted(shuffled) == files
    assert shuffled != files and shuffled != gs.order_files(files, "shuffle:8")
    for bad in ("random", "shuffle", "shuffle:x", "reversed"):
        with pytest.raises(Exception):
            gs.parse_order(bad)
    assert gs.parse_order("shuffle:12") == "shuffle:12"

    ids = ["tests/test_b.py::t1", "tests/test_b.py::t2[x y]", "tests/test_a.py::K::t", "tests/test_c.py::t"]
    durations = {"tests/test_b.py::t1": 100.0, "tests/test_b.py::t2[x y]": 200.0, "tests/test_c.py::t": 250.0}
    plan = gs.make_plan(ids, durations, "reverse", shard_minutes=5)
    assert plan["shards"] == [["tests/test_c.py", "tests/test_a.py"], ["tests/test_b.py"]]
    assert plan["estimate_s"] == [250.0 + gs.DEFAULT_TEST_S, 300.0] and plan["tests_per_shard"] == [2, 2]
    assert gs.plan_fits(plan, list(reversed(ids)), "reverse", 5)  # the same tests in another order
    assert not gs.plan_fits(plan, ids[:3], "reverse", 5) and not gs.plan_fits(plan, ids, "file", 5)
    assert not gs.plan_fits(plan, ids, "reverse", 9) and not gs.plan_fits(None, ids, "reverse", 5)
    state = {"plan": plan, "results": {"1": {"complete": True}, "0": {"complete": False}}}
    assert gs.pending_shards(state) == [0] and gs.select_shards("all", state) == [0, 1]
    assert gs.select_shards("1,0", state) == [1, 0]
    with pytest.raises(SystemExit):
        gs.select_shards("2", state)


FAKE_TESTS = {
    "test_one.py": """
        import time, pytest

        @pytest.mark.gpu
        def test_ok():
            time.sleep(0.2)

        @pytest.mark.gpu
        def test_bad():
            assert 1 == 2, "one is not two"

        @pytest.mark.gpu
        @pytest.mark.parametrize("x", ['{"a": [1, 2]}', "b c"])
        def test_params(x):
            pass

        def test_not_marked():
            pass
        """,
    "test_two.py": """
        import pytest

        @pytest.fixture
        def broken():
            raise RuntimeError("setup boom")

        @pytest.fixture
        def leaky():
            yield
            raise RuntimeError("teardown boom")

        class TestK:
            @pytest.mark.gpu
            @pytest.mark.skipif(True, reason="needs two CUDA devices")
            def test_skip(self):
                pass

        @pytest.mark.gpu
        @pytest.mark.xfail(reason="known")
        def test_xfail():
            assert 0

        @pytest.mark.gpu
        def test_setup_error(broken):
            pass

        @pytest.mark.gpu
        def test_teardown_error(leaky):
            pass
        """,
    "test_three.py": """
        import os, time, pytest

        @pytest.mark.gpu
        def test_first():
            pass

        @pytest.mark.gpu
        def test_slow():
            if os.environ.get("GS_MARK"):  # (tells the calls' test that test_slow has begun)
                open(os.environ["GS_MARK"], "w").close()
            time.sleep(float(os.environ.get("GS_SLOW_S", "0.1")))

        @pytest.mark.gpu
        def test_after():
            pass
        """,
}


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A suite of its own (its own pytest.ini: no conftest, no torch), the working directory for the calls."""
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a GPU\n")
    (tmp_path / "tests").mkdir()
    for name, text in FAKE_TESTS.items():
        (tmp_path / "tests" / name).write_text(textwrap.dedent(text))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_results_from_a_junit_file_and_from_the_output_of_a_killed_run(project):
    ids, errors = gs.collect("gpu", ["tests"], [], dict(os.environ))
    assert not errors and "tests/test_one.py::test_not_marked" not in ids and len(ids) == 11
    assert 'tests/test_one.py::test_params[{"a": [1, 2]}]' in ids and "tests/test_two.py::TestK::test_skip" in ids
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "gpu",
                          "--junitxml=r.xml", "tests"], capture_output=True, text=True, timeout=120)
    results = gs.parse_junit((project / "r.xml").read_text(), ids)
    got = {n.split("::", 1)[1]: (r.outcome, r.message.splitlines()[0] if r.message else "") for n, r in results.items()}
    assert got == {
        "test_ok": ("passed", ""), "test_bad": ("failed", "AssertionError: one is not two"),
        'test_params[{"a": [1, 2]}]': ("passed", ""), "test_params[b c]": ("passed", ""),
        "TestK::test_skip": ("skipped", "needs two CUDA devices"), "test_xfail": ("xfailed", "known"),
        "test_setup_error": ("error", 'failed on setup with "RuntimeError: setup boom"'),
        "test_teardown_error": ("error", 'failed on teardown with "RuntimeError: teardown boom"'),
        "test_first": ("passed", ""), "test_slow": ("passed", ""), "test_after": ("passed", "")}
    assert results["tests/test_one.py::test_ok"].seconds >= 0.2
    # the same outcomes from -v's lines, and the test a kill cut
    verbose, running = gs.parse_verbose_log(out.stdout, ids)
    assert {n: r.outcome for n, r in verbose.items()} == {n: r.outcome for n, r in results.items()}
    assert running is None
    cut = "\n".join(line for line in out.stdout.splitlines() if "test_three" not in line)
    cut += "\ntests/test_three.py::test_slow \n!!! KeyboardInterrupt !!!"
    verbose, running = gs.parse_verbose_log(cut, ids)
    assert running == "tests/test_three.py::test_slow" and "tests/test_three.py::test_after" not in verbose
    whole = gs.shard_record(ids, results, 3.0, -2, True, None, "")  # cut after every test reported: complete
    assert whole["complete"] and whole["cut"]
    record = gs.shard_record(ids, verbose, 3.0, 2, True, running, cut)
    assert record["tests"]["tests/test_three.py::test_slow"][::2] == ["not run", "running when the budget ran out"]
    assert record["tests"]["tests/test_three.py::test_after"][::2] == ["not run", "cut at the budget"]
    assert not record["complete"]
    durations = gs.merge_durations({"tests/test_three.py::test_after": 9.0}, record)
    assert durations["tests/test_three.py::test_after"] == 9.0 and "tests/test_one.py::test_ok" in durations


@pytest.fixture
def sigint_ignored():
    """This process as a shell's background job (or nohup) starts it, SIGINT ignored, which its children inherit:
    the budget's SIGINT must still interrupt their pytest."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    yield
    signal.signal(signal.SIGINT, previous)


class _TimerOnceSlowBegan(threading.Thread):
    """run_shard's budget timers, held back until test_slow has run 2 s (its mark file exists): a budget then cuts
    test_slow however long a loaded machine takes to start pytest and reach it."""

    def __init__(self, delay: float, fn, mark):
        super().__init__(daemon=True)
        self.delay, self.fn, self.mark, self.cancelled = delay, fn, mark, threading.Event()

    def run(self):
        t0 = time.monotonic()
        while not self.mark.exists():
            if self.cancelled.wait(0.05):
                return
        if not self.cancelled.wait(max(self.delay - (time.monotonic() - t0), 2.0)):
            self.fn()

    def cancel(self):
        self.cancelled.set()


def _call(project, home, out, *args, slow_s="0.1", copy_back=True):
    env = {**os.environ, "HOME": str(home), "GS_SLOW_S": slow_s, "GS_MARK": str(project / "slow-began")}
    env.pop("TRITON_CACHE_DIR", None)
    env.pop("DG_JIT_CACHE_DIR", None)
    env.pop("FLASHINFER_WORKSPACE_BASE", None)
    code = gs.main(["--out", str(out), "--cache-dir", str(project / "state"), *args], environ=env)
    state = json.loads((out / gs.STATE).read_text())
    for f in out.iterdir() if copy_back else ():  # what comes back, into the state folder for the next call
        (project / "state").mkdir(exist_ok=True)
        (project / "state" / f.name).write_bytes(f.read_bytes())
    return code, state, (out / gs.SUMMARY).read_text()


@pytest.mark.slow
def test_calls_continue_a_run_carry_the_caches_and_report_every_shard(project, capsys, monkeypatch, sigint_ignored):
    home = project / "home"
    timer = lambda delay, fn: _TimerOnceSlowBegan(delay, fn, project / "slow-began")  # noqa: E731
    monkeypatch.setattr(gs, "threading", types.SimpleNamespace(Timer=timer))
    (home / ".triton" / "cache" / "k1").mkdir(parents=True)
    (home / ".triton" / "cache" / "k1" / "kernel.cubin").write_bytes(b"\x7fELF" + bytes(range(256)) * 64)
    # 1: one shard per file (a bound of 0.6 s), the budget spent after the first: the others are left
    (project / "state").mkdir()
    (project / "state" / "jit-triton-stale.txz.00").write_bytes(b"an archive no state names")
    code, state, summary = _call(project, home, project / "out1", "--shard-minutes", "0.01", "--budget-s", "39",
                                 "--reserve-s", "30", copy_back=False)
    # the state folder holds the state and the archives it names, as if what came back had been copied in
    assert json.loads((project / "state" / gs.STATE).read_text()) == state
    kept = sorted(f.name for f in (project / "state").iterdir())
    assert kept == sorted([gs.STATE, *state["caches"]["triton"]["parts"]])
    plan = state["plan"]
    assert plan["shards"] == [["tests/test_one.py"], ["tests/test_three.py"], ["tests/test_two.py"]]
    assert list(state["results"]) == ["0"] and code == 1  # test_bad failed
    assert "shards still to run: 1, 2" in summary and "shard 1 (planned" in summary
    assert "failed tests/test_one.py::test_bad: AssertionError: one is not two" in summary
    (triton,) = state["caches"]["triton"]["parts"]
    assert triton.startswith("jit-triton-") and (project / "state" / triton).is_file()
    # 2: a fresh machine (no caches) continues with shard 1; it outlasts the budget and is cut while running (4 s in,
    # once test_slow, which sleeps 20 s, has run 2 s). (Shard
    # 0 as if the budget had cut its pytest after its last test reported: nothing of it runs again, not even an empty
    # pytest, which would run the whole suite)
    saved = json.loads((project / "state" / gs.STATE).read_text())
    saved["results"]["0"].update(complete=False, cut=True)
    (project / "state" / gs.STATE).write_text(json.dumps(saved))
    shutil.rmtree(home)
    code, state, summary = _call(project, home, project / "out2", "--shard-minutes", "0.01", "--budget-s", "34",
                                 "--reserve-s", "30", slow_s="20")
    log = (project / "out2" / gs.LOG).read_text()
    assert "shard 0: 0 tests in 1 files (resumed: 4 ran in an earlier call)" in log and "test_ok" not in log
    assert state["results"]["0"]["complete"]
    assert (home / ".triton" / "cache" / "k1" / "kernel.cubin").read_bytes()[:4] == b"\x7fELF"  # restored
    assert "the triton cache did not change: not written again" in summary
    assert not (project / "out2" / triton).exists() and state["caches"]["triton"]["parts"] == [triton]
    assert state["results"]["1"]["cut"] and "cut while running tests/test_three.py::test_slow" in summary
    cut_wall = state["results"]["1"]["wall_s"]
    assert state["results"]["1"]["tests"]["tests/test_three.py::test_first"][0] == "passed"
    assert "shards still to run: 1, 2" in summary
    # 3: shards 1 and 2 run; a new kernel changes the cache, which is saved under a new name
    (home / ".triton" / "cache" / "k2").mkdir()
    (home / ".triton" / "cache" / "k2" / "kernel.cubin").write_bytes(b"new")
    code, state, summary = _call(project, home, project / "out3", "--shard-minutes", "0.01")
    assert sorted(state["results"]) == ["0", "1", "2"] and "shards still to run: none" in summary
    log = (project / "out3" / gs.LOG).read_text()  # the cut shard goes on where it was cut
    assert "shard 1: 2 tests in 1 files (resumed: 1 ran in an earlier call)" in log and "test_first" not in log
    first = state["results"]["1"]["tests"]["tests/test_three.py::test_first"]
    assert state["results"]["1"]["complete"] and first[0] == "passed"
    assert state["results"]["1"]["wall_s"] > cut_wall >= 2  # the cut call's time counts in the shard's
    assert state["caches"]["triton"]["parts"] != [triton] and "saved the triton cache" in summary
    assert "- shard 2: 1 x needs two CUDA devices" in summary
    assert "error tests/test_two.py::test_setup_error" in summary
    rows = {line.split("|")[1].strip(): line for line in summary.splitlines() if line.startswith("| ")}
    assert rows["2"].split("|")[6:12] == [" 0 ", " 0 ", " 2 ", " 1 ", " 1 ", " 0 "]  # pass fail error skip xfail
    assert rows["total"].split("|")[3].strip() == "11"
    slowest = summary.split("slowest tests")[1]
    assert slowest.index("test_ok") < slowest.index("test_after")
    durations = state["durations"]
    assert durations["tests/test_one.py::test_ok"] >= 0.2 and len(durations) == 11
    # 4: every shard has run: the same command begins a new run, here in reverse order (planned again)
    code, state, summary = _call(project, home, project / "out4", "--order", "reverse", "--shard", "all")
    assert state["plan"]["order"] == "reverse" and "planned afresh" in summary
    assert [f for s in state["plan"]["shards"] for f in s] == ["tests/test_two.py", "tests/test_three.py",
                                                              "tests/test_one.py"]
    assert len(state["plan"]["shards"]) == 1 and sorted(state["results"]) == ["0"]
    log = (project / "out4" / gs.LOG).read_text()
    assert log.index("test_two.py::TestK::test_skip") < log.index("test_one.py::test_ok")  # files in that order
    assert "# GPU suite: 11 tests in 1 shards (order reverse" in capsys.readouterr().out
    # --restore alone: the carried caches unpacked on a fresh machine, nothing run or written
    shutil.rmtree(home)
    assert gs.main(["--restore", "--cache-dir", str(project / "state")], environ={"HOME": str(home)}) == 0
    assert (home / ".triton" / "cache" / "k2" / "kernel.cubin").read_bytes() == b"new"
    assert "restored the triton cache" in capsys.readouterr().out


def test_restored_flashinfer_modules_are_linked_where_flashinfer_loads_prebuilt_ones(tmp_path):
    """Each module built for this version and this GPU's arch goes into the package's data/aot as <name>/<name>.so;
    an unfinished build (no .so), another arch's or another version's stay out."""
    cache = tmp_path / "cache"
    for version, arch, name, built in (("0.6.6", "90a", "mod_a", True), ("0.6.6", "90a", "mod_b", False),
                                       ("0.6.6", "80", "mod_c", True), ("0.6.5", "90a", "mod_d", True)):
        folder = cache / version / arch / "cached_ops" / name
        folder.mkdir(parents=True)
        (folder / f"{name}.cuda.o").write_bytes(b"obj")
        if built:
            (folder / f"{name}.so").write_bytes(name.encode())
    aot = tmp_path / "site" / "flashinfer" / "data" / "aot"
    assert gpu_caches.promote_flashinfer(cache, aot, "0.6.6", "90") == 1
    assert (aot / "mod_a" / "mod_a.so").read_bytes() == b"mod_a"
    assert sorted(p.name for p in aot.iterdir()) == ["mod_a"]
    assert gpu_caches.promote_flashinfer(cache, aot, "0.6.6", "90") == 0  # (already there)


def test_prune_keeps_only_the_cache_archives_the_state_names(tmp_path, capsys):
    caches = {"triton": {"digest": "d", "parts": ["jit-triton-new.tgz.00"]}}
    (tmp_path / gs.STATE).write_text(json.dumps({"caches": caches}))
    for name in ("jit-triton-new.tgz.00", "jit-triton-old.tgz.00", "jit-flashinfer-old.tgz.01", "summary.md"):
        (tmp_path / name).write_bytes(b"x")
    assert gs.main(["--prune", "--cache-dir", str(tmp_path)]) == 0
    assert sorted(f.name for f in tmp_path.iterdir()) == ["jit-triton-new.tgz.00", gs.STATE, "summary.md"]
    assert "deleted" in capsys.readouterr().out


def test_a_cache_travels_xz_compressed_in_parts_and_comes_back_with_its_times(tmp_path):
    root = tmp_path / "cache"
    (root / "k1").mkdir(parents=True)
    blob = bytes(range(256)) * 4096  # 1 MiB that compresses
    (root / "k1" / "kernel.so").write_bytes(blob)
    os.utime(root / "k1" / "kernel.so", (1_000_000_000, 1_000_000_000))
    for ir in ("kernel.ptx", "kernel.llir"):  # triton's intermediate stages stay behind; its cubin travels
        (root / "k1" / ir).write_text("text")
    (root / "k1" / "kernel.cubin").write_bytes(b"sass")
    out = tmp_path / "out"
    out.mkdir()
    names = gpu_caches.archive_cache("triton", root, "abc", out, part_bytes=256)
    assert len(names) > 1 and all(n.startswith("jit-triton-abc.txz.") for n in names)
    assert sum((out / n).stat().st_size for n in names) < len(blob) // 10
    back = tmp_path / "back"
    gpu_caches.restore_cache([out / n for n in names], back)
    assert (back / "k1" / "kernel.so").read_bytes() == blob
    assert (back / "k1" / "kernel.so").stat().st_mtime == 1_000_000_000
    assert sorted(p.name for p in (back / "k1").iterdir()) == ["kernel.cubin", "kernel.so"]
    # an archive an older call wrote (gzip) still restores
    import tarfile

    with tarfile.open(out / "jit-old-d.tgz.00", "w:gz") as tar:
        tar.add(root / "k1", arcname="k1")
    gpu_caches.restore_cache([out / "jit-old-d.tgz.00"], tmp_path / "old")
    assert (tmp_path / "old" / "k1" / "kernel.so").read_bytes() == blob
