"""Load a model from a Hugging Face folder (config.json + safetensors) onto a device.

`load_model(path)` reads config.json, picks the class from `architectures`, builds it directly on the
target device in the target dtype (parameters are allocated once, never on CPU first), then streams the
checkpoint shard by shard, tensor by tensor, into `model.load_weights` and checks that every parameter
was filled. `load_model(None)` loads the embedded default model (SmolLM2-135M-Instruct, see
default_model.py). Every failure is a ModelLoadError whose message names the file or tensor at fault.

dtype "auto" keeps the checkpoint's own dtype (config.json `torch_dtype` / `dtype`, else the dtype of
its first floating tensor, else float32) on every device, CPU included: bf16 runs on CPU, and silently
widening a model would double its memory. Pass dtype explicitly to cast.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

from flotilla.kernels.quant.fp8_ref import dequantize_checkpoint
from flotilla.models.default_model import DefaultModelError, default_model_dir
from flotilla.models.gguf import GGUFError
from flotilla.models.hf_config import HFModelConfig, parse_hf_config
from flotilla.models.progress import progress_disabled
from flotilla.models.registry import get_model_class

logger = logging.getLogger(__name__)

SUPPORTED_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
# Checkpoint tensors of these dtypes are cast to the model dtype; any other dtype (int, fp8 weights)
# reaches load_weights untouched, and so do FP8 block scales (float32 `*_scale_inv`: bf16 would round them).
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_KEEP_DTYPE_SUFFIXES = ("_scale_inv",)
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
                "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
"""Bytes per element of a safetensors dtype: a tensor left unread still advances the progress bar."""

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


class ModelLoadError(Exception):
    """A model folder that cannot be loaded; the message names the file or tensor at fault."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready to run: the module (eval mode, on its device), its parsed config, where it came
    from, and the dtype of its parameters."""

    module: nn.Module
    config: HFModelConfig
    model_dir: Path
    dtype: torch.dtype


def load_model(
    model: str | Path | None = None,
    dtype: torch.dtype | str = "auto",
    device: torch.device | str = "cpu",
    progress: bool = True,
    model_kwargs: Mapping[str, Any] | None = None,
    load_format: str = "auto",
    vision_only: bool = False,
) -> LoadedModel:
    """Load the HF model folder `model` (None: the embedded default model) onto `device`.

    dtype: "auto" (the checkpoint's dtype), a torch dtype, or a name ("bfloat16", "fp16", ...).
    progress: show a tqdm bar on stderr (only when stderr is a terminal).
    model_kwargs: extra keyword arguments for the model class, e.g. {"attention_backend": "torch"}.
    load_format: "auto" reads the safetensors; "dummy" (vLLM's name) needs only config.json and fills every
    parameter with small seeded random values on the device: real shapes for benchmarks, no weights to ship.
    vision_only: the vision tower of a model that takes images, alone (the class's `vision_tower`).
    """
    started = time.perf_counter()
    if load_format not in ("auto", "dummy"):
        raise ModelLoadError(f"load_format must be auto or dummy, got {load_format!r}")
    if not (isinstance(dtype, str) and dtype.lower() == "auto"):
        dtype = parse_dtype(dtype)  # refuse a bad request before touching the disk
    model_dir = _resolve_model_dir(model, progress)
    config = read_config(model_dir)
    if load_format == "dummy":
        return _load_dummy(config, model_dir, dtype, torch.device(device), dict(model_kwargs or {}), started,
                           vision_only)
    files = checkpoint_files(model_dir)
    target_dtype = resolve_dtype(dtype, config, files)
    torch_device = torch.device(device)
    module = _build_module(config, model_dir, target_dtype, torch_device, dict(model_kwargs or {}), vision_only)

    total = sum(_payload_bytes(path) for path in files)
    bar = tqdm(
        total=total,
        desc=f"Loading {model_dir.name}",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        disable=progress_disabled(progress),
    )
    last: list[tuple[str, Path]] = []  # the tensor being loaded, to name it when load_weights fails
    with bar:
        try:
            keep = module.checkpoint_filter() if hasattr(module, "checkpoint_filter") else None
            stream = _stream_tensors(files, target_dtype, bar, last, keep)
            if config.quantization is not None and not getattr(module, "reads_fp8_checkpoints", False):
                logger.info("%s: FP8 block-scaled checkpoint: its weights are dequantized to %s as they load (%s "
                            "keeps no FP8 weights)", model_dir.name, str(target_dtype).removeprefix("torch."),
                            type(module).__name__)
                stream = dequantize_checkpoint(stream, config.quantization.weight_block_size, target_dtype)
            loaded = module.load_weights(stream)
        except (ValueError, KeyError, RuntimeError) as e:
            where = f"tensor {last[-1][0]!r} of {last[-1][1]}" if last else str(model_dir)
            raise ModelLoadError(f"cannot load {where}: {e}") from e

    expected = {name for name, _ in module.named_parameters()}
    if missing := sorted(expected - set(loaded)):
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ModelLoadError(f"checkpoint in {model_dir} lacks tensors for parameters: {shown}")
    module.eval()
    logger.info(
        "loaded %s (%s, %s, %.0f MiB) in %.2f s",
        model_dir,
        type(module).__name__,
        str(target_dtype).removeprefix("torch."),
        total / 2**20,
        time.perf_counter() - started,
    )
    return LoadedModel(module=module, config=config, model_dir=model_dir, dtype=target_dtype)


def _load_dummy(config: HFModelConfig, model_dir: Path, dtype: torch.dtype | str, device: torch.device,
                kwargs: dict[str, Any], started: float, vision_only: bool = False) -> LoadedModel:
    target = (config.torch_dtype or torch.float32) if isinstance(dtype, str) else dtype
    module = _build_module(config, model_dir, target, device, kwargs, vision_only)
    generator = torch.Generator(device=device)
    # modules with a dummy_init_ (FP8 block-scaled linears: e4m3 weights + their scales) fill their own
    custom = [(name, m) for name, m in module.named_modules() if hasattr(m, "dummy_init_")]
    own = {id(p) for _, m in custom for p in m.parameters(recurse=False)}
    # Each tensor's values follow from its own name, not from its place in the module's order: a model built with an
    # extra part (DeepSeek's MTP layer for speculative decoding) gets the same weights everywhere else, so a
    # benchmark can compare it with the plain model's tokens.
    with torch.no_grad():
        for name, param in module.named_parameters():
            # small values keep activations finite through any depth; nothing is meant to be meaningful
            if id(param) not in own:
                param.uniform_(-1e-3, 1e-3, generator=generator.manual_seed(zlib.crc32(name.encode())))
        for name, m in custom:
            m.dummy_init_(generator.manual_seed(zlib.crc32(name.encode())))
    module.eval()
    size = sum(p.numel() * p.element_size() for p in module.parameters())
    logger.info("built %s with dummy weights (%s, %s, %.0f MiB) in %.2f s", model_dir, type(module).__name__,
                str(target).removeprefix("torch."), size / 2**20, time.perf_counter() - started)
    return LoadedModel(module=module, config=config, model_dir=model_dir, dtype=target)


def _resolve_model_dir(model: str | Path | None, progress: bool) -> Path:
    """The folder to load: the default model's (converted on first use) or the given existing folder."""
    if model is None:
        try:
            return default_model_dir(progress=progress)
        except (DefaultModelError, GGUFError) as e:
            raise ModelLoadError(str(e)) from e
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model folder {path} does not exist (expected a local folder with config.json and *.safetensors)"
        )
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a folder (expected config.json and *.safetensors in it)")
    return path.resolve()


def read_config(model_dir: Path) -> HFModelConfig:
    """Parse <model_dir>/config.json; ModelLoadError naming the file when missing or malformed."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing: {model_dir} is not a Hugging Face model folder")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    try:
        return parse_hf_config(raw)
    except (ValueError, TypeError, KeyError) as e:
        raise ModelLoadError(f"invalid {path}: {e}") from e


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a folder, in load order: the index's shards, model.safetensors, or *.safetensors."""
    index_path = model_dir / SAFETENSORS_INDEX
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))  # shard order of first appearance
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"cannot read the shard index {index_path}: {e}") from e
        files = [model_dir / name for name in names]
        if absent := [str(f) for f in files if not f.is_file()]:
            raise ModelLoadError(f"{index_path} lists shard files that are missing: {', '.join(absent)}")
        if not files:
            raise ModelLoadError(f"{index_path} lists no tensors")
        return files
    if (model_dir / SAFETENSORS_SINGLE).is_file():
        return [model_dir / SAFETENSORS_SINGLE]
    if files := sorted(model_dir.glob("*.safetensors")):
        return files
    other = sorted(p.name for p in model_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
    hint = f" (found {', '.join(other)}: only safetensors checkpoints are supported)" if other else ""
    raise ModelLoadError(f"no {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX} or *.safetensors in {model_dir}{hint}")


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A supported torch dtype from a dtype or its name; ModelLoadError for anything else."""
    if isinstance(dtype, torch.dtype):
        if dtype in SUPPORTED_DTYPES.values():
            return dtype
        name = str(dtype).removeprefix("torch.")
    else:
        name = dtype.lower().removeprefix("torch.")
        if name in SUPPORTED_DTYPES:
            return SUPPORTED_DTYPES[name]
    raise ModelLoadError(f"dtype {name!r} is not supported; choose float32, bfloat16 or float16 (or 'auto')")


def resolve_dtype(dtype: torch.dtype | str, config: HFModelConfig, files: list[Path]) -> torch.dtype:
    """The parameter dtype: the requested one, or for "auto" the checkpoint's own."""
    if not (isinstance(dtype, str) and dtype.lower() == "auto"):
        return parse_dtype(dtype)
    if config.dtype is not None:
        try:
            return parse_dtype(config.dtype)
        except ModelLoadError as e:
            raise ModelLoadError(f"config.json torch_dtype: {e}") from e
    for path in files:
        with _open_safetensors(path) as f:
            for name in f.keys():
                found = f.get_slice(name).get_dtype()
                if found in ("F32", "BF16", "F16"):
                    return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[found]
    return torch.float32


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily make `dtype` the default floating dtype (how parameters get it at construction)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _build_module(
    config: HFModelConfig, model_dir: Path, dtype: torch.dtype, device: torch.device, kwargs: dict[str, Any],
    vision_only: bool = False,
) -> nn.Module:
    """Instantiate the config's model class (or its vision tower alone) with its parameters born on `device` in
    `dtype`."""
    try:
        cls = get_model_class(config.architectures)
    except ValueError as e:
        raise ModelLoadError(f"{model_dir / 'config.json'}: {e}") from e
    if vision_only:
        if not hasattr(cls, "vision_tower"):
            raise ModelLoadError(f"{model_dir.name} ({cls.__name__}) takes no images: it has no vision tower")
        try:
            with torch.device(device), _default_dtype(dtype):
                return cls.vision_tower(config)
        except ValueError as e:
            raise ModelLoadError(f"{model_dir / 'config.json'}: {e}") from e
    accepted = inspect.signature(cls).parameters
    if unknown := [f"{k}={v!r}" for k, v in kwargs.items() if k not in accepted]:
        # e.g. a moe_backend forced for a model without experts: say so instead of ignoring it
        raise ModelLoadError(f"{model_dir.name} ({cls.__name__}) takes no {', '.join(unknown)}: that option does not "
                             "apply to this model; leave it at auto")
    try:
        with torch.device(device), _default_dtype(dtype):
            module = cls(config, **kwargs)
    except (NotImplementedError, ValueError) as e:
        raise ModelLoadError(f"{model_dir / 'config.json'}: {cls.__name__} cannot be built: {e}") from e
    return module


@contextmanager
def _open_safetensors(path: Path) -> Iterator[Any]:
    """safe_open on CPU, turning a corrupt or unreadable file into a ModelLoadError naming it."""
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"cannot open safetensors file {path}: {e}") from e
    with handle as f:
        yield f


