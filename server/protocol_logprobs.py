"""OpenAI protocol, logprobs: token texts, and the three shapes logprobs take in a response. Chat's `logprobs.content`
entries, completions' legacy parallel lists (the echoed prompt's part first with `echo`), and vLLM's
`prompt_logprobs`. Pure code, used by server/protocol_output.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flotilla.transport.messages import PromptLogprobs, SeqText

MIN_LOGPROB = -9999.0
"""OpenAI's stand-in for -inf (JSON has no infinity)."""

TokenText = Callable[[int], str]
"""Token id -> the token's text as it reads in the output (e.g. " hello", not "Ġhello").

Contract: a token that is not valid UTF-8 on its own (one byte of a multi-byte character, byte-level
BPE or sentencepiece byte fallback) is returned as its raw bytes decoded with errors="surrogateescape",
so the exact bytes survive; logprobs then report those bytes and show U+FFFD in ``token``.
"""


class TokenTexts:
    """Token id -> (token string, UTF-8 bytes) for logprobs, cached; build one per tokenizer and share it.

    The cache grows to at most the vocabulary (a few MB) and spares every logprob request the tokenizer
    call and the UTF-8 encode of tokens it has already seen.
    """

    __slots__ = ("_cache", "_token_text")

    def __init__(self, token_text: TokenText) -> None:
        self._token_text = token_text
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            text = self._token_text(token_id)
            try:
                entry = (text, list(text.encode("utf-8")))
            except UnicodeEncodeError:
                raw = text.encode("utf-8", "surrogateescape") if _escapable(text) else text.encode("utf-8", "replace")
                entry = (raw.decode("utf-8", "replace"), list(raw))
            self._cache[token_id] = entry
        return entry


def _escapable(text: str) -> bool:
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return False
    return True


def clamp(logprob: float) -> float:
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB  # not max(): this also maps NaN


def chat_logprobs(texts: TokenTexts, k: int, delta: SeqText) -> list[dict[str, Any]] | None:
    """Chat's entries for a delta's tokens, each with its k best alternatives."""
    if delta.logprobs is None or not delta.token_ids:
        return None
    get = texts.get
    top_ids, top_lps = delta.top_ids, delta.top_logprobs
    entries = []
    for i, (token_id, logprob) in enumerate(zip(delta.token_ids, delta.logprobs)):
        token, raw = get(token_id)
        top: list[dict[str, Any]] = []
        if k and top_ids is not None and top_lps is not None:
            for alt_id, alt_lp in zip(top_ids[i][:k], top_lps[i][:k]):
                alt, alt_raw = get(alt_id)
                top.append({"token": alt, "logprob": clamp(alt_lp), "bytes": alt_raw})
        entries.append({"token": token, "logprob": clamp(logprob), "bytes": raw, "top_logprobs": top})
    return entries


def completion_logprobs(texts: TokenTexts, k: int, delta: SeqText,
                        offset: int) -> tuple[dict[str, list[Any]] | None, int]:
    """Legacy format: parallel lists, ``top_logprobs`` holding the k best plus the sampled token; text offsets
    start at `offset`. Also returns the offset after the delta's tokens."""
    if delta.logprobs is None or not delta.token_ids:
        return None, offset
    get = texts.get
    top_ids, top_lps = delta.top_ids, delta.top_logprobs
    tokens, logprobs, tops, offsets = [], [], [], []
    for i, (token_id, logprob) in enumerate(zip(delta.token_ids, delta.logprobs)):
        token = get(token_id)[0]
        lp = clamp(logprob)
        top: dict[str, float] = {}
        if k and top_ids is not None and top_lps is not None:
            for alt_id, alt_lp in zip(top_ids[i][:k], top_lps[i][:k]):
                top[get(alt_id)[0]] = clamp(alt_lp)
        top.setdefault(token, lp)
        tokens.append(token)
        logprobs.append(lp)
        tops.append(top)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}, offset


def echo_logprobs(texts: TokenTexts, k: int, prompt: PromptLogprobs) -> dict[str, list[Any]]:
    """The echoed prompt's part of the legacy lists: its first token has none (null), as in OpenAI's."""
    get = texts.get
    tokens = [get(t)[0] for t in prompt.token_ids]
    logprobs: list[float | None] = [None]
    tops: list[dict[str, float] | None] = [None]
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    for i, lp in enumerate(prompt.logprobs):
        top = {get(t)[0]: clamp(v) for t, v in zip(prompt.top_ids[i][:k], prompt.top_logprobs[i][:k])} if (
            k and prompt.top_ids) else {}
        top.setdefault(tokens[i + 1], clamp(lp))
        logprobs.append(clamp(lp))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(texts: TokenTexts | None, prompt: PromptLogprobs) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: per prompt token, null for the first, else {token id: {logprob, rank,
    decoded_token}} for the token itself and its top alternatives."""
    def text(token: int) -> str:
        return "" if texts is None else texts.get(token)[0]

    out: list[dict[str, Any] | None] = [None]
    for i, (token, lp, rank) in enumerate(zip(prompt.token_ids[1:], prompt.logprobs, prompt.ranks)):
        entry = {str(token): {"logprob": clamp(lp), "rank": rank, "decoded_token": text(token)}}
        if prompt.top_ids:
            for j, (alt, alt_lp) in enumerate(zip(prompt.top_ids[i], prompt.top_logprobs[i])):
                entry.setdefault(str(alt), {"logprob": clamp(alt_lp), "rank": j + 1, "decoded_token": text(alt)})
        out.append(entry)
    return out
