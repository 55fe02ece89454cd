"""Batched sampler: penalties, temperature, top-k / top-p / min-p and (seeded) sampling, all on tensors.

The step path never waits on the device: every branch is decided by host-side flags computed once in
`SamplingTensors.build`, every shape is known on the host, and drawing a token uses the exponential race
(argmax of probs / E with E ~ Exp(1)) instead of `torch.multinomial`. Seeded rows take their noise from a
counter-based splitmix64 hash of (seed, generation index, vocab index), so a seeded request samples the
same tokens whatever else is in the batch, wherever its row sits, and on CPU or CUDA.

This file is the torch reference. The pieces are separate functions with tensor-only arguments
(`apply_penalties_`, `apply_top_k_top_p_`, `apply_min_p_`, `exponential_noise`, `exponential_race`) so
a backend (flashinfer, triton) can replace one of them without touching the others.

Logprobs are those of the raw model distribution: log_softmax of the logits as the model produced them,
before logit bias, penalties, temperature and truncation (vLLM's default `raw_logprobs` mode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from flotilla.kernels.staging import upload
from flotilla.sampling_params import SamplingParams

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy (as in vLLM): dividing by them would overflow float32 logits."""

_HASH_CHUNK_ELEMS = 1 << 22
"""Seeded noise is hashed in row chunks of at most this many elements to bound int64/float64 scratch."""

_SORT_CHUNK_ELEMS = 1 << 25
"""Top-p sorts rows in chunks of at most this many logits, so its scratch (sorted values, their int64 order,
probabilities and their cumsum: ~24 bytes a logit) stays under ~1 GiB however many rows a step samples; the memory
profile samples max_num_seqs rows, and what their sort takes at once the KV cache would not get."""


