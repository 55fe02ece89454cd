"""FLOTILLA_LOG_JIT=1 (kernels/jit_log.py): triton's two JIT hooks give one log line per compiled specialization, with
its constexprs, its specialized arguments, the time it took and the runner's step; hooks already installed still
run. The hooks are called here as triton's JITFunction._call_hook calls them (keywords key, repr, fn, compile,
is_manual_warmup, already_compiled), and installed into triton's real knobs."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest


@pytest.fixture
def jit_log(monkeypatch):
    from triton import knobs

    from flotilla.kernels import jit_log

    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(jit_log, "_installed", False)
    monkeypatch.setattr(jit_log, "context", "")
    return jit_log


def _call(hook, key):
    fn = SimpleNamespace(module="flotilla.kernels.moe.triton_experts", name="_expert_gemm_kernel")
    # as triton 3.6-3.9 pass them: the signature by name in the kernel's order, the constants by argument path
    compile = {"key": key, "signature": {"a_ptr": "*bf16", "num_slots": "i32", "BLOCK_M": "constexpr"},
               "constants": {(2,): 64}, "num_warps": 8, "num_stages": 4}
    return hook(key=key, repr="r", fn=fn, compile=compile, is_manual_warmup=False, already_compiled=False)


def test_each_compile_is_one_line_with_its_specialization_time_and_step(jit_log, caplog):
    from triton import knobs

    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: seen.append(kw["key"]) or False  # someone else's hook
    assert jit_log.install() and jit_log.install()  # (twice: installed once)
    jit_log.context = "step 28: 250 sequences, 8192 tokens"
    with caplog.at_level(logging.WARNING, logger="flotilla.jit"):
        assert _call(knobs.runtime.jit_cache_hook, "k1") is False  # triton compiles
        _call(knobs.runtime.jit_post_compile_hook, "k1")
    assert seen == ["k1"]
    [line] = [r.getMessage() for r in caplog.records if r.name == "flotilla.jit"]
    assert line.startswith("triton JIT ") and " ms (step 28: 250 sequences, 8192 tokens): " in line
    assert "_expert_gemm_kernel(BLOCK_M=64; a_ptr: *bf16, num_slots: i32) warps=8 stages=4" in line
    assert float(line.split()[2]) >= 0


def test_off_unless_asked_for(jit_log, monkeypatch):
    from triton import knobs

    monkeypatch.delenv("FLOTILLA_LOG_JIT", raising=False)
    assert not jit_log.install_from_env()
    assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
    monkeypatch.setenv("FLOTILLA_LOG_JIT", "1")
    assert jit_log.install_from_env() and knobs.runtime.jit_cache_hook is not None
