"""models/loader.py: HF folders (fp32/bf16/fp16, sharded, tied) load exactly; every failure names its culprit."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers_tiny_models import PagedRunner, hf_logits, load_hf_model, write_tiny_model
from safetensors.torch import load_file, save_file

from flotilla.models.loader import LoadedModel, ModelLoadError, load_model

_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _expected_params(checkpoint: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """flotilla parameter name -> value, derived from an HF Llama state dict (q/k/v and gate/up fused)."""
    expected = {
        name: t for name, t in checkpoint.items() if not any(f".{p}." in name for ps in _FUSED.values() for p in ps)
    }
    for fused, parts in _FUSED.items():
        for name in checkpoint:
            if f".{parts[0]}." in name:
                expected[name.replace(f".{parts[0]}.", f".{fused}.")] = torch.cat(
                    [checkpoint[name.replace(f".{parts[0]}.", f".{p}.")] for p in parts]
                )
    return expected


def _assert_params_equal(loaded: LoadedModel, checkpoint: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    """Every parameter has `dtype` and equals the checkpoint tensor cast to `dtype`, bit for bit."""
    params = dict(loaded.module.named_parameters())
    expected = _expected_params(checkpoint)
    assert set(params) == set(expected) - ({"lm_head.weight"} if loaded.config.tie_word_embeddings else set())
    for name, param in params.items():
        assert param.dtype == dtype, name
        assert torch.equal(param, expected[name].to(dtype)), name


def _set_config(model_dir: Path, **changes: object) -> None:
    """Rewrite keys of a folder's config.json."""
    path = model_dir / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random fp32 Llama folder (read-only: copy it before changing anything)."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture
def llama_copy(tiny_llama: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny Llama folder that a test may break."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "llama"))


def test_fp32_checkpoint_loads_exactly(tiny_llama: Path) -> None:
    loaded = load_model(tiny_llama, progress=False)
    assert loaded.dtype == torch.float32
    assert loaded.model_dir == tiny_llama.resolve()
    assert loaded.config.architectures == ("LlamaForCausalLM",)
    assert not loaded.module.training
    _assert_params_equal(loaded, load_file(tiny_llama / "model.safetensors"), torch.float32)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
def test_half_checkpoint_keeps_its_dtype_on_auto(llama_copy: Path, stored: torch.dtype) -> None:
    checkpoint = {k: v.to(stored) for k, v in load_file(llama_copy / "model.safetensors").items()}
    save_file(checkpoint, llama_copy / "model.safetensors", metadata={"format": "pt"})
    _set_config(llama_copy, torch_dtype=str(stored).removeprefix("torch."), dtype=str(stored).removeprefix("torch."))
    loaded = load_model(llama_copy, progress=False)
    assert loaded.dtype == stored
    _assert_params_equal(loaded, checkpoint, stored)


def test_auto_dtype_falls_back_to_the_tensors_dtype(llama_copy: Path) -> None:
    checkpoint = {k: v.to(torch.bfloat16) for k, v in load_file(llama_copy / "model.safetensors").items()}
    save_file(checkpoint, llama_copy / "model.safetensors")
    raw = json.loads((llama_copy / "config.json").read_text())
    raw.pop("torch_dtype", None)
    raw.pop("dtype", None)
    (llama_copy / "config.json").write_text(json.dumps(raw))
    assert load_model(llama_copy, progress=False).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("requested", "dtype"), [("bfloat16", torch.bfloat16), ("fp16", torch.float16), (torch.float32, torch.float32)]
)
def test_explicit_dtype_casts(tiny_llama: Path, requested: str | torch.dtype, dtype: torch.dtype) -> None:
    loaded = load_model(tiny_llama, dtype=requested, progress=False)
    assert loaded.dtype == dtype
    _assert_params_equal(loaded, load_file(tiny_llama / "model.safetensors"), dtype)


def test_fp16_checkpoint_cast_up_to_fp32(llama_copy: Path) -> None:
    checkpoint = {k: v.half() for k, v in load_file(llama_copy / "model.safetensors").items()}
    save_file(checkpoint, llama_copy / "model.safetensors")
    _set_config(llama_copy, torch_dtype="float16")
    _assert_params_equal(load_model(llama_copy, dtype="float32", progress=False), checkpoint, torch.float32)


def _shard(model_dir: Path) -> dict[str, torch.Tensor]:
    """Split model.safetensors into two shards plus an index, as HF does for big checkpoints."""
    checkpoint = load_file(model_dir / "model.safetensors")
    (model_dir / "model.safetensors").unlink()
    names = sorted(checkpoint)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for filename, part in halves.items():
        save_file({n: checkpoint[n] for n in part}, model_dir / filename, metadata={"format": "pt"})
        weight_map.update({n: filename for n in part})
    index = {"metadata": {"total_size": sum(t.nbytes for t in checkpoint.values())}, "weight_map": weight_map}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    return checkpoint