def _payload_bytes(path: Path) -> int:
    """Bytes of tensor data in a safetensors file (its size minus the JSON header), for the progress bar."""
    try:
        with path.open("rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
        return max(path.stat().st_size - 8 - header_len, 0)
    except (OSError, struct.error) as e:
        raise ModelLoadError(f"cannot read safetensors file {path}: {e}") from e


def _stream_tensors(
    files: list[Path], dtype: torch.dtype, bar: tqdm, last: list[tuple[str, Path]],
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from each file in turn, floating tensors cast to `dtype`; records the
    current tensor in `last` so a failure inside load_weights can be attributed to it. Tensors the model's
    `checkpoint_filter` does not `keep` (other expert-parallel ranks' experts) are not read."""
    for path in files:
        with _open_safetensors(path) as f:
            for name in f.keys():
                if keep is not None and not keep(name):
                    header = f.get_slice(name)
                    bar.update(math.prod(header.get_shape()) * _DTYPE_BYTES.get(header.get_dtype(), 0))
                    continue
                last[:] = [(name, path)]
                try:
                    tensor = f.get_tensor(name)
                except SafetensorError as e:
                    raise ModelLoadError(f"cannot read tensor {name!r} of {path}: {e}") from e
                stored = tensor.numel() * tensor.element_size()
                if tensor.dtype in _CASTABLE and tensor.dtype != dtype and not name.endswith(_KEEP_DTYPE_SUFFIXES):
                    tensor = tensor.to(dtype)
                bar.update(stored)
                yield name, tensor
