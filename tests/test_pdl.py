"""Programmatic dependent launch for the batch-1 kernels (kernels/triton/pdl.py): on by default where the device has
it, off with FLOTILLA_PDL=0; with it, every kernel waits for its predecessor before its first load of anything
another kernel writes, and reads before that wait only weights and the step's metadata (READ_BEFORE_THE_WAIT). Checked
in the TTIR and PTX each kernel compiles to for Hopper (sm_90, in a child process without TRITON_INTERPRET: the
interpreter has no griddepcontrol)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(__import__("importlib").util.find_spec("triton") is None, reason="needs triton")

_DRIVER = r"""
import importlib, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
out = []
for module, name, pointers, floats, constexprs, num_warps in json.loads(sys.argv[1]):
    fn = getattr(importlib.import_module(module), name)
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    signature = {a: "constexpr" if a in constexprs else pointers.get(a, "fp32" if a in floats else "i32")
                 for a in fn.arg_names}
    asm = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": num_warps}).asm
    lines = asm["ptx"].splitlines()
    def first(text):
        return next((i for i, line in enumerate(lines) if text in line), -1)
    # which arguments the loads before the wait read: each tt.load's pointer followed back through its defining ops
    # (addptr, splat, broadcast, ...: their first operand) to a kernel argument, in the TTIR
    defs, before = {}, set()
    for line in asm["ttir"].splitlines():
        if "tt.grid_dependency_wait" in line or "griddepcontrol.wait" in line:  # triton 3.9+ / before: inline asm
            break
        m = re.match(r"\s*(%[\w.]+)(?::\d+)? = ([\w.]+) (%[\w.]+)", line)
        if m:
            defs[m.group(1)] = m.group(3)
            if m.group(2) == "tt.load":
                ptr = m.group(3)
                while ptr in defs:
                    ptr = defs[ptr]
                before.add(ptr.lstrip("%"))
    out.append({"name": name, "wait": first("griddepcontrol.wait"), "launch": first("griddepcontrol.launch_dependents"),
                "load": first("ld.global"), "before_wait": sorted(before)})
