"""Triton kernels of a gated delta net's decode step (and of its prefill's conv), over the per-sequence state slots in
place.

- causal_conv1d_update: one token per sequence through the depthwise causal conv1d (SiLU), its history read from
  and shifted in its conv-state slot; causal_conv1d_varlen: the same for a flat batch of sequences of any lengths
  (prefill chunks), in two launches where the reference loops over the sequences;
- gated_delta_rule_update: one token per sequence through the delta rule, the decay and beta computed from the raw
  projections (g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)), q and k L2-normalised, the float32
  recurrent state read and written in its slot (no gather, no scatter).
- gated_rms_norm: the output's RMSNorm(o) * weight * SiLU(z) per value head in one launch, z read in place from
  the input projection's output (torch's version is a dozen launches and a copy of z per layer).

Each reads a row's state from its slot and writes the new state to a destination row, the slot itself unless told
otherwise: a verify step of k + 1 tokens per sequence runs them token by token, each token's state into its own
history row and the last one's into the slot (models/qwen3_5_moe.py), so a rejected draft's state can be undone.

A slot of -1 is a padded row (CUDA graphs): its state is not touched and its output is zeros, so the layers after it
see finite values. The semantics are kernels/gdn.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_update_kernel(x_ptr, w_ptr, state_ptr, slot_ptr, dst_ptr, out_ptr, stride_x, stride_s0, stride_s1,
                        stride_o, channels, K: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs < channels
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if slot < 0:  # a padded row: zeros out, its slot untouched
        tl.store(out_ptr + b * stride_o + offs, tl.zeros([BLOCK_C], dtype=tl.float32).to(out_ptr.dtype.element_ty),
                 mask=mask)
        return
    x = tl.load(x_ptr + b * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    row = state_ptr + slot * stride_s0 + offs * stride_s1
    out_row = state_ptr + tl.load(dst_ptr + b).to(tl.int64) * stride_s0 + offs * stride_s1  # (row itself in place)
    acc = x * tl.load(w_ptr + offs * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(K - 1):  # history oldest first; each step shifts it one place
        h = tl.load(row + j, mask=mask, other=0.0).to(tl.float32)
        acc += h * tl.load(w_ptr + offs * K + j, mask=mask, other=0.0).to(tl.float32)
        if j > 0:
            tl.store(out_row + (j - 1), h.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(out_row + (K - 2), x.to(state_ptr.dtype.element_ty), mask=mask)
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                         dst_slots: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, C] (one token per sequence, rows may be strided), weight [C, K], conv_state [S, C, K-1], slots int [B]:
    each row's history is read from its slot and, shifted, written to its dst_slots row (default: the slot itself,
    in place) -> SiLU(conv) [B, C] in x's dtype, into `out` when given (rows may be strided)."""
    batch, channels = x.shape
    k = weight.shape[1]
    assert k >= 2 and conv_state.stride(2) == 1 and weight.is_contiguous() and x.stride(1) == 1
    out = torch.empty(batch, channels, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == x.shape and out.stride(1) == 1
    block = 256
    _conv_update_kernel[(batch, triton.cdiv(channels, block))](
        x, weight, conv_state, slots, slots if dst_slots is None else dst_slots, out, x.stride(0),
        conv_state.stride(0), conv_state.stride(1), out.stride(0), channels, K=k, BLOCK_C=block)
    return out


@triton.jit
def _conv_varlen_kernel(x_ptr, w_ptr, state_ptr, slot_ptr, qsl_ptr, out_ptr, num_tokens, num_seqs, search_steps,
                        stride_x, stride_s0, stride_s1, stride_o, channels, K: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_C: tl.constexpr):  # fmt: skip
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_t, mask_c = offs_t < num_tokens, offs_c < channels
    lo = tl.zeros([BLOCK_T], dtype=tl.int32)  # each token's sequence, by bisection: qsl[lo] <= t < qsl[hi]
    hi = tl.full([BLOCK_T], num_seqs, dtype=tl.int32)
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        below = tl.load(qsl_ptr + mid) <= offs_t
        lo, hi = tl.where(below, mid, lo), tl.where(below, hi, mid)
    pos = offs_t - tl.load(qsl_ptr + lo)  # within its sequence
    slot = tl.load(slot_ptr + lo, mask=mask_t, other=-1).to(tl.int64)
    live = mask_t & (slot >= 0)
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(K):  # the input `back` places before the token: the step's, else the slot's history
        back = K - 1 - j
        in_x = (pos >= back) & live
        xv = tl.load(x_ptr + (offs_t - back).to(tl.int64)[:, None] * stride_x + offs_c[None, :],
                     mask=in_x[:, None] & mask_c[None, :], other=0.0)
        hv = tl.load(state_ptr + slot[:, None] * stride_s0 + offs_c[None, :] * stride_s1 + (pos + j)[:, None],
                     mask=((pos < back) & live)[:, None] & mask_c[None, :], other=0.0)
        w = tl.load(w_ptr + offs_c * K + j, mask=mask_c, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + hv.to(tl.float32)) * w[None, :]
    y = tl.where(live[:, None], acc / (1.0 + tl.exp(-acc)), 0.0)
    tl.store(out_ptr + offs_t.to(tl.int64)[:, None] * stride_o + offs_c[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask_t[:, None] & mask_c[None, :])


@triton.jit
def _conv_state_kernel(x_ptr, state_ptr, slot_ptr, qsl_ptr, stride_x, stride_s0, stride_s1, channels,
                       K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if slot < 0:
        return
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = tl.arange(0, BLOCK_K)  # the new history's places, oldest first: the sequence's last K - 1 inputs
    start = tl.load(qsl_ptr + b)
    n = tl.load(qsl_ptr + b + 1) - start
    i = n - (K - 1) + m  # the input each place takes, within the sequence (< 0: from the old history)
    mask = (m < K - 1)[:, None] & (offs_c < channels)[None, :]
    row = state_ptr + slot * stride_s0 + offs_c[None, :] * stride_s1
    xv = tl.load(x_ptr + (start + i).to(tl.int64)[:, None] * stride_x + offs_c[None, :],
                 mask=mask & (i >= 0)[:, None], other=0.0)
    hv = tl.load(row + (K - 1 + i)[:, None], mask=mask & (i < 0)[:, None], other=0.0)
    new = tl.where((i >= 0)[:, None], xv.to(state_ptr.dtype.element_ty), hv)
    tl.debug_barrier()  # (every place read before any is written: the old history shifts within the same row)
    tl.store(row + m[:, None], new, mask=mask)


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                         query_start_loc: torch.Tensor) -> torch.Tensor:
    """kernels/gdn.py's causal_conv1d for a flat batch of sequences of any lengths (prefill chunks, decodes), in two
    launches for all of them: x [T, C] (rows may be strided), weight [C, K], conv_state [S, C, K-1], slots int [B]
    (-1: a padded sequence, zeros out, no slot touched), query_start_loc int32 [B + 1] on the device. Each
    sequence continues from its slot's history, which is then replaced by its last K - 1 inputs. -> SiLU(conv)
    [T, C] in x's dtype."""
    tokens, channels = x.shape
    k, seqs = weight.shape[1], slots.shape[0]
    assert k >= 2 and conv_state.stride(2) == 1 and weight.is_contiguous() and x.stride(1) == 1
    out = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
    if tokens == 0 or seqs == 0:
        return out
    block_t, block_c = 32, 128
    _conv_varlen_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(channels, block_c))](
        x, weight, conv_state, slots, query_start_loc, out, tokens, seqs, seqs.bit_length(), x.stride(0),
        conv_state.stride(0), conv_state.stride(1), out.stride(0), channels, K=k, BLOCK_T=block_t, BLOCK_C=block_c)
    block_c = 256  # then the new histories, after every output has read the old ones
    _conv_state_kernel[(seqs, triton.cdiv(channels, block_c))](
        x, conv_state, slots, query_start_loc, x.stride(0), conv_state.stride(0), conv_state.stride(1), channels,
        K=k, BLOCK_K=triton.next_power_of_2(k - 1), BLOCK_C=block_c)
    return out


