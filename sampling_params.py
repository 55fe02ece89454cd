"""SamplingParams: how one request is sampled and when it stops (vLLM's names and defaults)."""

from __future__ import annotations

import msgspec


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True, frozen=True):
    """What the output must match (vLLM's structured_outputs): exactly one of these. Grammars run in the worker
    (actors/grammar.py, xgrammar)."""

    json: str | None = None
    """A JSON schema, as JSON text."""
    json_object: bool = False
    """Any JSON object (OpenAI's response_format json_object)."""
    regex: str | None = None
    """A regular expression the whole output matches."""
    choice: list[str] | None = None
    """One of these strings, exactly."""
    grammar: str | None = None
    """An EBNF grammar (xgrammar's dialect, GBNF-like: `root ::= ...`)."""
    after: list[int] | None = None
    """Token ids that open the constrained part (a reasoning parser's end tag): the output is free until they
    appear, then held to the grammar, as vLLM holds only the answer after the reasoning."""

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice and grammar"
                             + (f"; got {', '.join(given)}" if given else ""))
        if self.choice is not None and not self.choice:
            raise ValueError("structured outputs' choice must list at least one string")

    @property
    def key(self) -> tuple:
        """Identifies the grammar (compiled grammars are cached by it)."""
        return (self.json, self.json_object, self.regex, None if self.choice is None else tuple(self.choice),
                self.grammar)


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, array_like=True, frozen=True):
    """Per-request sampling and stopping options; travels inside GenerateRequest / TokenizedRequest."""

    n: int = 1
    """Number of completions for the prompt (each is its own sequence)."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to >= top_p (0, 1]."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 keeps all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's probability [0, 1]."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already generated (OpenAI semantics) [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated [-2, 2]."""
    repetition_penalty: float = 1.0
    """Divides positive / multiplies negative logits of tokens seen in prompt or output (> 0; 1 = off)."""
    seed: int | None = None
    """Per-request seed: the same seed gives the same tokens whatever else is in the batch."""
    max_tokens: int | None = 16
    """Maximum number of generated tokens; None = up to max_model_len."""
    min_tokens: int = 0
    """EOS and stop ids are ignored until this many tokens were generated."""
    stop: list[str] = []
    """Stop strings; the text ends before them unless include_stop_str_in_output."""
    stop_token_ids: list[int] = []
    """Token ids that end the sequence (in addition to EOS unless ignore_eos)."""
    include_stop_str_in_output: bool = False
    """Keep the matched stop string at the end of the text."""
    ignore_eos: bool = False
    """Keep generating after EOS (benchmarks)."""
    logprobs: int | None = None
    """Return the sampled token's logprob plus this many top alternatives (0 = only the sampled one)."""
    prompt_logprobs: int | None = None
    """Also return each prompt token's logprob (the first has none) plus this many top alternatives; the prompt
    is then computed whole, without prefix-cache hits (echo with logprobs, vLLM's prompt_logprobs)."""
    logit_bias: dict[int, float] | None = None
    """Added to these token ids' logits before sampling, [-100, 100] (OpenAI's logit_bias)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the detokenized text."""
    structured_outputs: StructuredOutputs | None = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar (None: unconstrained)."""

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if self.n < 1:
            bad(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            bad(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            bad(f"top_k must be -1 (disable), 0 (disable) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            bad(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            bad(f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        if self.logit_bias and not all(-100 <= b <= 100 for b in self.logit_bias.values()):
            bad("logit_bias values must be in [-100, 100]")
        if self.logit_bias and min(self.logit_bias) < 0:
            bad("logit_bias token ids must not be negative")
        if any(not s for s in self.stop):
            bad("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
