"""The triton kernels of kernels/triton compile for an H100/H200 (sm_90) without a GPU: triton's CPU interpreter runs
kernels as numpy and checks little of the language's typing, so each is also compiled, at production shapes, in a
child process without TRITON_INTERPRET (tests/helpers_triton.py). Their numbers are tests/test_kernels_triton.py's."""

from __future__ import annotations

import pytest
from helpers_triton import compile_for_sm90

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")


def _compile_specs() -> list:
    """(module, kernel, pointer element types, float args, constexprs, num_warps) at production shapes:
    bf16 Llama-3-8B heads (GQA 4, head_dim 128), a group of 3, head_dim 256; fp32 for the "ieee" dots."""
    att, fused = "flotilla.kernels.triton.attention", "flotilla.kernels.triton.fused"
    specs: list = []
    for dt, precision in (("bf16", "tf32"), ("fp32", "ieee")):
        paged = {"q_ptr": f"*{dt}", "cache_ptr": f"*{dt}", "out_ptr": f"*{dt}", "qsl_ptr": "*i32",
                 "seq_lens_ptr": "*i32", "bt_ptr": "*i32", "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32"}  # fmt: skip
        # fp32 only for the common shapes: its "ieee" dots take seconds each to compile
        for direct in (True, False) if dt == "bf16" else (False,):
            specs.append((att, "_decode_kernel", paged, ["sm_scale_log2", "v_scale"], dict(
                PAGE_SIZE=16, GROUP=4, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128, DIRECT_OUT=direct, DOT_PRECISION=precision,
            ), 4))  # fmt: skip
        for group, block_d, block_n in ((4, 128, 64), (3, 128, 64), (3, 256, 32)) if dt == "bf16" else ((4, 128, 64),):
            specs.append((att, "_prefill_kernel", paged, ["sm_scale_log2", "v_scale"], dict(
                PAGE_SIZE=16, GROUP=group, BLOCK_Q=64 // group, BLOCK_M=64, BLOCK_N=block_n, BLOCK_D=block_d,
                DOT_PRECISION=precision,
            ), 4))  # fmt: skip
    bf16 = {n: "*bf16" for n in ("key_ptr", "value_ptr", "cache_ptr", "q_ptr", "k_ptr", "v_ptr", "q_out_ptr",
                                 "k_out_ptr", "x_ptr", "res_ptr", "w_ptr", "out_ptr", "res_out_ptr")}  # fmt: skip
    bf16.update(slot_ptr="*i64", pos_ptr="*i64", cos_sin_ptr="*fp32", qsl_ptr="*i32", seq_lens_ptr="*i32", part_o_ptr="*fp32",
                part_lse_ptr="*fp32")  # fmt: skip
    # an FP8 (e4m3) KV cache under bf16 queries: quantizing stores, converting loads
    paged_fp8 = {**paged, "q_ptr": "*bf16", "out_ptr": "*bf16", "cache_ptr": "*fp8e4nv"}
    # with Qwen3-30B-A3B's group of 8
    specs.append((att, "_decode_kernel", paged_fp8, ["sm_scale_log2", "v_scale"], dict(
        PAGE_SIZE=16, GROUP=8, BLOCK_H=16, BLOCK_N=64, BLOCK_D=128, DIRECT_OUT=False, DOT_PRECISION="tf32"), 4))
    specs.append((att, "_prefill_kernel", paged_fp8, ["sm_scale_log2", "v_scale"], dict(
        PAGE_SIZE=16, GROUP=4, BLOCK_Q=16, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, DOT_PRECISION="tf32"), 4))
    fp8 = {**bf16, "cache_ptr": "*fp8e4nv"}
    quant = dict(QUANT=True, FP8_MAX=448.0)
    specs += [
        (att, "_store_kv_kernel", fp8, ["k_scale", "v_scale"], dict(BLOCK_H=8, BLOCK_D=128, **quant), 4),
        (fused, "_rope_kernel", fp8, ["k_scale", "v_scale"],
         dict(STORE_KV=True, BLOCK_HQ=32, BLOCK_HKV=8, BLOCK_HALF=64, **quant), 16),
    ]
    no_quant = dict(QUANT=False, FP8_MAX=448.0)
    specs += [
        (att, "_store_kv_kernel", bf16, ["k_scale", "v_scale"], dict(BLOCK_H=8, BLOCK_D=128, **no_quant), 4),
        (att, "_decode_merge_kernel", bf16, [], dict(BLOCK_S=8, BLOCK_D=128, CHUNK_S=8, BLOCK_N=64), 4),
        (att, "_decode_merge_kernel", bf16, [], dict(BLOCK_S=64, BLOCK_D=512, CHUNK_S=8, BLOCK_N=32), 4),
        (att, "_decode_merge_kernel", bf16, [], dict(BLOCK_S=64, BLOCK_D=128, CHUNK_S=32, BLOCK_N=64), 4),
        (fused, "_rms_norm_kernel", bf16, ["eps"], dict(HAS_RESIDUAL=True, BLOCK=4096), 16),
        (fused, "_rms_norm_kernel", bf16, ["eps"], dict(HAS_RESIDUAL=False, BLOCK=4096), 16),
        (fused, "_silu_and_mul_kernel", bf16, [], dict(BLOCK=1024), 4),
        (fused, "_rope_kernel", bf16, ["k_scale", "v_scale"],
         dict(STORE_KV=True, BLOCK_HQ=32, BLOCK_HKV=8, BLOCK_HALF=64, **no_quant), 16),
        (fused, "_rope_kernel", bf16, ["k_scale", "v_scale"],
         dict(STORE_KV=False, BLOCK_HQ=32, BLOCK_HKV=8, BLOCK_HALF=64, **no_quant), 16),
    ]
    return specs


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    """The interpreter runs kernels as numpy and checks little of the language's typing, so compile each
    kernel for an H100/H200 (sm_90, ptxas bundled with triton) in a child without TRITON_INTERPRET."""
    compile_for_sm90(_compile_specs(), tmp_path)


@pytest.mark.slow
def test_qk_norm_rope_kernel_compiles_for_sm90_without_a_gpu(tmp_path):
    ptrs = {n: "*bf16" for n in ("qkv_ptr", "qw_ptr", "kw_ptr", "q_out_ptr", "cache_ptr")}
    ptrs.update(pos_ptr="*i64", slot_ptr="*i64", cos_sin_ptr="*fp32")
    specs = [("flotilla.kernels.triton.qk_norm_rope", "_qk_norm_rope_store_kernel",
              {**ptrs, "cache_ptr": cache}, ["eps", "k_scale", "v_scale"],
              dict(BLOCK_HQ=hq, BLOCK_HKV=8, BLOCK_HALF=64, QUANT=cache == "*fp8e4nv"), warps)
             for cache in ("*bf16", "*fp8e4nv") for hq, warps in ((16, 8), (32, 8))]
    compile_for_sm90(specs, tmp_path)