@triton.jit
def _delta_update_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, slot_ptr, dst_ptr, out_ptr,
                         stride_q, stride_k, stride_v, stride_a, stride_b, stride_o, stride_s0, stride_s1,
                         scale, HV_PER_HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                         BLOCK_V: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, DK)
    mask_v = offs_v < DV
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if slot < 0:
        tl.store(out_ptr + b * stride_o + h * DV + offs_v,
                 tl.zeros([BLOCK_V], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=mask_v)
        return
    hk = h // HV_PER_HK
    q = tl.load(q_ptr + b * stride_q + hk * DK + offs_k).to(tl.float32)
    k = tl.load(k_ptr + b * stride_k + hk * DK + offs_k).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    v = tl.load(v_ptr + b * stride_v + h * DV + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + b * stride_a + h).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32)
    softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
    decay = tl.exp(-tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus)
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + b * stride_b + h).to(tl.float32)))
    tile = state_ptr + slot * stride_s0 + h * stride_s1 + offs_k[:, None] * DV + offs_v[None, :]
    s = tl.load(tile, mask=mask_v[None, :], other=0.0) * decay  # [DK, BLOCK_V]
    recalled = tl.sum(s * k[:, None], 0)
    s += k[:, None] * ((v - recalled) * beta)[None, :]
    dst = tl.load(dst_ptr + b).to(tl.int64)  # (slot itself: in place)
    tl.store(state_ptr + dst * stride_s0 + h * stride_s1 + offs_k[:, None] * DV + offs_v[None, :], s,
             mask=mask_v[None, :])
    o = tl.sum(s * q[:, None], 0)
    tl.store(out_ptr + b * stride_o + h * DV + offs_v, o.to(out_ptr.dtype.element_ty), mask=mask_v)


