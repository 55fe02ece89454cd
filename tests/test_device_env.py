"""scripts/dev/device_env.sh, which the device scripts source in place of the GPU bundle's setup.sh: after the bundle's
setup it dates the installed packages back, so that ninja (which flashinfer runs before loading any JIT module) finds
the carried JIT cache's objects newer than the freshly installed headers and rebuilds nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "dev" / "device_env.sh"


def _source(checkout: Path, site: Path) -> None:
    subprocess.run(["bash", "-c", f"source {SCRIPT} && echo sourced"], cwd=checkout, check=True, timeout=60,
                   env={**os.environ, "FLOTILLA_BUNDLE_SITE": str(site)}, capture_output=True)  # fmt: skip


def _bundle(tmp_path: Path, site: Path) -> Path:
    """A checkout whose .gpu-bundle/setup.sh "installs" a header and a source into `site`, as pip does: fresh."""
    checkout = tmp_path / "checkout"
    (checkout / ".gpu-bundle").mkdir(parents=True)
    (checkout / ".gpu-bundle" / "setup.sh").write_text(
        f"mkdir -p {site}/pkg/include\n"
        f"printf '#define X 1\\n' > {site}/pkg/include/h.h\n"
        f"printf '#include \"h.h\"\\nint f(void) {{ return X; }}\\n' > {site}/pkg/a.c\n"
    )
    return checkout


def test_the_bundles_installed_files_are_dated_back(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _source(_bundle(tmp_path, site), site)
    for path in (site / "pkg" / "include" / "h.h", site / "pkg" / "a.c", site / "pkg"):
        assert time.gmtime(path.stat().st_mtime).tm_year == 2000, path


@pytest.mark.skipif(shutil.which("ninja") is None or shutil.which("gcc") is None, reason="needs ninja and gcc")
def test_ninja_rebuilds_nothing_after_a_fresh_setup(tmp_path: Path) -> None:
    """The cache's build (made on an earlier machine), a fresh setup on this one: without the dating back ninja
    would compile again ("output older than most recent input")."""
    site = tmp_path / "site"
    checkout = _bundle(tmp_path, site)
    _source(checkout, site)
    build = tmp_path / "build"
    build.mkdir()
    (build / "build.ninja").write_text(
        "rule cc\n"
        f"  command = gcc -MMD -MF $out.d -I{site}/pkg/include -c $in -o $out\n"
        "  depfile = $out.d\n  deps = gcc\n"
        f"build a.o: cc {site}/pkg/a.c\n"
    )
    subprocess.run(["ninja"], cwd=build, check=True, capture_output=True, timeout=60)
    _source(checkout, site)  # setup.sh runs again: the files are rewritten, then dated back
    dry = subprocess.run(["ninja", "-n", "-d", "explain"], cwd=build, check=True, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert "no work to do" in dry.stdout, dry.stdout + dry.stderr
    (site / "pkg" / "include" / "h.h").touch()  # and without it, ninja would rebuild
    dry = subprocess.run(["ninja", "-n", "-d", "explain"], cwd=build, check=True, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert "no work to do" not in dry.stdout


def test_device_h200_copies_the_carried_peer_parts_and_packs_its_results(tmp_path: Path) -> None:
    """scripts/dev/device_h200.sh's `peer` stage (the only one that needs no GPU): the vLLM bundle's parts carried with
    the checkout go where device_compare.sh's install looks for them, and the run's results are packed."""
    root = Path(__file__).resolve().parents[1]
    checkout = tmp_path / "checkout"
    (checkout / "scripts" / "dev").mkdir(parents=True)
    for name in ("device_h200.sh", "device_common.sh", "device_env.sh"):
        shutil.copy(root / "scripts" / "dev" / name, checkout / "scripts" / "dev" / name)
    (checkout / ".vllm-peer").mkdir()
    (checkout / ".vllm-peer" / "vllm.tar.xz.part-zz").write_bytes(b"part")
    out, vp = tmp_path / "out", tmp_path / "vp"
    run = subprocess.run(["bash", "scripts/dev/device_h200.sh"], cwd=checkout, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "NO_BUNDLE": "1", "SETUPS": "peer", "OUT": str(out), "VP_DIR": str(vp),
                              "HOME": str(tmp_path)})  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert (vp / "vllm.tar.xz.part-zz").read_bytes() == b"part"
    assert "copied 1 part(s)" in run.stdout and (out / "h200.tgz").is_file()


def test_device_h200_variants_keep_the_engines_defaults_unless_they_say_otherwise() -> None:
    """bench_q30's and profile_q30's variants ("backend[+cublas][+ds][+pga]"): a plain backend runs the engine's
    defaults (the gemv kernel on), "+cublas" one-row linears on cuBLAS, "+ds" the small experts' per-slot down pass,
    "+pga" prefill graphs for GQA models; a variant's files are named without "+" (result files with one in their
    names do not come back from the GPU machine)."""
    script = (Path(__file__).resolve().parents[1] / "scripts" / "dev" / "device_h200.sh").read_text()
    names = ("gemv_of()", "tiles_of()", "backend_of()", "label_of()", "pg_of()")
    helpers = "\n".join(line for line in script.splitlines() if line.startswith(names))
    assert helpers.count("\n") == 4, helpers
    calls = "; ".join(f"{fn} {v}" for fn, v in (("gemv_of", "auto"), ("gemv_of", "triton+cublas"), ("tiles_of", "auto"),
                                                  ("tiles_of", "triton+ds"), ("backend_of", "flashinfer+cublas+ds"),
                                                  ("backend_of", "auto"), ("label_of", "triton+eg"),
                                                  ("pg_of", "auto"), ("pg_of", "auto+pga+ds"),
                                                  ("tiles_of", "auto+ds+pn128"), ("variant_env", "auto"),
                                                  ("variant_env", "auto+nopdl"), ("variant_env", "auto+fi256")))  # fmt: skip
    variant = script[script.index("variant_env() {"):]
    helpers += "\n" + variant[: variant.index("\n}\n") + 2]
    out = subprocess.run(["bash", "-c", f"{helpers}\n{calls}"], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "FLOTILLA_MOE_TILES": ""})  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert " ".join(out.stdout.split("\n")[12:14]) == "FLOTILLA_FLASHINFER_DECODE_ABOVE=256 FLOTILLA_PDL=1"
    assert out.stdout.split("\n")[:12] == [
        "1", "0", "", "ds=1,", "flashinfer", "auto", "triton_eg", "auto", "all", "pn=128,ds=1,", "FLOTILLA_PDL=1",
        "FLOTILLA_PDL=0"]  # fmt: skip
