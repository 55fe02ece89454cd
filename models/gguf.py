"""Convert a llama-architecture GGUF file (llama.cpp's format) into a Hugging Face model folder.

The folder holds config.json, generation_config.json, tokenizer.json, tokenizer_config.json and
float32 weights in model.safetensors, so both flotilla's loader and HF transformers read it. Quantized
tensors (Q4_1, Q8_0, ...) are dequantized once here; the engine never sees a GGUF at run time.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm.auto import tqdm

from flotilla.models.progress import progress_disabled

# Bump whenever the folder this module writes changes, so cached conversions are redone.
GGUF_CONVERTER_VERSION = 1

# llama.cpp token types (llama_token_type): only these two matter for building the tokenizer.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# tokenizer.ggml.pre -> whether digits are split one by one before the GPT-2 regex. llama.cpp runs the
# regex "\p{N}" and then the GPT-2 regex for the first group, only the GPT-2 regex for the second,
# which is what HF's Digits(individual_digits=True) + ByteLevel(use_regex=True) do.
_PRE_TOKENIZER_SPLITS_DIGITS = {
    "smollm": True,
    "starcoder": True,
    "refact": True,
    "codeshell": True,
    "gpt2": False,
    "default": False,
}

# GGUF tensor name (per block, without "blk.N.") -> HF Llama parameter name (without "model.layers.N.").
_BLOCK_TENSORS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFError(ValueError):
    """A GGUF file that is unreadable or describes something this converter does not handle."""


def read_gguf(path: Path) -> gguf.GGUFReader:
    """Open a GGUF file (memory-mapped), turning parse failures into a GGUFError naming the file."""
    try:
        return gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise GGUFError(f"cannot read GGUF file {path}: {e}") from e


def metadata(reader: gguf.GGUFReader, key: str, default: Any = ...) -> Any:
    """One metadata value as a Python object; a missing key without a default is a GGUFError."""
    field = reader.get_field(key)
    if field is None:
        if default is ...:
            raise GGUFError(f"GGUF metadata key {key!r} is missing")
        return default
    return field.contents()


def _float32_value(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def hf_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """config.json for a LlamaForCausalLM, from the llama.* metadata."""
    arch = metadata(reader, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    hidden = int(metadata(reader, "llama.embedding_length"))
    heads = int(metadata(reader, "llama.attention.head_count"))
    head_dim = int(metadata(reader, "llama.rope.dimension_count", hidden // heads))
    if head_dim * heads != hidden:
        raise GGUFError(f"rotary dimension {head_dim} x {heads} heads != hidden size {hidden}: not supported")
    if reader.get_field("llama.rope.scaling.type") is not None:
        raise GGUFError("GGUF files with rope scaling are not supported")
    vocab_size = metadata(reader, "llama.vocab_size", None)
    if vocab_size is None:
        vocab_size = len(metadata(reader, "tokenizer.ggml.tokens"))
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    rope_theta = _float32_value(metadata(reader, "llama.rope.freq_base", 10000.0))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(metadata(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(metadata(reader, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(metadata(reader, "llama.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(metadata(reader, "llama.context_length")),
        "rms_norm_eps": _float32_value(metadata(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": int(metadata(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(metadata(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": metadata(reader, "tokenizer.ggml.padding_token_id", None),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def hf_generation_config(config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: the special token ids, no sampling defaults (the GGUF carries none)."""
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    if config["pad_token_id"] is not None:
        generation["pad_token_id"] = config["pad_token_id"]
    return generation


def hf_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """The byte-level BPE tokenizer the GGUF describes, as a `tokenizers.Tokenizer`."""
    kind = metadata(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    pre = metadata(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZER_SPLITS_DIGITS:
        raise GGUFError(f"GGUF pre-tokenizer {pre!r} is not supported (known: {sorted(_PRE_TOKENIZER_SPLITS_DIGITS)})")
    tokens: list[str] = metadata(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = metadata(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(merge.split(" ", 1)) for merge in metadata(reader, "tokenizer.ggml.merges")]
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFError("GGUF vocabulary has duplicate tokens")

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    prefix_space = bool(metadata(reader, "tokenizer.ggml.add_space_prefix", False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space, trim_offsets=True, use_regex=True)
    if _PRE_TOKENIZER_SPLITS_DIGITS[pre]:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True)
    # Control tokens (<|im_start|>, ...) must match whole in the text and never be split by BPE.
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, token_types) if k == _TOKEN_TYPE_CONTROL]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, token_types)
            if k == _TOKEN_TYPE_USER_DEFINED
        ]
    )
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GGUFError("GGUF special tokens are not all part of the vocabulary")
    return tokenizer