def gated_delta_rule_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                            A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                            dst_slots: torch.Tensor | None = None, out: torch.Tensor | None = None,
                            block_v: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """One token per sequence: q, k [B, Hk, Dk] and v [B, Hv, Dv] (the conv's output, before the L2 norm), a and b
    [B, Hv] (the raw projections), A_log and dt_bias [Hv]; state [S, Hv, Dk, Dv] float32, each row's read from its
    slot and written to its dst_slots row (default: the slot itself, in place). Returns o [B, Hv, Dv] in v's
    dtype, into `out` when given (rows may be strided). block_v (value columns per program) and num_warps: the
    launch (chosen by the batch / triton's default when None), for bench_kernels' --gdn-tiles sweeps."""
    batch, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    assert state.dtype == torch.float32 and state.stride(3) == 1 and state.stride(2) == dv
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1 and q.stride(1) == k.stride(1) == dk
    assert v.stride(1) == dv and dk & (dk - 1) == 0, "Dk must be a power of two"
    out = torch.empty(batch, hv, dv, dtype=v.dtype, device=v.device) if out is None else out
    assert out.shape == (batch, hv, dv) and out.stride(2) == 1 and out.stride(1) == dv
    # 64 value columns a program from 16 sequences on (fewer, larger programs read the state faster there), 32 below,
    # where 64 leaves too few programs (the sweep: docs/benchmarks.md, Qwen3.5)
    block_v = block_v or min(64 if batch >= 16 else 32, triton.next_power_of_2(dv))
    _delta_update_kernel[(batch, hv, triton.cdiv(dv, block_v))](
        q, k, v, a, b, A_log, dt_bias, state, slots, slots if dst_slots is None else dst_slots, out, q.stride(0),
        k.stride(0), v.stride(0), a.stride(0), b.stride(0), out.stride(0), state.stride(0), state.stride(1), dk**-0.5,
        HV_PER_HK=hv // hk, DK=dk, DV=dv, BLOCK_V=block_v, **({"num_warps": num_warps} if num_warps else {}))
    return out


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, out_ptr, stride_xt, stride_zt, stride_ot, eps, D: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """Program (token, head): kernels/gdn.py's gated_rms_norm over one head's D values, rounded where it rounds
    (the normalised row to the dtype before the weight product, that product, and the result)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + t * stride_xt + h * D + offs, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / D + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gated = (w * normed).to(x.dtype).to(tl.float32)
    z = tl.load(z_ptr + t * stride_zt + h * D + offs, mask=mask, other=0.0).to(tl.float32)
    y = gated * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + t * stride_ot + h * D + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H, D] (each token's heads contiguous), z [T, H * D] (rows may be strided, e.g. a slice of the input
    projection's output), weight [D] -> RMSNorm(x) * weight * SiLU(z) per head, [T, H * D] in x's dtype."""
    t, heads, d = x.shape
    assert x.stride(2) == 1 and x.stride(1) == d and z.shape == (t, heads * d) and z.stride(1) == 1
    out = torch.empty(t, heads * d, dtype=x.dtype, device=x.device)
    if t:
        _gated_rms_norm_kernel[(t, heads)](x, z, weight, out, x.stride(0), z.stride(0), out.stride(0), eps,
                                           D=d, BLOCK_D=triton.next_power_of_2(d))
    return out


def fla_available() -> bool:
    """Whether flash-linear-attention's chunked kernel (the fla-core package) is installed."""
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


_fla_seqlens: tuple | None = None
"""The last step's query_start_loc (on the device and the host) with fla's cu_seqlens made from them (int64, the same
two places): made once per step, so that fla's memos of what it derives from them (chunk indices, uploaded from the
host), which go by the tensors' identity, hit in every layer after the first."""


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, slots: torch.Tensor, query_start_loc: torch.Tensor,
                           query_start_loc_host) -> torch.Tensor:
    """kernels/gdn.py's gated_delta_rule for prefill chunks, by flash-linear-attention's chunked kernel (varlen
    over the flat batch): each sequence starts from its slot's state, and its final state goes back there."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    global _fla_seqlens
    entry = _fla_seqlens
    if entry is None or entry[0] is not query_start_loc or entry[1] is not query_start_loc_host:
        cu_cpu = torch.from_numpy(query_start_loc_host).to(torch.int64)
        entry = (query_start_loc, query_start_loc_host, query_start_loc.to(torch.int64), cu_cpu)
        _fla_seqlens = entry
    cu, cu_cpu = entry[2], entry[3]
    o, final = fla_chunk(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                         initial_state=state.index_select(0, slots), output_final_state=True,
                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu_cpu)
    state.index_copy_(0, slots, final.to(state.dtype))
    return o[0]
