"""The model folder: where it is, its tokenizer, its context length and its EOS ids (the front end, the tokenizer
and the detokenizer read these; none needs the model's weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from flotilla.config import EngineConfig
from flotilla.models.default_model import default_model_dir
from flotilla.models.context_length import load_max_model_len
from flotilla.models.hf_config import text_config

if TYPE_CHECKING:  # (transformers costs about half a second to import: a worker loads it only to build grammars)
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase


def model_dir(config: EngineConfig) -> Path:
    """The model folder (the embedded default model is converted on first use)."""
    return Path(config.model.model) if config.model.model else default_model_dir()


# Model types for which transformers' AutoTokenizer, given a folder whose tokenizer_config.json names the generic fast
# tokenizer, returns that generic class; and model types whose own class it substitutes for any class the folder
# names (its MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS). tests/test_tokenizer_loading.py checks both against the
# installed transformers.
GENERIC_FAST_TOKENIZER_MODEL_TYPES = frozenset({"llama", "qwen3", "qwen3_moe", "qwen3_vl", "qwen3_vl_moe",
                                                "deepseek_v3", "deepseek_v32", "deepseek_v4", "glm_moe_dsa"})
GENERIC_FAST_TOKENIZER_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
SUBSTITUTED_TOKENIZER_CLASSES = {"qwen3_5": "Qwen3_5Tokenizer", "qwen3_5_moe": "Qwen3_5Tokenizer",
                                 "qwen3_5_moe_text": "Qwen3_5Tokenizer"}


def load_tokenizer(path: Path, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The model folder's tokenizer, as transformers' AutoTokenizer loads it; ``chat_template`` (--chat-template, see
    chat_template_text) replaces the folder's template.

    AutoTokenizer resolves the class through the model's config, which imports torch and much of transformers'
    modelling code: about 2 s of CPU in each process that loads a tokenizer (the tokenizer, the detokenizer and the
    front end). Where the answer is known without it (see _known_tokenizer_class) that class is loaded directly;
    everything else goes through AutoTokenizer."""
    known = _known_tokenizer_class(path)
    if known is not None:
        import transformers

        tok = getattr(transformers, known).from_pretrained(str(path))
    else:
        from transformers import AutoTokenizer  # (imports torch)

        tok = AutoTokenizer.from_pretrained(str(path))
        if len(tok) <= 1:  # a folder without tokenizer files: transformers builds an empty one of the config's class
            raise ValueError(f"{path} has no tokenizer (an empty {type(tok).__name__} came back): add its tokenizer "
                             "files, or pass --skip-tokenizer-init and send prompt token ids")
    if chat_template is not None:
        tok.chat_template = chat_template_text(chat_template)
    return tok


NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_decoding_tokenizer(path: Path) -> Tokenizer:
    """A Rust tokenizer that decodes as load_tokenizer's does (all the detokenizer needs). Read from the
    folder's tokenizer.json, without importing transformers (~1 s of CPU), where transformers would load that file
    unchanged: the generic fast class, and every token tokenizer_config.json adds or names special already in the
    file as it says; through load_tokenizer otherwise."""
    from tokenizers import Tokenizer

    try:
        if _known_tokenizer_class(path) == "PreTrainedTokenizerFast":
            tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            if _config_adds_nothing(json.loads((path / "tokenizer_config.json").read_text()), tokenizer):
                return tokenizer
    except Exception:  # (tokenizers' own errors are plain Exceptions): transformers' loading says what is wrong
        pass
    return load_tokenizer(path).backend_tokenizer


def _config_adds_nothing(tok_config: dict, tokenizer: Tokenizer) -> bool:
    """Whether transformers, building a fast tokenizer from this config beside the file, would add or change no token:
    each of the config's added_tokens_decoder entries is the file's token of that id, and each token the config
    names special (bos_token, ..., additional/extra special tokens) is a special token of the file's."""
    added = tokenizer.get_added_tokens_decoder()
    for index, entry in (tok_config.get("added_tokens_decoder") or {}).items():
        token = added.get(int(index))
        if token is None or not isinstance(entry, dict) or any(
                entry.get(key, default) != getattr(token, key) for key, default in
                (("content", None), ("special", False), ("lstrip", False), ("rstrip", False),
                 ("single_word", False), ("normalized", not entry.get("special", False)))):
            return False
    named = [tok_config.get(key) for key in NAMED_SPECIAL_TOKENS]
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = tok_config.get(key) or []
        named += list(extra.values()) if isinstance(extra, dict) else list(extra)
    special = {token.content for token in added.values() if token.special}
    return all((name.get("content") if isinstance(name, dict) else name) in special for name in named
               if name is not None)


def chat_template_text(value: str) -> str:
    """The template --chat-template names, by vLLM's rule: a file's text, else the value itself if it looks like a
    template (it has a brace or a newline), its backslash escapes (``\\n``) read as in a Python string; ValueError
    otherwise (a path that names no file)."""
    try:
        return Path(value).expanduser().read_text()
    except (OSError, ValueError) as e:  # (ValueError: a NUL in the value)
        if not any(c in value for c in "{}\n"):
            raise ValueError(f"--chat-template {value!r}: cannot read it ({getattr(e, 'strerror', None) or e}), and "
                             "it is not a Jinja template either") from None
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


def _known_tokenizer_class(path: Path) -> str | None:
    """The class AutoTokenizer would load for this folder, where that is known from its files alone: a tokenizer.json,
    no remote code, and either the generic fast class named for a model type of GENERIC_FAST_TOKENIZER_MODEL_TYPES or
    a model type of SUBSTITUTED_TOKENIZER_CLASSES; None for every other folder."""
    try:
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(tok_config, dict) or "auto_map" in tok_config or not (path / "tokenizer.json").is_file():
        return None
    named = tok_config.get("tokenizer_class")
    if not isinstance(named, str):
        return None
    if model_type in SUBSTITUTED_TOKENIZER_CLASSES:
        return SUBSTITUTED_TOKENIZER_CLASSES[model_type]
    if named in GENERIC_FAST_TOKENIZER_CLASSES and model_type in GENERIC_FAST_TOKENIZER_MODEL_TYPES:
        return "PreTrainedTokenizerFast"
    return None


IMAGE_ARCHITECTURES = frozenset({"Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"})
"""The architectures whose vision tower flotilla runs: their chat requests may carry images."""


def takes_images(path: Path) -> bool:
    """Whether the model folder's architecture runs images (its vision tower is loaded and served)."""
    hf = json.loads((path / "config.json").read_text())
    return bool(IMAGE_ARCHITECTURES.intersection(hf.get("architectures") or ()))


def has_recurrent_state(path: Path) -> bool:
    """Whether the model folder's text model has linear-attention (gated delta net) layers, each sequence's state in
    a slot of its own beside the paged KV cache."""
    from flotilla.models.hf_config import load_hf_config

    return load_hf_config(path).linear_attention is not None


def max_model_len_of(config: EngineConfig, path: Path) -> int:
    """max_model_len from the engine options, else the model's (derived as vLLM does, rope scaling included); one
    longer than the model allows is a ValueError."""
    return load_max_model_len(config.model.max_model_len, path)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase | None, path: Path) -> list[int]:
    """EOS ids from generation_config.json or config.json (either may hold a list) plus the tokenizer's own."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        if (path / name).exists():
            eos = json.loads((path / name).read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
            break
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def vocab_size_of(path: Path) -> int:
    return int(text_config(json.loads((path / "config.json").read_text()))["vocab_size"])
