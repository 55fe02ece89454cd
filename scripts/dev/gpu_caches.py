"""The GPU suite's JIT caches (FlashInfer, DeepGEMM, Triton): where each library keeps its builds, archived between
runs on the GPU machine as xz-compressed parts of at most PART_BYTES named by their content, unpacked with their
files' times, and FlashInfer's built modules linked where it loads prebuilt ones without running ninja
(scripts/dev/gpu_suite.py)."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import lzma
import shutil
import subprocess
import tarfile
from pathlib import Path

PART_BYTES = 15 << 20
"""The largest result file a run writes: archives are split into parts of this size."""



def jit_cache_dirs(environ: dict[str, str]) -> dict[str, Path]:
    """Where FlashInfer, DeepGEMM and Triton keep their JIT builds (each library's own variable, else its default), in
    the order they are kept when the archives would pass --cache-max-mb: FlashInfer's are the slowest to build."""
    home = Path(environ.get("HOME", str(Path.home())))
    triton_home = Path(environ.get("TRITON_HOME", str(home)))
    return {
        "flashinfer": Path(environ.get("FLASHINFER_WORKSPACE_BASE", str(home))) / ".cache" / "flashinfer",
        "deep_gemm": Path(environ.get("DG_JIT_CACHE_DIR", str(home / ".deep_gemm"))),
        "triton": Path(environ.get("TRITON_CACHE_DIR", str(triton_home / ".triton" / "cache"))),
    }


def tree_digest(root: Path) -> str | None:
    """A digest of a folder's file names, sizes and modification times in whole seconds, as a tar archive keeps
    them (None: no folder or no files)."""
    if not root.is_dir():
        return None
    h = hashlib.sha256()
    files = 0
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        st = path.stat()
        h.update(f"{path.relative_to(root)}\0{st.st_size}\0{int(st.st_mtime)}\n".encode())
        files += 1
    return h.hexdigest()[:12] if files else None


def restore_cache(parts: list[Path], dest: Path) -> int:
    """Unpack an archive's parts (joined in order; xz, or gzip as older calls wrote them) into dest, keeping the
    files' times (FlashInfer's ninja rebuilds what looks older than its sources); returns the archive's size."""
    data = b"".join(p.read_bytes() for p in parts)
    dest.mkdir(parents=True, exist_ok=True)
    mode = "r:gz" if ".tgz." in parts[0].name else "r:xz"
    with tarfile.open(fileobj=io.BytesIO(data), mode=mode) as tar:
        tar.extractall(dest, filter="tar")
    return len(data)


def xz(data: bytes) -> bytes:
    """data compressed by xz on every core when the xz program is there (a cache of 90 MB in seconds), else by
    Python's lzma on one."""
    program = shutil.which("xz")
    if program is not None:
        done = subprocess.run([program, "-T0", "-6", "-c"], input=data, capture_output=True)
        if done.returncode == 0:
            return done.stdout
    return lzma.compress(data, preset=6)


# Triton keeps each compilation stage's text beside the cubin; a cache hit loads only the cubin, the metadata json
# and the launcher .so (a group's missing members are skipped), and the text is most of the cache's size.
TRITON_IR_SUFFIXES = (".ttir", ".ttgir", ".llir", ".ptx", ".source", ".amdgcn")


def archive_cache(name: str, root: Path, digest: str, out: Path, part_bytes: int = PART_BYTES) -> list[str]:
    """The folder as an xz-compressed tar (compiled kernels shrink to about a third of what gzip leaves: the caches
    travel to each fresh GPU machine beside the bundle) split into parts of at most part_bytes under out;
    returns the parts' names. Triton's intermediate stages are left out."""
    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if name == "triton" and info.isfile() and info.name.endswith(TRITON_IR_SUFFIXES) else info

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(root.iterdir()):
            tar.add(path, arcname=path.name, filter=keep)
    data = xz(buf.getvalue())
    names = []
    for i in range(0, max(len(data), 1), part_bytes):
        names.append(f"jit-{name}-{digest}.txz.{i // part_bytes:02d}")
        (out / names[-1]).write_bytes(data[i:i + part_bytes])
    return names


def prune(cache_dir: Path, state_file: str) -> list[str]:
    """Delete the cache archives in cache_dir that its state file (suite.json) does not name; the names deleted."""
    state = json.loads((cache_dir / state_file).read_text()) if (cache_dir / state_file).is_file() else {}
    named = {p for archive in state.get("caches", {}).values() for p in archive["parts"]}
    stale = sorted(f.name for f in cache_dir.glob("jit-*") if f.name not in named)
    for name in stale:
        (cache_dir / name).unlink()
    return stale


def flashinfer_aot_dir() -> Path | None:
    """The installed FlashInfer's folder of prebuilt modules (its package's data/aot), found without importing it."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "aot"


def gpu_arch() -> str | None:
    """The first GPU's compute capability as FlashInfer names its cache folders' prefix ("90" for sm_90)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0].replace(".", "") if out else None


def promote_flashinfer(cache_root: Path, aot_dir: Path, version: str, arch: str) -> int:
    """Link each module the restored FlashInfer cache holds built (<version>/<arch>*/cached_ops/<name>/<name>.so,
    this GPU's arch) into the package's prebuilt-module folder, where FlashInfer loads a module from without running
    ninja (which rebuilds parts of restored modules on a fresh machine). Returns how many were linked."""
    count = 0
    for arch_dir in sorted((cache_root / version).glob(f"{arch}*")):
        for so in sorted(arch_dir.glob("cached_ops/*/*.so")):
            if so.stem != so.parent.name:
                continue
            target = aot_dir / so.stem / so.name
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.symlink_to(so)
                count += 1
    return count


def restore_caches(cache_dir: Path, caches: dict[str, dict], dirs: dict[str, Path]) -> list[str]:
    """Unpack each archive the state names (caches: name -> digest and parts) into its library's folder, dropping
    from `caches` those whose parts are not all there; a note per cache."""
    notes = []
    for name, archive in list(caches.items()):
        paths = [cache_dir / p for p in archive["parts"]]
        if name in dirs and all(p.is_file() for p in paths):
            size = restore_cache(paths, dirs[name])
            notes.append(f"restored the {name} cache ({size / 2**20:.1f} MiB) into {dirs[name]}")
            aot, arch = (flashinfer_aot_dir(), gpu_arch()) if name == "flashinfer" else (None, None)
            if aot is not None and arch is not None:
                with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                    version = importlib.metadata.version("flashinfer-python")
                    linked = promote_flashinfer(dirs[name], aot, version, arch)
                    notes.append(f"linked {linked} built FlashInfer modules into {aot} (loaded without ninja)")
        else:
            notes.append(f"the {name} cache's parts are not all in {cache_dir}: not restored")
            del caches[name]
    return notes