print(json.dumps(out))
"""

_BF16 = "*bf16"
_ATT = "flotilla.kernels.triton.attention"
_SPECS = [
    ("flotilla.kernels.triton.gemv", "_gemv_kernel", {"x_ptr": _BF16, "w_ptr": _BF16, "b_ptr": _BF16, "out_ptr": _BF16},
     [], dict(HAS_BIAS=False, BLOCK_N=4, BLOCK_K=2048, ONE_STEP=True), 8),
    ("flotilla.kernels.triton.gemv", "_gemv_kernel", {"x_ptr": _BF16, "w_ptr": _BF16, "b_ptr": _BF16, "out_ptr": _BF16},
     [], dict(HAS_BIAS=False, BLOCK_N=4, BLOCK_K=2048, ONE_STEP=False), 8),
    ("flotilla.kernels.triton.fused", "_rms_norm_kernel",
     {"x_ptr": _BF16, "res_ptr": _BF16, "w_ptr": _BF16, "out_ptr": _BF16, "res_out_ptr": _BF16}, ["eps"],
     dict(HAS_RESIDUAL=True, BLOCK=2048), 8),
    (_ATT, "_decode_kernel", {"q_ptr": _BF16, "cache_ptr": _BF16, "out_ptr": _BF16, "part_o_ptr": "*fp32",
                              "part_lse_ptr": "*fp32", "qsl_ptr": "*i32", "seq_lens_ptr": "*i32",
                              "bt_ptr": "*i32"}, ["sm_scale_log2", "v_scale"],
     dict(PAGE_SIZE=16, GROUP=8, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128, DIRECT_OUT=False, DOT_PRECISION="tf32"), 4),
    ("flotilla.kernels.moe.triton_routing", "_softmax_topk_kernel",
     {"logits_ptr": _BF16, "weights_ptr": "*fp32", "ids_ptr": "*i32"}, [],
     dict(E=128, TOP_K=8, RENORMALIZE=True, BLOCK_T=1, BLOCK_E=128, BLOCK_K=8), 1),
    ("flotilla.kernels.moe.triton_experts_small", "_small_gate_up_kernel",
     {"x_ptr": _BF16, "w_ptr": _BF16, "ids_ptr": "*i32", "out_ptr": _BF16}, [],
     dict(TOP_K=8, BLOCK_N=16, BLOCK_K=128, N=768, K=2048), 8),
    (_ATT, "_decode_merge_kernel", {"part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": _BF16,
                                    "qsl_ptr": "*i32", "seq_lens_ptr": "*i32"}, [],
     dict(BLOCK_S=64, BLOCK_D=128, CHUNK_S=32, BLOCK_N=64), 4),
    ("flotilla.kernels.triton.qk_norm_rope", "_qk_norm_rope_store_kernel",
     {"qkv_ptr": _BF16, "pos_ptr": "*i64", "qw_ptr": _BF16, "kw_ptr": _BF16, "cos_sin_ptr": "*fp32",
      "q_out_ptr": _BF16, "cache_ptr": _BF16, "slot_ptr": "*i64"}, ["eps", "k_scale", "v_scale"],
     dict(BLOCK_HQ=32, BLOCK_HKV=4, BLOCK_HALF=64, QUANT=False), 4),
    ("flotilla.kernels.moe.triton_align", "_align_small_kernel",
     {n: "*i32" for n in ("ids_ptr", "sorted_ptr", "block_experts_ptr", "num_padded_ptr", "cursor_ptr")}, [],
     dict(NUM_EXPERTS=128, E_P2=128, BLOCK_M=32, CHUNK=1024, SLOTS_P2=2048, ROWS_BOUND=8192, BLOCKS_BOUND=256), 8),
]
READ_BEFORE_THE_WAIT = {
    "_gemv_kernel": {"w_ptr"},  # its weight tile, in the one-step form
    "_decode_kernel": {"seq_lens_ptr", "qsl_ptr", "bt_ptr"},  # the step's metadata and the first tile's pages
    "_decode_merge_kernel": {"seq_lens_ptr", "qsl_ptr"},
    "_qk_norm_rope_store_kernel": {"pos_ptr", "cos_sin_ptr", "slot_ptr"},  # positions, their rotary rows, KV slots
}
"""What each kernel reads before its wait (kernels/triton/pdl.py's rules: weights, constant tables and the step's
metadata, never what another kernel of the step writes); the others read nothing before it."""
"""Some of the batch-1 step's triton kernels at Qwen3-30B-A3B's shapes (the others call the same two helpers at the
top of their bodies: the q/k norm + RoPE + store, the decode merge, the small experts' down passes)."""


def test_pdl_is_on_unless_turned_off_and_never_on_a_cpu(monkeypatch):
    from flotilla import envs
    from flotilla.kernels.triton import pdl

    assert pdl.PDL == envs.FLOTILLA_PDL  # (read at import)
    monkeypatch.setattr(pdl, "PDL", False)
    assert pdl.pdl_options(torch.device("cpu")) == {"USE_GDC": False, "launch_pdl": False}
    monkeypatch.setattr(pdl, "PDL", True)
    assert pdl.pdl_options(torch.device("cpu")) == {"USE_GDC": False, "launch_pdl": False}


@pytest.mark.slow
def test_with_pdl_each_kernel_waits_before_its_first_dependent_load(tmp_path):
    """USE_GDC: every kernel lets the next one launch and waits for the one before it, and reads before the wait
    exactly what READ_BEFORE_THE_WAIT names (each load's pointer traced to its argument in the TTIR; the first global
    load in the PTX comes after the wait where nothing is named). Without USE_GDC gemv has neither instruction."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    specs = [(m, n, p, f, {**c, "USE_GDC": True}, w) for m, n, p, f, c, w in _SPECS]
    specs.append((*_SPECS[0][:4], {**_SPECS[0][4], "USE_GDC": False}, _SPECS[0][5]))  # gemv without PDL
    halves = [specs[0::2], specs[1::2]]  # two children: ptxas compiles one kernel at a time
    children = [subprocess.Popen([sys.executable, "-c", _DRIVER, json.dumps(h)], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for h in halves]  # fmt: skip
    found: dict[int, dict] = {}
    for half, child in enumerate(children):
        out, err = child.communicate(timeout=600)
        assert child.returncode == 0, err[-4000:]
        for i, k in enumerate(json.loads(out.strip().splitlines()[-1])):
            found[2 * i + half] = k
    assert found[len(_SPECS)]["wait"] == found[len(_SPECS)]["launch"] == -1, found[len(_SPECS)]
    for i, (_, _, _, _, consts, _) in enumerate(_SPECS):
        k = found[i]
        assert k["wait"] >= 0 and k["launch"] >= 0 and k["load"] >= 0, k
        allowed = READ_BEFORE_THE_WAIT.get(k["name"], set())
        if k["name"] == "_gemv_kernel" and not consts["ONE_STEP"]:
            allowed = set()  # its weights in steps after the wait
        assert set(k["before_wait"]) == allowed, k
        assert (k["load"] < k["wait"]) == bool(allowed), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs CUDA")
@pytest.mark.parametrize("name", ["qwen3_hd64", "qwen3_moe_hd64"])
def test_gpu_engine_with_pdl_gives_the_same_greedy_tokens(name, tmp_path, monkeypatch):
    """Worker processes with FLOTILLA_PDL=1 (decode graphs capture the launches' programmatic edges) give the greedy
    tokens of the same engine without it: PDL changes when kernels start, never what they compute."""
    from helpers_engine import greedy_on_cuda_switched
    from helpers_tiny_models import write_tiny_model, write_tiny_moe_model

    write = write_tiny_moe_model if "moe" in name else write_tiny_model
    model = str(write(tmp_path / name, name))
    outs = greedy_on_cuda_switched(model, "FLOTILLA_PDL", monkeypatch)
    assert outs["1"] == outs["0"]
