"""max_model_len from a model folder, as vLLM settles it: the length config.json's keys allow (capped by the
tokenizer's, scaled by the rope scaling), and a longer one asked for refused unless the config allows it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flotilla.models.hf_config import rope_settings, text_config

_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                 "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
"""config.json keys that bound the sequence length, as vLLM reads them (the smallest one given counts)."""
_PRESCALED_ROPE = ("su", "longrope", "llama3")
"""Rope scaling kinds whose config already gives the scaled window as max_position_embeddings."""
DEFAULT_MAX_LEN = 2048
"""The length of a config.json that gives none of _MAX_LEN_KEYS (vLLM's assumption too)."""


def derived_max_model_len(raw: Mapping[str, Any], tokenizer_max_length: float | None = None) -> tuple[int, str]:
    """The longest sequence a config.json allows and what says so, derived as vLLM does: the smallest of its length
    keys (its model_max_length instead, when it has one), capped by the tokenizer's model_max_length, then scaled by
    the rope scaling factor (YaRN: original_max_position_embeddings x factor; llama3 and longrope configs are
    already scaled, as are Gemma 3's)."""
    raw = text_config(raw)
    found = {k: raw[k] for k in _MAX_LEN_KEYS if raw.get(k) is not None}
    if raw.get("model_max_length") is not None:
        key, length = "model_max_length", float(raw["model_max_length"])
    elif found:
        key = min(found, key=lambda k: found[k])
        length = float(found[key])
    else:
        key, length = "no length key, assumed", float(DEFAULT_MAX_LEN)
    if tokenizer_max_length is not None and tokenizer_max_length < length:
        key, length = "tokenizer_config.json's model_max_length", float(tokenizer_max_length)
    _, scaling = rope_settings(raw)
    prescaled = scaling is None or scaling["rope_type"] in _PRESCALED_ROPE or "gemma3" in raw.get("model_type", "")
    if scaling is not None and not prescaled:
        factor = float(scaling.get("factor") or 1.0)
        if scaling["rope_type"] == "yarn":
            length = float(scaling["original_max_position_embeddings"])
            key = f"original_max_position_embeddings {length:g}"
        if factor != 1.0:
            key = f"{key} x factor {factor:g} ({scaling['rope_type']} rope scaling)"
        length *= factor
    return int(length), key


def resolve_max_model_len(requested: int | None, raw: Mapping[str, Any], tokenizer_max_length: float | None = None,
                          name: str = "the model") -> int:
    """max_model_len as vLLM settles it: the derived length when none is asked for; a longer one than that is refused
    (RoPE positions past what the model was trained or scaled for give garbage) unless config.json's own
    model_max_length allows it."""
    derived, source = derived_max_model_len(raw, tokenizer_max_length)
    if requested is None:
        return derived
    text = text_config(raw)
    allowed = text.get("model_max_length")
    if requested > derived and not (allowed is not None and requested <= allowed) \
            and any(text.get(k) is not None for k in _MAX_LEN_KEYS):
        raise ValueError(f"max_model_len {requested} is longer than {name} allows: {derived} ({source}). Positions "
                         "past the window the model's RoPE was trained or scaled for give wrong outputs; lower "
                         "max_model_len, or give config.json the model's rope_scaling (e.g. YaRN's factor)")
    return requested


def load_max_model_len(requested: int | None, model_dir: str | Path) -> int:
    """resolve_max_model_len on a model folder: its config.json and, when there, tokenizer_config.json."""
    path = Path(model_dir)
    raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    tokenizer_max_length = None
    if (path / "tokenizer_config.json").is_file():
        value = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("model_max_length")
        tokenizer_max_length = float(value) if isinstance(value, int | float) else None
    return resolve_max_model_len(requested, raw, tokenizer_max_length, name=path.name)
