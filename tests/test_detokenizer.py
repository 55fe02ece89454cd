"""IncrementalDetokenizer against tokenizer.decode: tiny tokenizers trained here (no downloads).

Two vocabularies cover the two ways a character is split across tokens: a byte-level BPE (GPT-2 /
Llama-3 / Qwen style: partial UTF-8 inside token strings) and a SentencePiece-style BPE with
byte_fallback (Llama-2 / Mistral style: <0xE4> pieces, merged by the ByteFallback decoder). Random token
streams, including invalid byte runs and special tokens, are cut into random add() chunks; the deltas
must concatenate to exactly decode(output).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from flotilla.actors.incremental_detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, TokenizerInfo

CORPUS = [
    "Hello world, this is a test. 你好，世界！ 🎉🚀 emoji time 😀",
    "The quick brown fox jumps over the lazy dog. 日本語のテキストです。",
    "naïve café résumé ñ 中文测试 🙂 STOP here, stop there; abc abd",
    "Streaming text: 👍🏽 family 👨‍👩‍👧 flags 🇫🇷 math ∑∫ arrows → ←",
]
WORDS = [w for line in CORPUS for w in line.split()] + ["\n", "  ", "😀😀", "中文", "ab", "c"]
SPECIALS = ["<unk>", "<s>", "</s>"]
FUZZ = settings(max_examples=250, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _byte_level() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _byte_fallback(strip_leading_space: bool = False) -> Tokenizer:
    """SentencePiece-style BPE: '▁' for spaces, a small alphabet, everything else as <0xNN> pieces."""
    normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=SPECIALS, limit_alphabet=40, show_progress=False)
    trainer_tok.train_from_iterator(CORPUS, trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab = dict(trained["vocab"])
    for byte in range(256):  # byte pieces live in the model vocabulary (not as added special tokens)
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizer
    tok.add_special_tokens(SPECIALS)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_leading_space:  # Llama-2's decoder: drop the space the normalizer prepended
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


TOKENIZERS = {"byte_level": _byte_level(), "byte_fallback": _byte_fallback()}
INFOS = {name: TokenizerInfo(tok) for name, tok in TOKENIZERS.items()}


def _stream(
    info: TokenizerInfo | Tokenizer,
    prompt: list[int],
    output: list[int],
    chunks: list[int],
    **kwargs: object,
) -> tuple[list[str], str | None, IncrementalDetokenizer]:
    """Feed output in chunks of the given sizes (cycled); returns every delta, finish() last."""
    detok = IncrementalDetokenizer(info, prompt, **kwargs)  # type: ignore[arg-type]
    deltas, stop, pos, i = [], None, 0, 0
    while pos < len(output):
        size = chunks[i % len(chunks)] if chunks else 1
        text, matched = detok.add(output[pos : pos + size])
        deltas.append(text)
        stop = stop or matched
        pos, i = pos + size, i + 1
    deltas.append(detok.finish())
    return deltas, stop or detok.stop_reason, detok


def _reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Cut text at the earliest-ending stop string (longest among those ending together)."""
    best = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < (best[0] + len(best[1]), best[0])):
            best = (start, stop)
    if best is None:
        return text, None
    start, stop = best
    return text[: start + len(stop) if include else start], stop


def _text_ids(tok: Tokenizer, draw: st.DrawFn) -> list[int]:
    words = draw(st.lists(st.sampled_from(WORDS), max_size=12))
    return tok.encode(" ".join(words), add_special_tokens=False).ids


# --------------------------------------------------------------------------------------- fuzz


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@FUZZ
@given(data=st.data(), skip=st.booleans())
def test_random_ids_match_full_decode(name: str, data: st.DataObject, skip: bool) -> None:
    """Any id stream (invalid byte runs and specials included) concatenates to decode(output)."""
    tok = TOKENIZERS[name]
    ids = st.integers(0, tok.get_vocab_size() - 1)
    prompt = data.draw(st.lists(ids, max_size=8))
    output = data.draw(st.lists(ids, max_size=40))
    chunks = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    deltas, _, _ = _stream(INFOS[name], prompt, output, chunks, skip_special_tokens=skip)
    full = tok.decode(output, skip_special_tokens=skip)
    assert "".join(deltas) == full
    if REPLACEMENT_CHAR not in full:
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@FUZZ
@given(data=st.data())
def test_real_text_streams_without_replacement_chars(name: str, data: st.DataObject) -> None:
    """Text with emoji / CJK / accents: exact, and no delta ever shows half a character."""
    tok = TOKENIZERS[name]
    prompt = _text_ids(tok, data.draw)
    output = _text_ids(tok, data.draw)
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=4))
    deltas, _, _ = _stream(INFOS[name], prompt, output, chunks)
    full = tok.decode(output)
    assert "".join(deltas) == full
    assert REPLACEMENT_CHAR not in "".join(deltas)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@FUZZ
