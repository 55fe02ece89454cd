"""Sampler: truncation never leaks, seeded rows ignore the batch, distributions match softmax, penalties
and logprobs follow vLLM/OpenAI semantics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flotilla.kernels import sampling
from flotilla.kernels.sampling import (SamplingTensors, apply_penalties_, apply_top_k_top_p_, sample,
                                       seeded_exponentials)
from flotilla.sampling_params import SamplingParams

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fixed_seed() -> None:
    torch.manual_seed(1234)


def _build(params: list[SamplingParams], vocab: int, steps: list[int] | None = None, **kw) -> SamplingTensors:
    return SamplingTensors.build(params, steps if steps is not None else [0] * len(params), CPU, vocab, **kw)


def _draw(logits_row: torch.Tensor, params: SamplingParams, n: int, **kw) -> torch.Tensor:
    """n independent draws from one distribution, as one batch of n identical rows."""
    logits = logits_row.expand(n, -1).clone()
    return sample(logits, _build([params] * n, logits.shape[1], **kw)).token_ids


def _splitmix64(x: int) -> int:
    """Textbook splitmix64 finalizer on Python ints, the reference for the tensor version."""
    m = (1 << 64) - 1
    x &= m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def test_temperature_zero_is_argmax() -> None:
    logits = torch.randn(16, 300)
    st = _build([SamplingParams(temperature=0.0, top_k=3, top_p=0.5, seed=7)] * 16, 300)
    assert st.all_greedy
    out = sample(logits.clone(), st)
    assert torch.equal(out.token_ids, logits.argmax(-1))


def test_mixed_greedy_and_sampled_rows() -> None:
    logits = torch.randn(64, 50)
    params = [SamplingParams(temperature=0.0 if r % 2 == 0 else 1.5) for r in range(64)]
    tokens = sample(logits.clone(), _build(params, 50)).token_ids
    greedy = torch.arange(64) % 2 == 0
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    assert not torch.equal(tokens[~greedy], logits.argmax(-1)[~greedy])  # sampled rows really sample
    # top_k=1 in a mixed batch is argmax too.
    params = [SamplingParams(temperature=0.0) if r % 2 == 0 else SamplingParams(top_k=1) for r in range(64)]
    assert torch.equal(sample(logits.clone(), _build(params, 50)).token_ids, logits.argmax(-1))


def test_a_graphs_argmax_stands_for_the_greedy_rows_unless_a_penalty_changes_the_logits() -> None:
    """sample(greedy_ids=...): a decode graph hands over its argmax of the logits. Marked ids (not the argmax) show
    where they are used: for every greedy row, as a copy (the graph's next replay overwrites its buffer), and not
    once a penalty has changed the logits."""
    logits = torch.randn(8, 40)
    marked = (logits.argmax(-1) + 1) % 40
    st = _build([SamplingParams(temperature=0.0)] * 8, 40)
    out = sample(logits.clone(), st, greedy_ids=marked).token_ids
    assert torch.equal(out, marked) and out.data_ptr() != marked.data_ptr()
    params = [SamplingParams(temperature=0.0 if r % 2 == 0 else 1.0) for r in range(8)]
    out = sample(logits.clone(), _build(params, 40), greedy_ids=marked).token_ids
    assert torch.equal(out[::2], marked[::2])
    penalized = [SamplingParams(temperature=0.0, repetition_penalty=1.0001)] * 8
    st = _build(penalized, 40, prompt_token_ids=[[0]] * 8, output_token_ids=[[]] * 8)
    assert torch.equal(sample(logits.clone(), st, greedy_ids=marked).token_ids, logits.argmax(-1))


def test_logit_bias_moves_only_its_rows_tokens_and_logprobs_stay_raw() -> None:
    """+100 forces a token, -100 bans the argmax, a row without bias is untouched; the reported logprobs are the
    model's own (before the bias), and a graph's argmax is not used once a bias changed the logits."""
    logits = torch.randn(3, 40)
    argmax = logits.argmax(-1)
    forced = int((argmax[0] + 5) % 40)
    params = [SamplingParams(temperature=0.0, logit_bias={forced: 100.0}),
              SamplingParams(temperature=0.0, logit_bias={int(argmax[1]): -100.0}),
              SamplingParams(temperature=0.0)]
    st = _build(params, 40)
    out = sample(logits.clone(), st, 0, greedy_ids=argmax.clone())
    assert out.token_ids[0] == forced and out.token_ids[1] != argmax[1] and out.token_ids[2] == argmax[2]
    assert out.token_ids[1] == logits[1].topk(2).indices[1]
    raw = logits.log_softmax(-1).gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(out.logprobs, raw)
    with pytest.raises(ValueError, match="logit_bias"):
        _build([SamplingParams(logit_bias={40: 1.0})], 40)


@pytest.mark.parametrize("with_top_p", [False, True])
def test_top_k_never_leaves_top_k(with_top_p: bool) -> None:
    vocab, n = 200, 4000
    logits = torch.randn(vocab) * 0.3  # flat, so without top-k most draws would fall outside it
    top_p = 0.999999 if with_top_p else 1.0  # forces the sort path without cutting anything here
    for k in (1, 5, 37):
        tokens = _draw(logits, SamplingParams(top_k=k, top_p=top_p), n)
        allowed = set(logits.topk(k).indices.tolist())
        assert set(tokens.tolist()) == allowed


def test_top_k_rows_differ_in_one_batch() -> None:
    vocab, per_row = 100, 500
    logits = torch.randn(vocab)
    ks = [2, 0, 10, -1, 3]
    params = [SamplingParams(top_k=k) for k in ks for _ in range(per_row)]
    tokens = sample(logits.expand(len(params), -1).clone(), _build(params, vocab)).token_ids
    tokens = tokens.view(len(ks), per_row)
    for row, k in zip(tokens, ks):
        if k > 0:
            assert set(row.tolist()) == set(logits.topk(k).indices.tolist())
        else:
            assert len(set(row.tolist())) > 10


def _nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    order = probs.double().argsort(descending=True)
    mass_before = probs.double()[order].cumsum(0) - probs.double()[order]
    return set(order[mass_before < top_p].tolist())


def test_top_p_never_samples_outside_nucleus() -> None:
    vocab, n = 64, 4000
    logits = torch.randn(vocab)
    probs = logits.softmax(-1)
    cum = probs.double().sort(descending=True).values.cumsum(0)
    for cut in (1, 4, 12):
        # A top_p half way between two cumulative masses: the nucleus is unambiguous.
        top_p = float((cum[cut - 1] + cum[cut]) / 2)
        nucleus = _nucleus(probs, top_p)
        assert len(nucleus) == cut + 1
        tokens = _draw(logits, SamplingParams(top_p=top_p), n)
        assert set(tokens.tolist()) == nucleus


def test_top_p_with_temperature_and_top_k_mixed_batch() -> None:
    vocab, per_row = 80, 1500
    logits = torch.randn(vocab) * 2
    settings = [(0.5, 0, 0.9), (2.0, 5, 0.7), (1.0, 20, 1.0), (0.8, 0, 0.3)]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in settings for _ in range(per_row)]
    tokens = sample(logits.expand(len(params), -1).clone(), _build(params, vocab)).token_ids
    for row, (t, k, p) in zip(tokens.view(len(settings), per_row), settings):
        scaled = logits / t
        if k > 0:
            scaled = scaled.masked_fill(scaled < scaled.topk(k).values[-1], -torch.inf)
        allowed = _nucleus(scaled.softmax(-1), p)
        assert set(row.tolist()) <= allowed


def test_top_p_sorts_rows_in_chunks_and_masks_as_one_sort_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's rows are sorted a chunk at a time (bounding the sort's scratch): every row masked as when all
    rows are sorted at once, whatever chunk it falls in."""
    vocab, rows = 50, 11
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(3)) * 2
    top_k = torch.tensor([vocab, 5, 50, 1, 7, vocab, 3, vocab, 20, 2, 9])  # (vocab: no top-k for that row)
    top_p = torch.tensor([0.9, 1.0, 0.5, 0.7, 0.95, 0.3, 1.0, 0.8, 0.6, 0.99, 0.4])
    whole = apply_top_k_top_p_(logits.clone(), top_k, top_p, max_top_k=vocab)
    assert whole.isinf().any(dim=1).sum() >= 8  # (most rows lose tokens: the comparison sees the masks)
    monkeypatch.setattr(sampling, "_SORT_CHUNK_ELEMS", 3 * vocab)  # chunks of 3 rows, the last of 2
    assert torch.equal(apply_top_k_top_p_(logits.clone(), top_k, top_p, max_top_k=vocab), whole)
    monkeypatch.setattr(sampling, "_SORT_CHUNK_ELEMS", 1)  # a row at a time
    assert torch.equal(apply_top_k_top_p_(logits.clone(), top_k, top_p, max_top_k=vocab), whole)


