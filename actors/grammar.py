"""Structured outputs: a request's JSON schema, regex, choice or grammar as an xgrammar grammar, and each step the
token bitmask that lets its sequence sample only tokens the grammar allows next.

- The front end checks a request's grammar (`check`: parsing it needs no tokenizer) and answers a 400 naming the
  problem before the request goes anywhere.
- The worker (the rank that samples) compiles grammars against the model's vocabulary in a thread pool, cached by
  their spec, as soon as a sequence that needs one arrives (`Grammars.start`). A sequence's matcher follows its
  output: before a step samples it, the matcher takes the tokens sampled since (the worker waits for a token still
  on the device only when such a row samples), then the step's rows are filled in one call across xgrammar's
  threads, and the masked rows' logits are -inf outside the grammar (`apply`). Rows without a grammar cost nothing:
  a decode graph's argmax stands for them, and only the masked rows' is taken again.
- When the grammar is complete only the stop tokens are allowed, so the sequence ends with EOS (or a stop token id).

xgrammar was chosen over llguidance for being what vLLM and SGLang use by default, with a CPU path for the tests
and fused mask kernels on the GPU.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from flotilla.sampling_params import StructuredOutputs

if TYPE_CHECKING:  # (the front end checks grammars without torch until a request needs xgrammar)
    import torch
    import xgrammar as xgr

_XGR_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
"""xgrammar's errors start with a time and its own source location: not for users."""


def _message(exc: BaseException) -> str:
    return _XGR_LOCATION.sub("", str(exc)).strip()


def _choice_ebnf(choices: list[str]) -> str:
    # JSON string literals are EBNF literals in xgrammar's dialect (escapes and unicode alike)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check(spec: StructuredOutputs) -> None:
    """Parse the spec's grammar; ValueError saying what is wrong with it (a schema xgrammar cannot convert, a bad
    regex or EBNF)."""
    import xgrammar as xgr

    try:
        if spec.json is not None:
            xgr.Grammar.from_json_schema(spec.json)
        elif spec.regex is not None:
            xgr.Grammar.from_regex(spec.regex)
        elif spec.grammar is not None:
            xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        kind = "JSON schema" if spec.json is not None else "regex" if spec.regex is not None else "grammar"
        raise ValueError(f"the {kind} cannot be used for structured outputs: {_message(e)}") from None


class Grammars:
    """The worker's compiled grammars over the model's vocabulary (xgrammar's own cache keys them by spec)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], threads: int = 4) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self.batch = xgr.BatchGrammarMatcher()
        """Fills a step's masks in one call across its threads (apply)."""

    def start(self, spec: StructuredOutputs) -> Future:
        """Compile (or find) the spec's grammar off the step's thread: a Future of its CompiledGrammar."""
        return self._pool.submit(self._compile, spec)

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        c = self._compiler
        if spec.json is not None:
            return c.compile_json_schema(spec.json)
        if spec.json_object:  # (an object, as OpenAI's json_object means, with any properties)
            return c.compile_json_schema('{"type": "object"}', strict_mode=False)
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_grammar(_choice_ebnf(spec.choice))
        assert spec.grammar is not None
        return c.compile_grammar(spec.grammar)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class SequenceGrammar:
    """One sequence's matcher: created when its grammar is compiled, fed its output tokens as they are known. With
    `after` (a reasoning parser's end tag), the output is free until those tokens appear, and the grammar holds what
    follows them."""

    __slots__ = ("_future", "_stop", "_after", "matcher", "consumed")

    def __init__(self, future: Future, stop_token_ids: list[int], after: list[int] | None = None) -> None:
        self._future = future
        self._stop = stop_token_ids
        self._after = list(after or ())
        self.matcher: xgr.GrammarMatcher | None = None
        self.consumed = 0
        """Output tokens the matcher has taken (before `after` appeared: where a match of it may end next)."""

    @property
    def started(self) -> bool:
        """Whether the grammar holds the output yet (it does from the start without `after`)."""
        return not self._after

    def follow(self, output: list[int] | Any) -> None:
        """Take the output tokens sampled since the last call (waits for the grammar's compile the first time)."""
        import xgrammar as xgr

        if self._after:
            n = len(self._after)
            for end in range(max(self.consumed, n), len(output) + 1):  # (a match ending at each new token)
                if [int(t) for t in output[end - n:end]] == self._after:
                    self._after, self.consumed = [], end
                    break
            else:
                self.consumed = len(output) + 1  # (where the next match may end)
                return
        if self.matcher is None:
            self.matcher = xgr.GrammarMatcher(self._future.result(), override_stop_tokens=self._stop)
        for token in output[self.consumed:]:
            if self.matcher.is_terminated():
                break
            if not self.matcher.accept_token(int(token)):
                raise RuntimeError(f"structured outputs: token {int(token)} breaks the grammar it was sampled under")
        self.consumed = len(output)

    def fill(self, bitmask: torch.Tensor, rows: list[int], drafts: list[int] | None = None) -> list[int]:
        """The allowed next tokens into bitmask rows: rows[j] for the position after the output and drafts[:j]
        (speculative decoding verifies them in one step; the matcher steps through them and rolls back). Returns the
        rows masked: none before the grammar holds the output; none from where it has ended (its stop token was
        sampled and the sequence is ending) or where a draft breaks it (no sample there can be kept)."""
        if not self.started:
            return []
        assert self.matcher is not None
        masked, taken = [], 0
        for j, row in enumerate(rows):
            if j and (self.matcher.is_terminated() or not self.matcher.accept_token(int(drafts[j - 1]))):
                break
            taken += bool(j)
            if self.matcher.is_terminated():
                break
            self.matcher.fill_next_token_bitmask(bitmask, row)
            masked.append(row)
        if taken:
            self.matcher.rollback(taken)
        return masked


def apply(logits: torch.Tensor, rows: list[tuple[list[int], SequenceGrammar, list[int]]],
          batch: xgr.BatchGrammarMatcher) -> list[int]:
    """-inf for every token a row's grammar does not allow next, in place (logits float [N, vocab]); rows: (a
    sequence's logits rows, its matcher, up to date with its output, and the drafts its later rows follow).
    Sequences of a single row (no drafts) are filled in one call of `batch` (Grammars.batch), across its threads.
    Returns the logits rows masked."""
    import torch
    import xgrammar as xgr

    # a row per logits row, uninitialised: `indices` makes the kernel read only the rows filled
    bitmask = torch.empty(xgr.get_bitmask_shape(*logits.shape), dtype=torch.int32)
    single: list[tuple[xgr.GrammarMatcher, int]] = []
    masked: list[int] = []
    for sequence_rows, g, drafts in rows:
        if len(sequence_rows) == 1 and g.started and g.matcher is not None and not g.matcher.is_terminated():
            single.append((g.matcher, sequence_rows[0]))
        else:
            masked += g.fill(bitmask, sequence_rows, drafts)
    if single:
        batch.batch_fill_next_token_bitmask([m for m, _ in single], bitmask, indices=[r for _, r in single])
        masked += [r for _, r in single]
    if masked:
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=masked)
    return masked
