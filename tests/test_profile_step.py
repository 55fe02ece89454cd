"""scripts/dev/profile_step.py's mixed-step profile on CPU: its plans are what the scheduler would send, and each of its
three steps (mixed, decode half, prefill half) really runs the rows it claims (timings are only read on the GPU)."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import torch

from flotilla.actors.model_runner import ModelRunner
from flotilla.config import EngineConfig
from flotilla.scripts.dev import profile_step

from helpers_tiny_models import write_tiny_model


@pytest.fixture
def runner(tmp_path: Path) -> ModelRunner:
    model = write_tiny_model(tmp_path / "m", "qwen3")
    config = EngineConfig.from_options(model=str(model), device="cpu", dtype="float32", kv_cache_blocks=64,
                                       block_size=4, skip_tokenizer_init=True)
    return ModelRunner(config, progress=False)


def test_a_mixed_step_samples_what_its_decode_and_prefill_halves_sample(runner):
    setup, mixed, decode_only, prefill_only = profile_step.mixed_plans(runner, decodes=5, context=9, tokens=12,
                                                                       per_seq=4)
    assert len(setup) == 1 and sum(map(len, (p.rids for p in setup))) == 5
    assert mixed.rids == decode_only.rids + prefill_only.rids and mixed.num_new_tokens.tolist() == [1] * 5 + [4] * 3
    blocks = [b for p in setup + [prefill_only] for s in p.new_seqs for b in s.block_ids.tolist()]
    assert len(blocks) == len(set(blocks))  # no two sequences share a KV block
    for plan in setup:
        runner.execute(plan)
    got = runner.execute(mixed)
    for r in prefill_only.rids:  # run the halves from the same state: prompts forgotten, decodes one step back
        runner.seqs.pop(r)
    for r in decode_only.rids:
        s = runner.seqs[r]
        s.num_computed, s.length, s.host_length = 9, 10, 10
    halves = runner.execute(msgspec.structs.replace(decode_only, step=100))
    halves_p = runner.execute(msgspec.structs.replace(prefill_only, step=101))
    assert got.rids == halves.rids + halves_p.rids
    assert got.token_ids.tolist() == halves.token_ids.tolist() + halves_p.token_ids.tolist()


def test_profile_mixed_runs_each_step_twice_and_reports_them(runner):
    out = profile_step.profile_mixed(runner, decodes=4, context=6, tokens=8, per_seq=4)
    assert out["mixed"]["sampled"] == 6 and out["decode_only"]["sampled"] == 4 and out["prefill_only"]["sampled"] == 2
    assert out["mixed_prefill_tokens"] == 8 and all(out[k]["step_ms"] > 0 for k in ("mixed", "decode_only"))


def test_host_timers_time_each_kind_of_callable_and_put_them_back(runner):
    import types

    import numpy as np

    class K:
        def method(self, x):
            return x + 1

        @classmethod
        def make(cls, x):
            return (cls, x)

    # (a module keeps its functions in __dict__ too)
    module = types.SimpleNamespace(fn=lambda x: time.sleep(0.01) or x * 2)
    k = K()
    before = (K.__dict__["method"], K.__dict__["make"], module.fn)
    targets = [("inst", k, "method"), ("cls", K, "make"), ("mod", module, "fn"), ("fn", K, "method")]
    with profile_step.HostTimers(targets) as timers:
        assert k.method(1) == 2 and K.make(3) == (K, 3) and module.fn(4) == 8
        assert K().method(5) == 6  # through the class's function (another instance)
    assert set(timers.seconds) == {"inst", "cls", "mod", "fn"} and all(v > 0 for v in timers.seconds.values())
    assert timers.seconds["mod"] >= 0.01  # the call's own time (a lower bound: load only lengthens it)
    assert (K.__dict__["method"], K.__dict__["make"], module.fn) == before and "method" not in vars(k)
    labels = [t[0] for t in profile_step.host_breakdown_targets(runner)]
    assert {"input_ids", "compute_logits", "sample", "pending_launch", "greedy_argmax"} <= set(labels)
    (prefill,), decodes = profile_step.decode_plans(runner, 1, 4, 3, prefix="z")
    np.testing.assert_equal(runner.execute(prefill).rids, ["z0"])
    assert profile_step.run_overlapped(runner, decodes) > 0 and runner.num_pending == 0
    assert runner.seqs["z0"].length == 4 + 1 + 3  # the prompt, the prefill's token, one per decode step


def test_prompts_prefilled_in_chunks_of_a_token_budget_decode_as_after_one_prefill_step(runner):
    """Three 10-token prompts under an 8-token budget: each step at most 8 tokens, a prompt split across steps,
    each sequence new in the step of its first chunk; then the decodes sample what they do after one prefill step."""
    chunked, decodes = profile_step.decode_plans(runner, 3, 10, 4, chunk_tokens=8)
    assert [p.num_new_tokens.tolist() for p in chunked] == [[8], [2, 6], [4, 4], [6]]
    assert [[n.rid for n in p.new_seqs] for p in chunked] == [["s0"], ["s1"], ["s2"], []]
    assert [p.step for p in chunked + decodes[:1]] == [0, 1, 2, 3, 4]
    for plan in chunked:
        runner.execute(plan)
    got = [runner.execute(plan).token_ids.tolist() for plan in decodes]
    (whole,), decodes2 = profile_step.decode_plans(runner, 3, 10, 4, first_step=100, prefix="w")
    runner.execute(whole)
    assert [runner.execute(plan).token_ids.tolist() for plan in decodes2] == got


def test_device_gaps_sums_the_idle_time_between_activities_by_the_pair_around_it():
    """Two steps of [copy, kernel a, kernel b (overlapping a), gap, kernel c]: idle time per step by the pair of
    activities that frame it, an activity inside another's span not ending the busy stretch early."""
    from types import SimpleNamespace

    cuda = torch.autograd.DeviceType.CUDA

    def ev(start, end, name):
        return SimpleNamespace(device_type=cuda, time_range=SimpleNamespace(start=start, end=end), name=name)

    events = []
    for base in (0, 100):
        events += [ev(base, base + 5, "Memcpy HtoD"), ev(base + 8, base + 30, "a"), ev(base + 10, base + 20, "b"),
                   ev(base + 40, base + 90, "c")]
    events.append(SimpleNamespace(device_type=torch.autograd.DeviceType.CPU,
                                  time_range=SimpleNamespace(start=0, end=500), name="host"))
    out = profile_step.device_gaps(SimpleNamespace(events=lambda: events), steps=2)
    # per step: 3 us copy->a, 10 us a->c (b ends inside a), and 10 us c->next copy once (between the steps)
    assert out["idle_by_pair"][0] == {"after": "a", "before": "c", "us_per_step": 10.0, "per_step": 1.0}
    assert {(p["after"], p["before"]): p["us_per_step"] for p in out["idle_by_pair"]} == {
        ("a", "c"): 10.0, ("c", "Memcpy HtoD"): 5.0, ("Memcpy HtoD", "a"): 3.0}
    assert out["idle_ms"] == round((13 + 13 + 10) / 2 / 1000, 3) and out["copies_ms"] == round(5 / 1000, 3)
    assert out["device_span_ms"] == round(190 / 2 / 1000, 3)


def test_device_gaps_gives_each_kernel_the_span_it_added_when_kernels_overlap():
    """Kernels that overlap (programmatic dependent launch: x starts before w ends): each is given only the time by
    which it moved the timeline's end; the shares and the idle time add up to the span."""
    from types import SimpleNamespace

    cuda = torch.autograd.DeviceType.CUDA

    def ev(start, end, name):
        return SimpleNamespace(device_type=cuda, time_range=SimpleNamespace(start=start, end=end), name=name)

    events = [ev(0, 10, "w"), ev(4, 16, "x"), ev(6, 12, "inside"), ev(20, 30, "w")]
    out = profile_step.device_gaps(SimpleNamespace(events=lambda: events), steps=1)
    shares = {k["name"]: k["us_per_step"] for k in out["span_by_kernel"]}
    assert shares == {"w": 20.0, "x": 6.0}  # "inside" ended before x: it added nothing
    assert sum(shares.values()) + out["idle_ms"] * 1000 == out["device_span_ms"] * 1000 == 30