def test_min_p_never_samples_below_threshold() -> None:
    vocab, n = 120, 4000
    logits = torch.randn(vocab) * 2
    probs = logits.softmax(-1)
    for min_p in (0.05, 0.3, 0.9):
        allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
        tokens = _draw(logits, SamplingParams(min_p=min_p), n)
        assert set(tokens.tolist()) <= allowed
        assert len(set(tokens.tolist())) >= min(len(allowed), 2)


def _seeded_run(
    params: SamplingParams, logits_per_step: torch.Tensor, row: int, batch: int, offset: int
) -> list[int]:
    """Tokens of one seeded request over steps, at `row` of a batch of unrelated rows at other positions."""
    vocab = logits_per_step.shape[1]
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5, top_p=0.8, seed=99),
        SamplingParams(min_p=0.1, temperature=0.7, frequency_penalty=0.5, repetition_penalty=1.3),
        SamplingParams(seed=123, presence_penalty=1.0),
    ]
    out = []
    for step, row_logits in enumerate(logits_per_step):
        batch_params = [others[(r + offset) % len(others)] for r in range(batch)]
        batch_params[row] = params
        logits = torch.randn(batch, vocab) * 3
        logits[row] = row_logits
        steps = [step + 17 * (r + offset) for r in range(batch)]
        steps[row] = step
        history = [list(range(r % 4 + 1)) for r in range(batch)]
        st = _build(batch_params, vocab, steps, prompt_token_ids=history, output_token_ids=history)
        out.append(int(sample(logits, st).token_ids[row]))
    return out


