"""Benchmark workloads and arrival schedules: pure, seeded, shared by the offline and online benchmarks.

A benchmark is only comparable across engines and across days if every run sends the very same
requests at the very same moments. Everything here is a function of its arguments and a seed (a
private ``random.Random``, never the global one), so two runs of `bench_serving` against flotilla and
vLLM, or `bench_offline` and `bench_serving` on one model, see identical prompts and output lengths.

  random: prompt / output lengths uniform in [L * (1 - r), L * (1 + r)] around --input-len /
          --output-len (r = --range-ratio; r = 0 gives fixed lengths), as vLLM's random dataset.
  nano:   nano-vllm's bench.py recipe: random.seed(0); each prompt randint(100, 1024) ids long, then
          each output randint(100, 1024) tokens. With vocab_size 10001 the token ids are bit-for-bit
          nano-vllm's (it draws randint(0, 10000)); the default 10000 keeps every id below 10000.
  mixed:  a long/short mix: num_long prompts of one length among others of another, the order shuffled (seeded)
          so the long ones arrive spread among the short.
  images: each request one random square RGB image (its pixels a seeded array) and random text token ids after the
          image's one placeholder token between its start and end tokens: the engine expands the placeholder to the
          image's tokens, as vLLM's processor does for token-id prompts.
  long contexts (long16, long1, mixed, prefix): ../shared/gpu/vllm-peer/long_ctx.py's workloads, the same seeded
          generators call for call, so flotilla's numbers compare with the ones that script measures for vLLM.
          A divisor above 1 shortens every prompt and output for toy runs (at least 1 token each; the prompts are
          then long_ctx.py's LONG_TINY ones at divisor 100).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

NANO_MIN_LEN = 100
"""nano-vllm's shortest prompt and output, tokens."""
NANO_MAX_LEN = 1024
"""nano-vllm's longest prompt and output, tokens."""
NANO_SEED = 0
"""nano-vllm seeds Python's random module with 0."""


@dataclass(frozen=True, slots=True)
class Workload:
    """The requests of one benchmark: prompt token ids and the exact output length of each (ignore_eos)."""

    prompts: list[list[int]]
    """Token ids of each prompt."""
    output_lens: list[int]
    """max_tokens of each request, tokens; with ignore_eos it is also the output length."""

    def __post_init__(self) -> None:
        assert len(self.prompts) == len(self.output_lens), "one output length per prompt"
        assert all(self.prompts) and all(n >= 1 for n in self.output_lens), "empty prompt or output"

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def input_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def nano_workload(num_prompts: int, vocab_size: int = 10000, seed: int = NANO_SEED,
                  min_len: int = NANO_MIN_LEN, max_len: int = NANO_MAX_LEN) -> Workload:
    """nano-vllm's bench.py workload: every prompt first (its length, then its ids), then every output length.

    The draw order is nano-vllm's, so the same seed gives its exact lengths whatever the vocabulary.
    """
    if vocab_size < 1 or not 1 <= min_len <= max_len:
        raise ValueError(f"need vocab_size >= 1 and 1 <= min_len <= max_len (got {vocab_size}, {min_len}, {max_len})")
    rng = random.Random(seed)
    top = vocab_size - 1
    prompts = [[rng.randint(0, top) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_prompts)]
    output_lens = [rng.randint(min_len, max_len) for _ in range(num_prompts)]
    return Workload(prompts, output_lens)


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [low, high] of a length jittered by ``range_ratio`` (vLLM's random dataset rule), low >= 1."""
    if length < 1 or not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"need length >= 1 and 0 <= range_ratio < 1 (got {length}, {range_ratio})")
    return max(1, int(length * (1.0 - range_ratio))), max(1, int(length * (1.0 + range_ratio)))