def _as_int64(value: int) -> int:
    """Two's-complement view of an unsigned 64-bit value, so it can multiply an int64 tensor."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _as_int64(0x9E3779B97F4A7C15)
_MIX1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX2 = _as_int64(0x94D049BB133111EB)


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingTensors:
    """Per-row sampling options of one step, on the logits' device, plus host flags that skip unused work."""

    temperature: Tensor
    """[B] float32; 1.0 on greedy rows so dividing by it is a no-op there."""
    greedy: Tensor
    """[B] bool; rows that take the argmax of the penalized logits."""
    top_k: Tensor
    """[B] int64; vocab_size where top-k is off."""
    top_p: Tensor
    """[B] float32; 1.0 where top-p is off."""
    min_p: Tensor
    """[B] float32; 0.0 where min-p is off."""
    repetition_penalty: Tensor
    """[B] float32; 1.0 = off."""
    presence_penalty: Tensor
    """[B] float32; 0.0 = off."""
    frequency_penalty: Tensor
    """[B] float32; 0.0 = off."""
    seeded: Tensor
    """[B] bool; rows whose noise comes from the (seed, generation index) hash."""
    seed: Tensor
    """[B] int64; the request's seed reduced mod 2**64 (0 on unseeded rows)."""
    generation_index: Tensor
    """[B] int64; index of the token being sampled within its request (0 = first output token)."""
    seeded_rows: Tensor
    """[S] int64; row indices of the seeded rows, so the hash runs over S rows only."""
    prompt_keys: Tensor
    """[Np] int64; row * vocab_size + token id of prompt tokens of rows with a repetition penalty."""
    output_keys: Tensor
    """[No] int64; row * vocab_size + token id of output tokens of rows with any penalty (repeats kept)."""
    bias_keys: Tensor
    """[Nb] int64; row * vocab_size + token id of every logit_bias entry."""
    bias_values: Tensor
    """[Nb] float32; the bias added there."""
    vocab_size: int
    """Width of the logits these tensors were built for."""
    max_top_k: int
    """Largest active top-k, so top-k alone needs a topk of that width instead of a full sort."""
    max_num_logprobs: int | None
    """Largest `logprobs` asked by any row (None: no row wants logprobs); pass it to `sample`."""
    # Host flags: the branches of `sample` are decided here, so the step never reads the device.
    all_greedy: bool
    any_greedy: bool
    all_seeded: bool
    do_temperature: bool
    do_top_k: bool
    do_top_p: bool
    do_min_p: bool
    do_repetition: bool
    do_presence: bool
    do_frequency: bool
    do_bias: bool

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        step_indices: Sequence[int],
        device: torch.device | str,
        vocab_size: int,
        prompt_token_ids: Sequence[Sequence[int] | np.ndarray] | None = None,
        output_token_ids: Sequence[Sequence[int] | np.ndarray] | None = None,
    ) -> SamplingTensors:
        """Pack one step's options into a few host->device copies; reads histories of penalized rows only."""
        n = len(params)
        if len(step_indices) != n:
            raise ValueError(f"{len(step_indices)} step indices for {n} rows")
        device = torch.device(device)
        v = vocab_size

        temperature = np.array([p.temperature for p in params], dtype=np.float32)
        greedy = temperature < GREEDY_TEMPERATURE
        random = ~greedy
        top_k = np.array([p.top_k for p in params], dtype=np.int64)
        top_k = np.where((top_k <= 0) | (top_k >= v) | greedy, v, top_k)
        top_p = np.where(greedy, 1.0, np.array([p.top_p for p in params], dtype=np.float32))
        min_p = np.where(greedy, 0.0, np.array([p.min_p for p in params], dtype=np.float32))
        rep = np.array([p.repetition_penalty for p in params], dtype=np.float32)
        presence = np.array([p.presence_penalty for p in params], dtype=np.float32)
        frequency = np.array([p.frequency_penalty for p in params], dtype=np.float32)
        seeded = np.array([p.seed is not None for p in params], dtype=bool) & random
        seed = np.array([_as_int64(p.seed) if p.seed is not None else 0 for p in params], dtype=np.int64)
        temperature = np.where(greedy, 1.0, temperature)

        floats = np.stack([temperature, top_p, min_p, rep, presence, frequency]).astype(np.float32)
        ints = np.stack(
            [top_k, np.where(seeded, seed, 0), np.asarray(step_indices, dtype=np.int64), greedy, seeded]
        ).astype(np.int64)
        f = upload(floats, device)
        i = upload(ints, device)

        rep_rows = np.flatnonzero(rep != 1.0)
        penalized_rows = np.flatnonzero((rep != 1.0) | (presence != 0.0) | (frequency != 0.0))
        prompt_keys = _history_keys(prompt_token_ids, rep_rows, v, "prompt_token_ids")
        output_keys = _history_keys(output_token_ids, penalized_rows, v, "output_token_ids")

        bias_keys, bias_values = _bias(params, v)
        active_k = top_k[random & (top_k < v)]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=f[0],
            top_p=f[1],
            min_p=f[2],
            repetition_penalty=f[3],
            presence_penalty=f[4],
            frequency_penalty=f[5],
            top_k=i[0],
            seed=i[1],
            generation_index=i[2],
            greedy=i[3].bool(),
            seeded=i[4].bool(),
            seeded_rows=upload(np.flatnonzero(seeded).astype(np.int64), device),
            prompt_keys=upload(prompt_keys, device),
            output_keys=upload(output_keys, device),
            bias_keys=upload(bias_keys, device),
            bias_values=upload(bias_values, device),
            vocab_size=v,
            max_top_k=int(active_k.max()) if active_k.size else v,
            max_num_logprobs=max(logprobs) if logprobs else None,
            all_greedy=bool(greedy.all()),
            any_greedy=bool(greedy.any()),
            all_seeded=bool(seeded.all()),
            do_temperature=bool((temperature != 1.0).any()),
            do_top_k=bool(active_k.size),
            do_top_p=bool((top_p < 1.0).any()),
            do_min_p=bool((min_p > 0.0).any()),
            do_repetition=bool(rep_rows.size) and (prompt_keys.size + output_keys.size) > 0,
            do_presence=bool((presence != 0.0).any()) and output_keys.size > 0,
            do_frequency=bool((frequency != 0.0).any()) and output_keys.size > 0,
            do_bias=bool(bias_keys.size),
        )


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    """What one step samples; all on the logits' device so the worker copies it to the host once."""

    token_ids: Tensor
    """[B] int64 sampled tokens."""
    logprobs: Tensor | None = None
    """[B] float32 raw-model logprob of the sampled token; None when logprobs were not requested."""
    top_token_ids: Tensor | None = None
    """[B, n] int64 the n most likely tokens of the raw model distribution, most likely first."""
    top_logprobs: Tensor | None = None
    """[B, n] float32 their raw logprobs, descending."""