def test_seeded_request_ignores_batch_and_position() -> None:
    vocab = 500
    logits = torch.randn(30, vocab)
    params = SamplingParams(seed=2024, temperature=1.2)
    alone = _seeded_run(params, logits, row=0, batch=1, offset=0)
    torch.manual_seed(999)  # the default generator's state must not matter either
    assert _seeded_run(params, logits, row=3, batch=7, offset=1) == alone
    assert _seeded_run(params, logits, row=10, batch=11, offset=4) == alone
    assert len(set(alone)) > 20  # the generation index really advances the noise
    # Truncation on the seeded row itself is batch-independent too.
    params = SamplingParams(seed=5, top_k=50, top_p=0.9, min_p=0.01)
    assert _seeded_run(params, logits, 0, 1, 0) == _seeded_run(params, logits, 5, 9, 2)


def test_different_seeds_differ() -> None:
    vocab = 1000
    logits = torch.zeros(20, vocab)
    runs = {tuple(_seeded_run(SamplingParams(seed=s), logits, 0, 1, 0)) for s in (0, 1, 2, -1, 2**64 + 1)}
    assert len(runs) == 4  # 2**64 + 1 wraps onto seed 1, everything else differs


def test_seeded_noise_is_splitmix64() -> None:
    seeds = [0, 1, -1, 2**63 - 1, 123456789]
    steps = [0, 5, 1, 1000, 7]
    vocab = 9
    got = seeded_exponentials(torch.tensor(seeds), torch.tensor(steps), vocab)
    golden = 0x9E3779B97F4A7C15
    m = (1 << 64) - 1
    for row, (seed, step) in enumerate(zip(seeds, steps)):
        key = _splitmix64((_splitmix64(seed) + (step + 1) * golden) & m)
        for v in range(vocab):
            bits = _splitmix64((key + (v + 1) * golden) & m) >> 11
            expected = np.float32(-np.log(((bits | 1) * 2.0**-53)))
            assert got[row, v].item() == expected


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_unseeded_distribution_matches_softmax(temperature: float) -> None:
    n = 40000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    tokens = _draw(logits, SamplingParams(temperature=temperature), n)
    # chi-square with 7 degrees of freedom: 99.9999% quantile is ~ 38.
    assert _chi_square(tokens, (logits / temperature).softmax(-1)) < 40


def test_seeded_distribution_matches_softmax() -> None:
    vocab, n = 8, 40000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    probs = logits.softmax(-1)
    # One request over many generation indices ...
    tokens = _draw(logits, SamplingParams(seed=42), n, steps=list(range(n)))
    assert _chi_square(tokens, probs) < 40
    # ... and many seeds at one index.
    params = [SamplingParams(seed=s) for s in range(n)]
    tokens = sample(logits.expand(n, -1).clone(), _build(params, vocab)).token_ids
    assert _chi_square(tokens, probs) < 40


def _naive_penalties(logits, prompt, output, rep, presence, frequency):
    out = logits.clone()
    for r in range(logits.shape[0]):
        for tok in set(prompt[r]) | set(output[r]):
            x = out[r, tok]
            out[r, tok] = x / rep[r] if x > 0 else x * rep[r]
        for tok in set(output[r]):
            out[r, tok] -= frequency[r] * output[r].count(tok) + presence[r]
    return out