@given(data=st.data(), include=st.booleans())
def test_stop_strings_match_reference(name: str, data: st.DataObject, include: bool) -> None:
    """Stop strings over random chunkings give the same cut as a search over the full text."""
    tok = TOKENIZERS[name]
    text = "".join(data.draw(st.lists(st.sampled_from(["a", "b", "c", " ", "ab", "中", "😀"]), max_size=25)))
    output = tok.encode(text, add_special_tokens=False).ids
    full = tok.decode(output)
    stop_alphabet = st.sampled_from(["a", "b", "c", " ", "中", "😀"])
    stops = data.draw(st.lists(st.text(stop_alphabet, min_size=1, max_size=4), min_size=1, max_size=3, unique=True))
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    deltas, stop, detok = _stream(INFOS[name], [], output, chunks, stop=stops, include_stop_str_in_output=include)
    expected_text, expected_stop = _reference_stop(full, stops, include)
    assert "".join(deltas) == expected_text
    assert stop == expected_stop == detok.stop_reason


# ----------------------------------------------------------------------------- stop strings


def _char_tokens(tok: Tokenizer, text: str) -> list[int]:
    """One token per character, so every stop string spans token boundaries."""
    return [tok.encode(ch, add_special_tokens=False).ids[0] for ch in text]


def test_stop_string_across_tokens_is_cut_and_held_text_released() -> None:
    tok = TOKENIZERS["byte_level"]
    detok = IncrementalDetokenizer(INFOS["byte_level"], [], stop=["STOP"])
    ids = _char_tokens(tok, "aSTxST")
    outs = [detok.add([i]) for i in ids]
    # "S" and "ST" might start "STOP" and are held; "x" proves "ST" was not a stop, so it is released.
    assert [o[0] for o in outs] == ["a", "", "", "STx", "", ""]
    assert detok.add(_char_tokens(tok, "OPzz")) == ("", "STOP")
    assert detok.add(_char_tokens(tok, "more")) == ("", None)  # nothing after the stop
    assert detok.finish() == ""
    assert detok.stop_reason == "STOP"


def test_include_stop_str_in_output() -> None:
    tok = TOKENIZERS["byte_level"]
    deltas, stop, _ = _stream(
        INFOS["byte_level"],
        [],
        _char_tokens(tok, "Hello world. STOP here"),
        [1],
        stop=["STOP"],
        include_stop_str_in_output=True,
    )
    assert "".join(deltas) == "Hello world. STOP"
    assert stop == "STOP"


def test_earliest_stop_wins_whatever_the_list_order() -> None:
    tok = TOKENIZERS["byte_level"]
    output = tok.encode("The quick brown fox jumps", add_special_tokens=False).ids
    deltas, stop, _ = _stream(INFOS["byte_level"], [], output, [len(output)], stop=["jumps", "quick"])
    assert ("".join(deltas), stop) == ("The ", "quick")
    # "c" ends before "bcd" does, so it wins even when both arrive in one add().
    output = _char_tokens(tok, "abcd")
    deltas, stop, _ = _stream(INFOS["byte_level"], [], output, [4], stop=["bcd", "c"])
    assert ("".join(deltas), stop) == ("ab", "c")


def test_stop_string_completed_by_finish_flush() -> None:
    """A held-back prefix of a stop string is released by finish() when the stream ends short of it."""
    tok = TOKENIZERS["byte_level"]
    detok = IncrementalDetokenizer(INFOS["byte_level"], [], stop=["abc"])
    assert detok.add(_char_tokens(tok, "xab")) == ("x", None)
    assert detok.finish() == "ab"
    assert detok.stop_reason is None


