"""load_tokenizer gives what transformers' AutoTokenizer gives, without importing torch where it can.

Every engine loads its tokenizer in three processes (tokenizer, detokenizer, front end); AutoTokenizer imports torch
and much of transformers' modelling code to resolve the class, about 3 s of CPU each. load_tokenizer skips that for
folders whose answer is known (models/model_folder.py); these tests hold it to AutoTokenizer's answer on the installed
transformers, so a transformers release that resolves those folders differently fails here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_engine import write_tiny_tokenizer
from transformers import AutoTokenizer

from flotilla.models.default_model import default_model_dir
from flotilla.models.model_folder import (GENERIC_FAST_TOKENIZER_MODEL_TYPES, SUBSTITUTED_TOKENIZER_CLASSES,
                                          load_decoding_tokenizer, load_tokenizer)

TEXTS = ["The quick brown fox.", "日本語 🙂 12345", "  spaces  and\ttabs\n", "<|im_start|>user\nhi<|im_end|>", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]


def _folder(tmp_path: Path, model_type: str, **tok_config) -> Path:
    d = tmp_path / model_type
    d.mkdir()
    write_tiny_tokenizer(d, vocab_size=320)
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "vocab_size": 320}))
    if tok_config:
        path = d / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **tok_config}))
    return d


def _same(ours, theirs) -> None:
    assert type(ours) is type(theirs)
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (theirs.bos_token_id, theirs.eos_token_id,
                                                                        theirs.pad_token_id)
    assert ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("model_type", sorted(GENERIC_FAST_TOKENIZER_MODEL_TYPES))
def test_the_direct_path_gives_autotokenizers_tokenizer(tmp_path, model_type):
    d = _folder(tmp_path, model_type)
    _same(load_tokenizer(d), AutoTokenizer.from_pretrained(str(d)))


@pytest.mark.parametrize("model_type", sorted(SUBSTITUTED_TOKENIZER_CLASSES))
@pytest.mark.parametrize("named", ["TokenizersBackend", "Qwen2Tokenizer", "LlamaTokenizerFast"])
def test_a_model_type_whose_class_transformers_substitutes_gets_it_whatever_the_folder_names(tmp_path, model_type,
                                                                                              named):
    d = _folder(tmp_path, model_type, tokenizer_class=named)
    ours = load_tokenizer(d)
    assert type(ours).__name__ == SUBSTITUTED_TOKENIZER_CLASSES[model_type]
    _same(ours, AutoTokenizer.from_pretrained(str(d)))


@pytest.mark.parametrize("model_type,tok_config", [
    ("qwen2", {}),  # a model type whose hub class transformers overrides
    ("llama", {"tokenizer_class": "GPT2Tokenizer"}),  # a named class
    ("llama", {"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}}),  # remote code: AutoTokenizer decides
    ("qwen3_5_moe", {"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}}),
])
def test_other_folders_go_through_autotokenizer(tmp_path, monkeypatch, model_type, tok_config):
    d = _folder(tmp_path, model_type, **tok_config)
    calls = []
    real = AutoTokenizer.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        calls.append(args[0])
        if "auto_map" in tok_config:  # (its remote code does not exist: only which path was taken matters here)
            return "autotokenizer"
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(spy))
    got = load_tokenizer(d)
    assert calls == [str(d)]
    if "auto_map" not in tok_config:
        _same(got, real(AutoTokenizer, str(d)))


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5_moe"])
def test_a_tokenizer_process_loads_the_tiny_models_tokenizer_without_torch(tmp_path, model_type):
    d = _folder(tmp_path, model_type)
    code = ("import sys\nfrom pathlib import Path\nimport flotilla.actors.detokenizer, flotilla.server.serve\n"
            "from flotilla.models.model_folder import load_tokenizer\n"
            f"load_tokenizer(Path({str(d)!r}))\nprint(sorted(m for m in ('torch', 'transformers.configuration_utils')"
            " if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


DECODING = ("model", "decoder", "added_tokens")
"""What a tokenizer's decoding depends on (a post-processor, a normaliser, a pre-tokeniser only shape encoding)."""


def _decoding(d: Path | None = None, tokenizer=None) -> dict:
    tokenizer = tokenizer or load_decoding_tokenizer(d)
    return {key: json.loads(tokenizer.to_str())[key] for key in DECODING}


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "deepseek_v3", "qwen3_5_moe", "default"])
def test_the_detokenizers_tokenizer_is_the_one_transformers_builds(tmp_path, model_type):
    d = default_model_dir() if model_type == "default" else _folder(tmp_path, model_type)
    assert _decoding(d) == _decoding(tokenizer=AutoTokenizer.from_pretrained(str(d)).backend_tokenizer)


@pytest.mark.parametrize("tok_config", [
    {"added_tokens_decoder": {"320": {"content": "<tool>", "special": True, "lstrip": False, "rstrip": False,
                                      "single_word": False, "normalized": False}}},  # a token the file lacks
    {"added_tokens_decoder": {"1": {"content": "<|im_start|>", "special": False, "lstrip": False, "rstrip": False,
                                    "single_word": False, "normalized": True}}},  # the file's token, made plain
    {"additional_special_tokens": ["<think>"]},  # a special token the file lacks
    {"eos_token": "<eos>"},
])
def test_a_config_that_changes_the_files_tokens_is_read_through_transformers(tmp_path, tok_config):
    d = _folder(tmp_path, "llama", **tok_config)
    from tokenizers import Tokenizer

    assert _decoding(d) == _decoding(tokenizer=AutoTokenizer.from_pretrained(str(d)).backend_tokenizer)
    assert _decoding(d) != _decoding(tokenizer=Tokenizer.from_file(str(d / "tokenizer.json")))


def test_a_detokenizer_process_decodes_without_transformers(tmp_path):
    """The detokenizer only decodes: transformers' import (~1 s of CPU a process) is left out where the file is the
    tokenizer."""
    d = _folder(tmp_path, "qwen3")
    code = ("import sys\nfrom pathlib import Path\nimport flotilla.actors.detokenizer\n"
            "from flotilla.models.model_folder import load_decoding_tokenizer\n"
            f"load_decoding_tokenizer(Path({str(d)!r}))\nprint('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_a_worker_process_imports_no_transformers():
    """A worker needs transformers' tokenizer only to build grammars (structured outputs): importing it at start
    would cost every engine start about half a second."""
    code = "import sys\nimport flotilla.actors.worker\nprint('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_a_folder_without_tokenizer_files_is_refused_with_a_way_out(tmp_path):
    """transformers builds an empty tokenizer of the config's class for a folder with no tokenizer files (an engine
    on such a folder would refuse every prompt: "prompt token ids must be in [0, 1)"); loading says what is missing
    and what to pass instead."""
    d = tmp_path / "bare"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 320}))
    with pytest.raises(ValueError, match="no tokenizer.*--skip-tokenizer-init"):
        load_tokenizer(d)
