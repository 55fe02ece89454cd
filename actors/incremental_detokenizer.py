"""IncrementalDetokenizer: token ids in, printable text deltas out, with stop strings (one per sequence).

The pure core of the DetokenizerActor. Decoding every output token on its own is wrong (a character can
span several byte tokens, and SentencePiece-style decoders depend on the neighbouring token), and
decoding the whole output every step is O(length) per token. This class uses the prefix/read offset
technique of vLLM and SGLang: keep a window of recent ids, decode the window with and without the new
tokens, and emit the difference only when the text is final:

- the window's text must not end in U+FFFD (an unfinished multi-byte character of a byte-level BPE), and
- its last token must not be a byte-fallback token (``<0xE4>``): tokenizers' ByteFallback decoder turns a
  whole run of byte tokens into U+FFFDs when any part of the run is invalid, so a character that looks
  complete can still be rewritten by the next byte token.

Every emission point is therefore a place where decoding splits cleanly, which makes the concatenated
deltas plus ``finish()`` equal ``tokenizer.decode(output_ids, skip_special_tokens=...)`` exactly, for
byte-level BPE and for ByteFallback/Fuse decoders. The window starts with up to five prompt tokens of
context (as vLLM and SGLang do), so a SentencePiece decoder that strips the leading space of a text keeps
the space between the prompt and the completion (" Paris", not "Paris"); context is used only when the
prompt ends at a clean split, so it never changes the text otherwise. Cost per ``add``: O(window),
the window being the tokens since the last emission plus the previous emission's tokens.

Stop strings sit on top: a match may span token boundaries; the earliest-ending match wins (the one a
per-token stream would have seen first; among matches ending together, the longest); text before it is
emitted, the stop string only with include_stop_str_in_output, nothing afterwards. Text that might be the
start of a stop string (at most len(longest stop) - 1 characters) is held back until it cannot be.

Tokenizer: a ``tokenizers.Tokenizer`` (the fast Rust one the TokenizerActor loads from tokenizer.json);
a transformers PreTrainedTokenizerFast is accepted and unwrapped to its ``backend_tokenizer``, so HF's
``clean_up_tokenization_spaces`` is not applied. Build a ``TokenizerInfo`` once per tokenizer and share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"
"""What a decoder emits for bytes that are not (yet) valid UTF-8."""

CONTEXT_TOKENS = 5
"""Prompt tokens decoded ahead of the output, for decoders whose output depends on the previous token."""

_TRIM_IDS_AFTER = 1024
"""Drop ids before the window once this many have accumulated (bounds memory, amortised O(1))."""


class TokenizerInfo:
    """A tokenizers.Tokenizer plus the per-vocabulary facts incremental decoding needs, computed once."""

    def __init__(self, tokenizer: Tokenizer | Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # HF fast tokenizer -> its Rust core
        if not isinstance(backend, Tokenizer):
            raise TypeError(f"need a tokenizers.Tokenizer or a HF fast tokenizer, got {type(tokenizer).__name__}")
        self.tokenizer: Tokenizer = backend
        added = backend.get_added_tokens_decoder()
        self.special_ids: frozenset[int] = frozenset(i for i, token in added.items() if token.special)
        """Ids that skip_special_tokens drops before decoding."""
        byte_ids = (backend.token_to_id(f"<0x{byte:02X}>") for byte in range(256))
        self.byte_fallback_ids: frozenset[int] = frozenset(i for i in byte_ids if i is not None)
        """Ids of byte-fallback pieces (<0x00>..<0xFF>); empty for byte-level BPE vocabularies."""

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns one sequence's stream of output token ids into text deltas, applying stop strings."""

    def __init__(
        self,
        tokenizer: TokenizerInfo | Tokenizer | Any,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._info = tokenizer if isinstance(tokenizer, TokenizerInfo) else TokenizerInfo(tokenizer)
        self._skip_special = skip_special_tokens
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._stop = tuple(dict.fromkeys(stop))
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._include_stop = include_stop_str_in_output
        # ids[prefix_offset:read_offset] decode to prefix_text, the text already accounted for.
        self._ids: list[int] = self._clean_context(prompt_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._held = ""  # decoded text not yet released because it may begin a stop string
        self.stop_reason: str | None = None
        """The stop string that ended the text, once one matched."""
        self.finished = False
        """True after finish()."""

    # ------------------------------------------------------------------ public API

    @property
    def include_stop_str_in_output(self) -> bool:
        """Whether what stopped the sequence (a stop string, the EOS or stop token) is part of its text."""
        return self._include_stop

    def add(self, token_ids: Sequence[int]) -> tuple[str, str | None]:
        """Feed newly generated ids; returns (text to send now, the stop string if one just matched).

        After a stop string matched, further ids are ignored and ("", None) is returned.
        """
        if self.finished:
            raise RuntimeError("add() after finish()")
        if self.stop_reason is not None:
            return "", None
        special = self._info.special_ids if self._skip_special else ()
        new_ids = [int(t) for t in token_ids if t not in special]
        if not new_ids:
            return "", None
        self._ids.extend(new_ids)
        text = self._advance(final=False)
        return self._apply_stop(text, final=False) if text else ("", None)

    def finish(self) -> str:
        """Flush everything held back (an unfinished character decodes as U+FFFD, as in decode()).

        Call once when the sequence ends for any reason; a stop string completed by the flushed text
        still applies (see stop_reason).
        """
        if self.finished:
            return ""
        self.finished = True
        if self.stop_reason is not None:
            return ""
        text = self._advance(final=True)
        return self._apply_stop(text, final=True)[0]

    # ------------------------------------------------------------------ token window

    def _decode(self, ids: list[int]) -> str:
        return self._info.decode(ids, self._skip_special)

    def _clean_context(self, prompt_ids: Sequence[int]) -> list[int]:
        """The longest tail of at most CONTEXT_TOKENS prompt ids that decodes cleanly, or [].

        The split between prompt and output must be clean (no pending byte run or partial character),
        or the context would change how the output's first bytes decode; the context itself must not
        start inside a character, or its garbage could absorb output bytes.
        """
        special = self._info.special_ids if self._skip_special else ()
        tail = [int(t) for t in prompt_ids[-2 * CONTEXT_TOKENS :] if t not in special][-CONTEXT_TOKENS:]
        if not tail or tail[-1] in self._info.byte_fallback_ids:
            return []
        for start in range(len(tail)):
            if REPLACEMENT_CHAR not in self._decode(tail[start:]):
                return tail[start:]
        return []

    def _advance(self, final: bool) -> str:
        """Text the ids since the last emission add, if it is final (or final=True forces it)."""
        ids = self._ids
        if not final and ids[-1] in self._info.byte_fallback_ids:
            return ""  # a byte run is open: the next byte can still rewrite it
        new_text = self._decode(ids[self._prefix_offset :])
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            return ""  # an unfinished multi-byte character
        if len(new_text) <= len(self._prefix_text):
            return ""  # nothing printable yet (e.g. a token that decodes to ""); keep the context
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        if self._prefix_offset >= _TRIM_IDS_AFTER:
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        self._prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        return delta

    # ------------------------------------------------------------------ stop strings

    def _apply_stop(self, text: str, final: bool) -> tuple[str, str | None]:
        """Release text that cannot belong to a stop string; cut at the first stop string."""
        if not self._stop:
            return text, None
        pending = self._held + text
        match = self._find_stop(pending, len(text))
        if match is not None:
            start, stop = match
            self._held = ""
            self.stop_reason = stop
            return pending[: start + len(stop) if self._include_stop else start], stop
        keep = 0 if final else self._stop_prefix_len(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], None

    def _find_stop(self, pending: str, num_new_chars: int) -> tuple[int, str] | None:
        """Earliest-ending stop string that ends in the last num_new_chars characters, if any.

        Only the new characters can complete a match: an earlier one would have matched earlier, and
        released text never contains the start of one (see _stop_prefix_len).
        """
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = pending.find(stop, max(0, len(pending) - num_new_chars - len(stop) + 1))
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _stop_prefix_len(self, pending: str) -> int:
        """Length of the longest suffix of pending that is a proper prefix of a stop string."""
        for k in range(min(self._max_stop_len - 1, len(pending)), 0, -1):
            suffix = pending[-k:]
            if any(stop.startswith(suffix) for stop in self._stop):
                return k
        return 0