def random_workload(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    vocab_size: int = 10000, seed: int = 0) -> Workload:
    """Random token-id prompts; lengths uniform in ``length_bounds`` of the input and output lengths."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1 (got {vocab_size})")
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    rng = random.Random(seed)
    input_lens = [rng.randint(in_lo, in_hi) for _ in range(num_prompts)]
    output_lens = [rng.randint(out_lo, out_hi) for _ in range(num_prompts)]
    prompts = [[rng.randrange(vocab_size) for _ in range(n)] for n in input_lens]
    return Workload(prompts, output_lens)


def mixed_workload(num_prompts: int, input_len: int, output_len: int, num_long: int, long_input_len: int,
                   long_output_len: int, vocab_size: int = 10000, seed: int = 0) -> Workload:
    """``num_long`` prompts of ``long_input_len`` tokens (``long_output_len`` out) among ``num_prompts`` in all, the
    rest ``input_len`` / ``output_len``; the order shuffled with the seed, so the long ones arrive spread out."""
    lengths = (input_len, output_len, long_input_len, long_output_len)
    if vocab_size < 1 or not 0 <= num_long <= num_prompts or min(lengths) < 1:
        raise ValueError(f"need vocab_size >= 1, 0 <= num_long <= num_prompts and lengths >= 1 (got {vocab_size}, "
                         f"{num_long} of {num_prompts}, lengths {lengths})")
    rng = random.Random(seed)
    lens = [(long_input_len, long_output_len)] * num_long + [(input_len, output_len)] * (num_prompts - num_long)
    rng.shuffle(lens)
    return Workload([[rng.randrange(vocab_size) for _ in range(n)] for n, _ in lens], [m for _, m in lens])


def arrival_offsets(num_requests: int, request_rate: float, seed: int = 0, burstiness: float = 1.0) -> list[float]:
    """When each request is sent, seconds after the start: a Poisson process at ``request_rate`` req/s.

    Inter-arrival gaps are Gamma(shape=burstiness, mean=1/rate): burstiness 1 is exponential (Poisson
    arrivals), below 1 burstier, above 1 more regular, at the same mean rate (vLLM's --burstiness).
    An infinite rate sends everything at once. The first request leaves at 0 (as in vLLM), so the
    measured duration holds no idle lead-in.
    """
    if not request_rate > 0.0 or burstiness <= 0.0:
        raise ValueError(f"need request_rate > 0 and burstiness > 0 (got {request_rate}, {burstiness})")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    t = 0.0
    offsets = []
    for i in range(num_requests):
        if i:
            t += rng.gammavariate(burstiness, scale)
        offsets.append(t)
    return offsets

LONG_CTX_TOP_ID = 100000
"""long_ctx.py draws token ids in [0, 100000] (Qwen3's vocabulary holds them all)."""


def _long_ctx_prompt(rng: random.Random, n: int, divisor: int, top_id: int) -> list[int]:
    """long_ctx.py's toks(): n // divisor (at least 1) ids in [0, top_id]."""
    return [rng.randint(0, top_id) for _ in range(_shorter(n, divisor))]


def _shorter(n: int, divisor: int) -> int:
    return max(1, n // divisor)


def long16_workload(divisor: int = 1, top_id: int = LONG_CTX_TOP_ID) -> Workload:
    """16 prompts of 32,000 tokens, 256 out each (all at once, prefix caching off)."""
    rng = random.Random(1)
    return Workload([_long_ctx_prompt(rng, 32000, divisor, top_id) for _ in range(16)], [_shorter(256, divisor)] * 16)


def long1_workload(divisor: int = 1, top_id: int = LONG_CTX_TOP_ID) -> Workload:
    """Three different 32,000-token prompts run one at a time: two for one token (the prefill; the faster counts),
    one for 257 (what it takes beyond the prefill is 256 decode steps)."""
    rng = random.Random(2)
    return Workload([_long_ctx_prompt(rng, 32000, divisor, top_id) for _ in range(3)],
                    [1, 1, 1 + _shorter(256, divisor)])


def long128_workload(divisor: int = 1, top_id: int = LONG_CTX_TOP_ID) -> Workload:
    """long1 at 128,000 tokens, for a model whose rope scaling reaches 131,072 (YaRN x 4: the qwen3-8b-yarn shape):
    three prompts run one at a time, two for one token (the prefill), one for 257."""
    rng = random.Random(5)
    return Workload([_long_ctx_prompt(rng, 128000, divisor, top_id) for _ in range(3)],
                    [1, 1, 1 + _shorter(256, divisor)])


def long_mixed_workload(divisor: int = 1, top_id: int = LONG_CTX_TOP_ID) -> Workload:
    """32 prompts of 16,000 tokens (128 out) among 256 of 200 (256 out), shuffled, all at once."""
    rng = random.Random(3)
    prompts = [_long_ctx_prompt(rng, 16000, divisor, top_id) for _ in range(32)]
    prompts += [_long_ctx_prompt(rng, 200, divisor, top_id) for _ in range(256)]
    outputs = [_shorter(128, divisor)] * 32 + [_shorter(256, divisor)] * 256
    order = list(range(len(prompts)))
    random.Random(4).shuffle(order)
    return Workload([prompts[i] for i in order], [outputs[i] for i in order])


def prefix_workload(divisor: int = 1, top_id: int = LONG_CTX_TOP_ID) -> tuple[list[int], Workload]:
    """128 requests of a shared 6,000-token prefix + 100 own tokens, 64 out each (prefix caching on); first the
    prompt that caches the prefix once (the prefix + 10 tokens, for one token), untimed."""
    rng = random.Random(5)
    prefix = _long_ctx_prompt(rng, 6000, divisor, top_id)
    warm = prefix + _long_ctx_prompt(rng, 10, divisor, top_id)
    return warm, Workload([prefix + _long_ctx_prompt(rng, 100, divisor, top_id) for _ in range(128)],
                          [_shorter(64, divisor)] * 128)


@dataclass(frozen=True, slots=True)
class ImageRequest:
    """One request of the images workload: token ids with one image placeholder, and the image's pixels."""

    prompt_token_ids: list[int]
    pixels: Any
    """uint8 [size, size, 3] (a numpy array)."""


def image_workload(num_requests: int, image_size: int, text_tokens: int, vocab_size: int, start_id: int,
                   placeholder_id: int, end_id: int, seed: int) -> list[ImageRequest]:
    """num_requests of (start, placeholder, end, text_tokens random ids below vocab_size) with a random
    image_size x image_size RGB image each, drawn from numpy's seeded generator (the same for every engine)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_requests):
        pixels = rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)
        text = rng.integers(0, vocab_size, text_tokens).tolist()
        out.append(ImageRequest([start_id, placeholder_id, end_id, *text], pixels))
    return out