def _bias(params: Sequence[SamplingParams], vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows' logit_bias entries as (row * vocab_size + token id, bias)."""
    keys: list[int] = []
    values: list[float] = []
    for row, p in enumerate(params):
        if p.logit_bias:
            if max(p.logit_bias) >= vocab_size:  # (a device-side assert on CUDA would kill the context)
                raise ValueError(f"logit_bias holds a token id outside [0, {vocab_size})")
            keys += [row * vocab_size + t for t in p.logit_bias]
            values += p.logit_bias.values()
    return np.asarray(keys, dtype=np.int64), np.asarray(values, dtype=np.float32)


def _history_keys(
    histories: Sequence[Sequence[int] | np.ndarray] | None, rows: np.ndarray, vocab_size: int, name: str
) -> np.ndarray:
    """Flatten the token histories of `rows` into row * vocab_size + token keys (a CSR without offsets)."""
    if rows.size == 0:
        return np.empty(0, dtype=np.int64)
    if histories is None:
        raise ValueError(f"penalties need {name}")
    parts = [np.asarray(histories[r], dtype=np.int64).reshape(-1) for r in rows]
    ids = np.concatenate(parts)
    # An out-of-range id would be a device-side assert on CUDA, which kills the whole context.
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"{name} holds a token id outside [0, {vocab_size})")
    return ids + np.repeat(rows.astype(np.int64) * vocab_size, [p.size for p in parts])


def apply_penalties_(
    logits: Tensor,
    prompt_keys: Tensor,
    output_keys: Tensor,
    repetition_penalty: Tensor | None,
    presence_penalty: Tensor | None,
    frequency_penalty: Tensor | None,
) -> Tensor:
    """Repetition (prompt + output), then frequency and presence (output) in place, O(tokens) memory.

    Repeated keys are harmless: the repetition and presence passes gather before they scatter, so every
    duplicate writes the same value, and the frequency pass adds the same amount once per occurrence.
    """
    v = logits.shape[1]
    flat = logits.view(-1)
    if repetition_penalty is not None:
        keys = torch.cat([prompt_keys, output_keys])
        penalty = repetition_penalty[torch.div(keys, v, rounding_mode="floor")]
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / penalty, values * penalty)
    if frequency_penalty is not None or presence_penalty is not None:
        rows = torch.div(output_keys, v, rounding_mode="floor")
        if frequency_penalty is not None:
            flat.index_put_((output_keys,), -frequency_penalty[rows], accumulate=True)
        if presence_penalty is not None:
            flat[output_keys] = flat[output_keys] - presence_penalty[rows]
    return logits


