"""Dynamic FP8 activation quantization in one triton launch: fp8_ref.per_token_group_quantize's contract.

The torch version is ~10 kernels (cast, pad, abs, amax, clamp, two divisions, clamp, cast, copy) in front of
every FP8 GEMM: DeepSeek-V3's dense projections and both passes of its routed experts. Here each program takes
one token's row and BLOCK_G groups of group_size columns as a [BLOCK_G, GROUP] tile: the group's amax, its
scale (amax times float32(1 / 448), amax at least 1e-12), and the e4m3 values (x / scale, clamped to +-448, rounded
to nearest even), with the same float32 operations in the same order as the reference, so the results are
identical on CPU (the division is IEEE round-to-nearest, `div_rn`) and on CUDA, but for the sign of zero: a small
negative value that rounds to zero comes out +0 where torch writes -0, which no GEMM can tell apart (the tests
compare the values as floats).

The scale multiplies amax by the reciprocal of 448 rather than dividing by 448: torch's CUDA kernels turn a division
by a scalar into that multiplication (its CPU ones do not), so the reference does the same and CPU, CUDA and this
kernel agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla.kernels.quant.fp8_ref import _MIN_AMAX, FP8_DTYPE, FP8_MAX, FP8_MAX_INV, num_blocks

BLOCK_G = 4
"""Groups one program quantizes (a [BLOCK_G, group_size] tile of one row)."""


@triton.jit
def _round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3fn value, ties to even, still in float32: the cast
    that follows is then exact on any path (triton's CPU interpreter truncates, and its round-to-nearest-even
    mode drops the carry into the exponent). e4m3 keeps 3 mantissa bits, so a value in [2^e, 2^(e+1)) rounds
    to a multiple of 2^(e-3), and below 2^-6 (subnormals) to a multiple of 2^-9. Adding and subtracting
    1.5 * 2^(step + 23) rounds |v| to a multiple of 2^step in float32's own round-to-nearest-even."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    step = tl.maximum(exponent, -6) - 3
    magic = (((step + 23 + 127) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (tl.abs(v) + magic) - magic
    return tl.where(bits < 0, -rounded, rounded)  # signed; the e4m3 cast still writes a -0 as +0 (docstring)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, K, num_groups, stride_xm, stride_qm, stride_sm,
                  GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_G: tl.constexpr,
                  FP8_MAX: tl.constexpr, FP8_MAX_INV: tl.constexpr, MIN_AMAX: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP_P2)[None, :]
    mask = (groups[:, None] < num_groups) & (tl.arange(0, GROUP_P2)[None, :] < GROUP) & (cols < K)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.maximum(amax, MIN_AMAX) * FP8_MAX_INV
    q = tl.math.div_rn(x, scale[:, None])
    q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
    tl.store(q_ptr + row * stride_qm + cols, _round_to_e4m3(q).to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + groups, scale, mask=groups < num_groups)


def per_token_group_quantize(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (any float dtype, last dim contiguous) -> (e4m3 [..., K], float32 scales [..., ceil(K/group)]),
    one scale per token and group of `group_size` columns, exactly fp8_ref.per_token_group_quantize's."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, groups = x2.shape[0], num_blocks(k, group_size)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m and k:
        _quant_kernel[(m, triton.cdiv(groups, BLOCK_G))](
            x2, q, scales, k, groups, x2.stride(0), q.stride(0), scales.stride(0),
            GROUP=group_size, GROUP_P2=triton.next_power_of_2(group_size), BLOCK_G=BLOCK_G, FP8_MAX=FP8_MAX,
            FP8_MAX_INV=FP8_MAX_INV, MIN_AMAX=_MIN_AMAX,
        )  # fmt: skip
    return q.view(*lead, k), scales.view(*lead, groups)