def hf_tokenizer_config(reader: gguf.GGUFReader, config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer_config.json: special tokens by content, the chat template, and the context length."""
    tokens: list[str] = metadata(reader, "tokenizer.ggml.tokens")
    token_types: list[int] = metadata(reader, "tokenizer.ggml.token_type", [1] * len(tokens))

    def token(key: str) -> str | None:
        index = metadata(reader, f"tokenizer.ggml.{key}", None)
        return None if index is None else tokens[int(index)]

    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": k == _TOKEN_TYPE_CONTROL,
        }
        for i, (t, k) in enumerate(zip(tokens, token_types))
        if k in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    }
    tokenizer_config: dict[str, Any] = {
        # PreTrainedTokenizerFast loads tokenizer.json as written; a named class may rebuild its own pipeline.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": bool(metadata(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "vocab_size": len(tokens),
    }
    chat_template = metadata(reader, "tokenizer.chat_template", None)
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    return tokenizer_config


def _hf_tensor_name(name: str) -> str:
    """HF Llama parameter name for a GGUF tensor name; GGUFError for one with no counterpart."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    prefix, _, rest = name.partition(".")
    layer, _, suffix = rest.partition(".")
    if prefix == "blk" and layer.isdigit() and suffix in _BLOCK_TENSORS:
        return f"model.layers.{layer}.{_BLOCK_TENSORS[suffix]}"
    raise GGUFError(f"GGUF tensor {name!r} has no Hugging Face Llama counterpart")


def _unpermute_rotary(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's interleaved rotary row order for a q/k projection (HF uses rotate-half)."""
    out, inp = weight.shape
    return weight.reshape(n_head, out // n_head // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


def iter_state_dict(reader: gguf.GGUFReader, config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array in HF layout) for every tensor in the file, dequantized one at a time."""
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name)
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise GGUFError(f"GGUF tensor {tensor.name!r}: type {tensor.tensor_type.name} cannot be dequantized") from e
        # GGUF lists dimensions fastest-first (ggml "ne"); torch wants them slowest-first.
        array = np.ascontiguousarray(array.reshape(tuple(int(d) for d in reversed(tensor.shape))), dtype=np.float32)
        if name.endswith("q_proj.weight"):
            array = _unpermute_rotary(array, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            array = _unpermute_rotary(array, config["num_key_value_heads"])
        yield name, array


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path, progress: bool = True, desc: str | None = None) -> None:
    """Write an HF model folder for `gguf_path` into the existing directory `out_dir`."""
    reader = read_gguf(gguf_path)
    config = hf_config(reader)
    tokenizer = hf_tokenizer(reader)
    tokenizer_config = hf_tokenizer_config(reader, config)
    tensors: dict[str, np.ndarray] = {}
    bar = tqdm(
        iter_state_dict(reader, config),
        total=len(reader.tensors),
        desc=desc or f"Converting {gguf_path.name}",
        unit="tensor",
        disable=progress_disabled(progress),
    )
    for name, array in bar:
        tensors[name] = array
    expected = _expected_tensors(config)
    if missing := sorted(expected - tensors.keys()):
        raise GGUFError(f"GGUF file {gguf_path} lacks tensors for {missing[:5]} ({len(missing)} missing)")
    # (safetensors' numpy writer: the tokenizer process converts the default model without importing torch)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out_dir / "model.safetensors", 0o644)  # safetensors creates it owner-only
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", hf_generation_config(config))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)


def _expected_tensors(config: dict[str, Any]) -> set[str]:
    """Every HF parameter name a Llama with this config needs."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for layer in range(config["num_hidden_layers"]):
        names.update(f"model.layers.{layer}.{suffix}" for suffix in _BLOCK_TENSORS.values())
    return names


def _write_json(path: Path, value: dict[str, Any]) -> None:
    """Write pretty JSON with a trailing newline."""
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