def test_sharded_checkpoint(llama_copy: Path) -> None:
    checkpoint = _shard(llama_copy)
    _assert_params_equal(load_model(llama_copy, progress=True), checkpoint, torch.float32)


def test_tied_embeddings(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path / "tied", "llama_tied")
    checkpoint = load_file(model_dir / "model.safetensors")
    assert "lm_head.weight" not in checkpoint
    loaded = load_model(model_dir, progress=False)
    assert loaded.config.tie_word_embeddings
    _assert_params_equal(loaded, checkpoint, torch.float32)


def test_loaded_model_matches_transformers(tiny_llama: Path) -> None:
    loaded = load_model(tiny_llama, progress=False, model_kwargs={"attention_backend": "torch"})
    prompt = [1, 17, 99, 5, 250, 3, 42]
    (logits,) = PagedRunner(loaded.module).step([(0, prompt)])
    torch.testing.assert_close(logits, hf_logits(load_hf_model(tiny_llama), prompt), rtol=1e-4, atol=1e-4)


# ---- failures: a ModelLoadError whose message names the file or tensor at fault ----


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no-such-model.*does not exist"):
        load_model(tmp_path / "no-such-model", progress=False)


def test_path_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "weights.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="weights.gguf is not a folder"):
        load_model(tmp_path / "weights.gguf", progress=False)


def test_missing_config(llama_copy: Path) -> None:
    (llama_copy / "config.json").unlink()
    with pytest.raises(ModelLoadError, match=r"config\.json is missing"):
        load_model(llama_copy, progress=False)


def test_unreadable_config(llama_copy: Path) -> None:
    (llama_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"cannot read .*config\.json"):
        load_model(llama_copy, progress=False)


def test_config_missing_sizes(llama_copy: Path) -> None:
    (llama_copy / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match=r"config\.json.*hidden_size"):
        load_model(llama_copy, progress=False)


def test_unknown_architecture(llama_copy: Path) -> None:
    _set_config(llama_copy, architectures=["FancyNewForCausalLM"])
    with pytest.raises(ModelLoadError, match=r"config\.json.*FancyNewForCausalLM.*LlamaForCausalLM"):
        load_model(llama_copy, progress=False)


def test_wrong_shape_tensor(llama_copy: Path) -> None:
    checkpoint = load_file(llama_copy / "model.safetensors")
    checkpoint["model.layers.1.mlp.down_proj.weight"] = torch.zeros(3, 5)
    save_file(checkpoint, llama_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*model\.safetensors.*shape"):
        load_model(llama_copy, progress=False)


def test_wrong_shape_in_fused_tensor(llama_copy: Path) -> None:
    checkpoint = load_file(llama_copy / "model.safetensors")
    checkpoint["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(7, 64)
    save_file(checkpoint, llama_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_model(llama_copy, progress=False)


@pytest.mark.parametrize("missing", ["model.norm.weight", "model.layers.2.self_attn.v_proj.weight", "lm_head.weight"])
def test_missing_tensor(llama_copy: Path, missing: str) -> None:
    checkpoint = load_file(llama_copy / "model.safetensors")
    del checkpoint[missing]
    save_file(checkpoint, llama_copy / "model.safetensors")
    fused = re.escape(missing.replace("v_proj", "qkv_proj"))
    with pytest.raises(ModelLoadError, match=rf"{re.escape(str(llama_copy))}.*lacks tensors.*{fused}"):
        load_model(llama_copy, progress=False)


def test_unknown_tensor(llama_copy: Path) -> None:
    checkpoint = load_file(llama_copy / "model.safetensors")
    checkpoint["model.layers.0.mystery.weight"] = torch.zeros(4)
    save_file(checkpoint, llama_copy / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mystery\.weight"):
        load_model(llama_copy, progress=False)


def test_missing_shard(llama_copy: Path) -> None:
    _shard(llama_copy)
    (llama_copy / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"model-00002-of-00002\.safetensors"):
        load_model(llama_copy, progress=False)


def test_corrupt_safetensors(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        load_model(llama_copy, progress=False)


def test_no_weights(llama_copy: Path) -> None:
    (llama_copy / "model.safetensors").rename(llama_copy / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"no model\.safetensors.*pytorch_model\.bin.*only safetensors"):
        load_model(llama_copy, progress=False)


@pytest.mark.parametrize("dtype", ["int8", torch.float64, "float8"])
def test_unsupported_dtype(tiny_llama: Path, dtype: str | torch.dtype) -> None:
    with pytest.raises(ModelLoadError, match="dtype .* is not supported"):
        load_model(tiny_llama, dtype=dtype, progress=False)


def test_unsupported_checkpoint_dtype_in_config(llama_copy: Path) -> None:
    _set_config(llama_copy, torch_dtype="float8_e4m3fn", dtype="float8_e4m3fn")
    with pytest.raises(ModelLoadError, match=r"config\.json.*float8_e4m3fn.*not supported"):
        load_model(llama_copy, progress=False)