# ------------------------------------------------------------------------ context and specials


def test_prompt_context_keeps_the_space_a_sentencepiece_decoder_strips() -> None:
    """With Llama-2's Strip decoder the completion keeps its leading space, as vLLM and SGLang emit."""
    tok = _byte_fallback(strip_leading_space=True)
    prompt = tok.encode("The capital of France is", add_special_tokens=False).ids
    output = tok.encode("Paris 中文 🎉", add_special_tokens=False).ids  # "▁Paris▁..." (normalizer prepends ▁)
    deltas, _, _ = _stream(TokenizerInfo(tok), prompt, output, [1])
    assert "".join(deltas) == " Paris 中文 🎉"
    assert tok.decode(output) == "Paris 中文 🎉"


def test_byte_run_across_prompt_and_output_is_not_merged() -> None:
    """A prompt ending in byte pieces ("中") must not lend them to the output's invalid byte run:
    decode() of the output alone shows one U+FFFD, not the three a merged run would leave."""
    tok = TOKENIZERS["byte_fallback"]
    pieces = [tok.token_to_id(f"<0x{b:02X}>") for b in "中".encode()]
    prompt = tok.encode("Hello", add_special_tokens=False).ids + pieces
    output = [tok.token_to_id("<0x80>")] + tok.encode("x", add_special_tokens=False).ids
    for chunks in ([1], [2]):
        deltas, _, _ = _stream(INFOS["byte_fallback"], prompt, output, chunks)
        assert "".join(deltas) == tok.decode(output) == REPLACEMENT_CHAR + " x"
    # ... while a valid run that ends before the output joins nothing and streams at once.
    detok = IncrementalDetokenizer(INFOS["byte_fallback"], prompt)
    assert detok.add(pieces) == ("", None)  # run still open: the next byte could invalidate it
    assert detok.add(tok.encode("x", add_special_tokens=False).ids) == ("中 x", None)


def test_special_tokens_skipped_or_kept() -> None:
    tok = TOKENIZERS["byte_level"]
    eos = tok.token_to_id("</s>")
    output = tok.encode("Hello world", add_special_tokens=False).ids + [eos]
    assert "".join(_stream(INFOS["byte_level"], [], output, [1])[0]) == "Hello world"
    kept = _stream(INFOS["byte_level"], [], output, [1], skip_special_tokens=False)[0]
    assert "".join(kept) == "Hello world</s>"


def test_accepts_a_raw_tokenizer_and_rejects_others() -> None:
    tok = TOKENIZERS["byte_level"]
    detok = IncrementalDetokenizer(tok, [])
    assert detok.add(tok.encode("hi", add_special_tokens=False).ids)[0] + detok.finish() == "hi"
    with pytest.raises(TypeError):
        IncrementalDetokenizer(object(), [])
    with pytest.raises(RuntimeError):
        detok.add([1])


def test_accepts_a_transformers_fast_tokenizer_and_numpy_ids() -> None:
    transformers = pytest.importorskip("transformers")
    tok = TOKENIZERS["byte_level"]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok)
    ids = np.asarray(tok.encode("你好 🎉 world", add_special_tokens=False).ids, dtype=np.int32)
    detok = IncrementalDetokenizer(hf, np.asarray([5, 6, 7], dtype=np.int32))
    assert detok.add(ids)[0] + detok.finish() == "你好 🎉 world"


class _CountingInfo(TokenizerInfo):
    """Counts how many ids all decode calls together looked at."""

    decoded_ids = 0

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.decoded_ids += len(ids)
        return super().decode(ids, skip_special_tokens)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_work_per_token_does_not_grow_with_length(name: str) -> None:
    """Decoding a long stream one token at a time looks at O(1) ids per token, not O(length)."""
    tok = TOKENIZERS[name]
    output = tok.encode(" ".join(WORDS * 20), add_special_tokens=False).ids
    assert len(output) > 1000
    info = _CountingInfo(tok)
    deltas, _, _ = _stream(info, [], output, [1])
    assert "".join(deltas) == tok.decode(output)
    assert info.decoded_ids < 30 * len(output)