def test_penalties_match_naive_formula() -> None:
    rows, vocab = 6, 40
    gen = np.random.default_rng(0)
    logits = torch.randn(rows, vocab) * 3
    prompt = [gen.integers(0, vocab, gen.integers(0, 12)).tolist() for _ in range(rows)]
    output = [gen.integers(0, vocab, gen.integers(0, 12)).tolist() for _ in range(rows)]
    output[0] = [3, 3, 3, 5]  # repeats count for frequency, once for presence
    rep = [1.0, 1.3, 0.7, 1.0, 2.0, 1.0]
    presence = [0.5, 0.0, -1.0, 1.5, 0.2, 0.0]
    frequency = [0.3, 0.0, 0.4, -0.6, 1.0, 0.0]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=a, presence_penalty=b, frequency_penalty=c)
        for a, b, c in zip(rep, presence, frequency)
    ]
    st = _build(params, vocab, prompt_token_ids=prompt, output_token_ids=output)
    expected = _naive_penalties(logits, prompt, output, rep, presence, frequency)
    got = apply_penalties_(
        logits.clone(), st.prompt_keys, st.output_keys, st.repetition_penalty, st.presence_penalty,
        st.frequency_penalty,
    )
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    # Through sample(): greedy rows take the argmax of the penalized logits.
    assert torch.equal(sample(logits.clone(), st).token_ids, expected.argmax(-1))


def test_penalties_need_histories_and_valid_ids() -> None:
    with pytest.raises(ValueError, match="output_token_ids"):
        _build([SamplingParams(frequency_penalty=1.0)], 10)
    with pytest.raises(ValueError, match="outside"):
        _build([SamplingParams(repetition_penalty=1.2)], 10, prompt_token_ids=[[10]], output_token_ids=[[]])
    st = _build([SamplingParams(), SamplingParams()], 10)  # no penalties: no histories needed
    assert not (st.do_repetition or st.do_presence or st.do_frequency)


@pytest.mark.parametrize("num_logprobs", [0, 1, 5])
def test_logprobs_are_raw_log_softmax(num_logprobs: int) -> None:
    rows, vocab = 10, 70
    logits = torch.randn(rows, vocab) * 2
    params = [
        SamplingParams(temperature=0.3 + r * 0.2, top_k=r, repetition_penalty=1.5, logprobs=num_logprobs)
        for r in range(rows)
    ]
    params[0] = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    history = [[r, r + 1, r + 1] for r in range(rows)]
    st = _build(params, vocab, prompt_token_ids=history, output_token_ids=history)
    assert st.max_num_logprobs == num_logprobs
    out = sample(logits.clone(), st, st.max_num_logprobs)
    reference = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, reference.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_logprobs.shape == out.top_token_ids.shape == (rows, num_logprobs)
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])
    torch.testing.assert_close(out.top_logprobs, reference.topk(num_logprobs).values)
    torch.testing.assert_close(out.top_logprobs, reference.gather(1, out.top_token_ids))
    assert torch.equal(out.top_token_ids, reference.topk(num_logprobs).indices)


def test_no_logprobs_by_default_and_empty_batch() -> None:
    out = sample(torch.randn(3, 20), _build([SamplingParams()] * 3, 20))
    assert out.logprobs is None and out.top_token_ids is None
    empty = sample(torch.randn(0, 20), _build([], 20), 2)
    assert empty.token_ids.shape == (0,) and empty.top_token_ids.shape == (0, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_seeded_noise_and_tokens_match_across_devices() -> None:
    seeds, steps = torch.tensor([3, -8, 2**62]), torch.tensor([0, 9, 123])
    cpu = seeded_exponentials(seeds, steps, 151_936)
    cuda = seeded_exponentials(seeds.cuda(), steps.cuda(), 151_936)
    assert torch.equal(cpu, cuda.cpu())
    logits = torch.randn(4, 1000)
    params = [SamplingParams(seed=s, top_p=0.9, repetition_penalty=1.1) for s in range(4)]
    history = [[1, 2, 3]] * 4
    kw = dict(prompt_token_ids=history, output_token_ids=history)
    on_cpu = sample(logits.clone(), SamplingTensors.build(params, [5] * 4, "cpu", 1000, **kw)).token_ids
    on_cuda = sample(logits.cuda(), SamplingTensors.build(params, [5] * 4, "cuda", 1000, **kw)).token_ids
    assert torch.equal(on_cpu, on_cuda.cpu())