def apply_top_k_top_p_(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None, max_top_k: int) -> Tensor:
    """Mask to -inf what falls outside each row's top-k and nucleus; a full sort only when top-p is on."""
    v = logits.shape[1]
    if top_p is None:
        if top_k is None:
            return logits
        # top-k alone: the k-th largest value is the threshold; ties with it are kept.
        values = logits.topk(min(max_top_k, v), dim=-1).values
        kth = values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
        kth.masked_fill_((top_k >= v).unsqueeze(1), -torch.inf)
        return logits.masked_fill_(logits < kth, -torch.inf)
    rows = max(1, _SORT_CHUNK_ELEMS // max(v, 1))
    for start in range(0, logits.shape[0], rows):
        end = start + rows
        _apply_top_p_rows_(logits[start:end], None if top_k is None else top_k[start:end], top_p[start:end])
    return logits


def _apply_top_p_rows_(logits: Tensor, top_k: Tensor | None, top_p: Tensor) -> None:
    """apply_top_k_top_p_ with top-p on, for rows few enough to sort at once."""
    v = logits.shape[1]
    # Stable so ties resolve the same way whatever the batch.
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        position = torch.arange(v, device=logits.device)
        sorted_logits.masked_fill_(position >= top_k.unsqueeze(1), -torch.inf)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    # Rows with top_p == 1 keep everything, even where the float cumsum reaches 1 early.
    p = torch.where(top_p < 1.0, top_p, torch.inf).unsqueeze(1)
    sorted_logits.masked_fill_(mass_before >= p, -torch.inf)
    logits.scatter_(1, order, sorted_logits)


def apply_min_p_(logits: Tensor, min_p: Tensor) -> Tensor:
    """Drop tokens with prob < min_p * max prob; in log space that is logit < max logit + log(min_p)."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill_(logits < threshold, -torch.inf)


def _lshr(z: Tensor, shift: int) -> Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> shift) & ((1 << (64 - shift)) - 1)


def splitmix64_(z: Tensor) -> Tensor:
    """splitmix64's finalizer in place on int64 (wrapping multiply), bit-identical on every device."""
    z ^= _lshr(z, 30)
    z *= _MIX1
    z ^= _lshr(z, 27)
    z *= _MIX2
    z ^= _lshr(z, 31)
    return z


def seeded_exponentials(seed: Tensor, generation_index: Tensor, vocab_size: int) -> Tensor:
    """[S, V] Exp(1) noise that depends only on (seed, generation index, vocab index), per row.

    Row key = mix(mix(seed) + (generation_index + 1) * golden); element = mix(key + (vocab index + 1) *
    golden), i.e. position v of a splitmix64 stream. The top 53 bits become an odd multiple of 2**-53, so
    u is exact in float64 and strictly inside (0, 1); -log(u) is taken in float64 and rounded to float32,
    which makes the noise identical on CPU and CUDA.
    """
    key = splitmix64_(splitmix64_(seed.clone()) + (generation_index + 1) * _GOLDEN)
    out = torch.empty(seed.shape[0], vocab_size, dtype=torch.float32, device=seed.device)
    stream = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=seed.device) * _GOLDEN
    rows = max(1, _HASH_CHUNK_ELEMS // max(vocab_size, 1))
    for start in range(0, seed.shape[0], rows):
        z = splitmix64_(key[start : start + rows, None] + stream)
        u = (_lshr(z, 11) | 1).to(torch.float64).mul_(2.0**-53)
        out[start : start + rows] = u.log_().neg_()
    return out


def exponential_noise(
    shape: tuple[int, int],
    device: torch.device,
    seeded_rows: Tensor,
    seed: Tensor,
    generation_index: Tensor,
    all_seeded: bool,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Exp(1) noise per logit: the torch generator for unseeded rows, the hash for seeded ones."""
    noise = torch.empty(shape, dtype=torch.float32, device=device)
    if not all_seeded:
        noise.exponential_(generator=generator)
        # Exp(1) of exactly 0 would make p / E infinite for any token, even one with p == 0.
        noise.clamp_(min=torch.finfo(torch.float32).tiny)
    if seeded_rows.numel():
        seeded_noise = seeded_exponentials(seed[seeded_rows], generation_index[seeded_rows], shape[1])
        noise.index_copy_(0, seeded_rows, seeded_noise)
    return noise


def exponential_race(logits: Tensor, noise: Tensor) -> Tensor:
    """argmax(p / E) samples from softmax(logits) without multinomial's host sync; overwrites logits."""
    # Unnormalised probabilities suffice: the per-row normaliser does not change the argmax.
    probs = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    return probs.div_(noise).argmax(dim=-1)


def greedy_argmax(logits: Tensor) -> Tensor:
    """logits [B, V] -> int64 [B], logits.argmax(dim=-1); on CUDA triton's two-launch argmax (kernels/triton/argmax.py:
    torch reduces a row in one program, slow over a large vocabulary at batch 1)."""
    if logits.is_cuda and logits.dim() == 2:
        from flotilla.kernels.triton.argmax import argmax_rows  # imports triton: CUDA only here

        return argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample(
    logits: Tensor,
    st: SamplingTensors,
    num_logprobs: int | None = None,
    generator: torch.Generator | None = None,
    greedy_ids: Tensor | None = None,
) -> SamplerOutput:
    """Sample one token per row of `logits` [B, V]; a float32 `logits` is used as scratch and overwritten.

    num_logprobs: None (or negative) returns no logprobs; 0 returns the sampled token's raw logprob; n > 0
    also returns the n most likely tokens. Pass `st.max_num_logprobs` and slice per row on the host.
    generator: source of the unseeded rows' noise (torch's default generator when None).
    greedy_ids: logits.argmax(dim=-1) if already computed (a decode graph's, on the logits before this call); used
    for the greedy rows unless a penalty changes the logits first.
    """
    if logits.ndim != 2 or logits.shape[1] != st.vocab_size:
        raise ValueError(f"logits {tuple(logits.shape)} do not match vocab_size {st.vocab_size}")
    if logits.dtype != torch.float32:
        logits = logits.float()
    raw_logprobs = logits.log_softmax(dim=-1) if num_logprobs is not None and num_logprobs >= 0 else None

    if st.do_bias:
        greedy_ids = None  # (the argmax of the logits before the bias)
        logits.view(-1).index_add_(0, st.bias_keys, st.bias_values)
    if st.do_repetition or st.do_presence or st.do_frequency:
        greedy_ids = None  # (the argmax of the logits before the penalties)
        apply_penalties_(
            logits,
            st.prompt_keys,
            st.output_keys,
            st.repetition_penalty if st.do_repetition else None,
            st.presence_penalty if st.do_presence else None,
            st.frequency_penalty if st.do_frequency else None,
        )

    if st.all_greedy:  # (a copy of a graph's: its next replay overwrites the buffer)
        token_ids = greedy_ids.clone() if greedy_ids is not None else greedy_argmax(logits)
    else:
        greedy_ids = (greedy_ids if greedy_ids is not None else greedy_argmax(logits)) if st.any_greedy else None
        if st.do_temperature:
            logits.div_(st.temperature.unsqueeze(1))
        if st.do_top_k or st.do_top_p:
            apply_top_k_top_p_(
                logits, st.top_k if st.do_top_k else None, st.top_p if st.do_top_p else None, st.max_top_k
            )
        if st.do_min_p:
            apply_min_p_(logits, st.min_p)
        noise = exponential_noise(
            tuple(logits.shape), logits.device, st.seeded_rows, st.seed, st.generation_index, st.all_seeded,
            generator,
        )
        token_ids = exponential_race(logits, noise)
        if greedy_ids is not None:
            token_ids = torch.where(st.greedy, greedy_ids, token_ids)

    if raw_logprobs is None:
        return SamplerOutput(token_ids=token_ids)
    sampled = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    top_logprobs, top_ids = raw_logprobs.topk(min(num_logprobs, st.vocab_size), dim=-1, sorted=True)
    return SamplerOutput(
        token_ids=token_ids, logprobs=sampled, top_token_ids=top_ids, top_logprobs=top_logprobs
    )
