"""Triton paged attention over flotilla's KV layout: the "triton" attention backend.

One KV tensor per layer, [num_blocks, 2, block_size, num_kv_heads, head_dim] (index 0 of dim 1 = K,
1 = V), read through AttentionMetadata exactly as kernels/attention/torch_ref.py reads it; that file is
the oracle these kernels are tested against.

Two attention kernels, chosen by meta.max_query_len (a python int, so choosing costs no device sync):

- decode (every sequence has one new token): flash-decoding. A program owns one (sequence, KV head,
  split of the context); all query heads of the GQA group ride in the M dimension of one tl.dot, so
  each K/V tile is read from HBM once per group instead of once per query head. Long contexts are cut
  into splits so a small batch still fills the GPU, merged by their log-sum-exp in a second kernel
  (_decode_merge_kernel).
- prefill / mixed (any number of new tokens per sequence): flash attention. A program owns one
  (sequence, tile of new tokens, KV head); its M rows are (token, query head of the group) pairs,
  again so K/V is shared by the group. It walks the paged context up to the tile's last causal key.

Both gather K/V token by token through the block table (page = table[pos // block_size]), so a tile
of keys may span several pages or part of one: any block_size works with any tile size (block_size is
a compile-time constant, one per engine, so the page arithmetic is shifts for powers of two). Keys at or
past a sequence's seq_len are masked on load (other=0), so stale or NaN cache memory never enters
the softmax or the V product. Scores use exp2 with the softmax scale folded into log2(e); all
accumulation is float32 whatever the input dtype.

An FP8 (e4m3) cache (kernels/attention/fp8_kv.py) is read as is: K and V tiles are converted on load, k_scale
is folded into the softmax scale and v_scale multiplies the output; the store quantizes (x / scale, clamped
to +-448) in the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flotilla.kernels.attention.fp8_kv import FP8_KV_MAX, is_fp8
from flotilla.kernels.attention.metadata import AttentionMetadata
from flotilla.kernels.triton.pdl import launch_next, pdl_options, wait_prior

_LOG2E = 1.4426950408889634
_MIN_DOT = 16
"""tl.dot needs M, N and K of at least 16 on NVIDIA GPUs (the interpreter accepts less, so the host
code enforces it rather than relying on the tests to catch it)."""
_DECODE_TARGET_PROGRAMS = 512
"""Decode splits the context until batch * kv_heads * splits reaches this (~4 programs per SM of an
H100/H200), so batch-1 long-context decode is not limited to num_kv_heads SMs."""
_DECODE_MIN_TOKENS_PER_SPLIT = 256
"""...but no split gets fewer context tokens than this: tiny splits cost more to merge than they save."""
_DECODE_MAX_SPLITS = 64


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    num_kv_heads, head_dim, block_size, k_scale, v_scale,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """One program per new token: copy its K and V (all heads) into the cache slot, or skip slot -1; QUANT
    (an FP8 cache) stores K / k_scale and V / v_scale clamped to +-FP8_MAX."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_kv_heads) & (offs_d[None, :] < head_dim)
    dst = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
    dst += offs_h[:, None] * stride_ch + offs_d[None, :]
    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if QUANT:
        k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pages(bt_row_ptr, pos, mask, PAGE_SIZE: tl.constexpr):
    """The KV block of each context position pos [N] (0 where masked), from the sequence's block-table row."""
    return tl.load(bt_row_ptr + pos // PAGE_SIZE, mask=mask, other=0).to(tl.int64)


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, cache_ptr, page, pos, load_mask, score_mask,
    offs_d, mask_d, kv_head, sm_scale_log2,
    stride_cb, stride_ckv, stride_cs, stride_ch, PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step of q [M, D] over the keys at context positions pos [N] in blocks page [N]
    (_pages): masks scores by score_mask [M, N], returns (acc, m_i, l_i).
    Callers make every row see at least one key of its first tile (decode: the split's first key;
    prefill: key 0), so the running max is finite from then on and exp2(m_i - m_new) never computes
    -inf - (-inf)."""
    slot_off = page * stride_cb + (pos % PAGE_SIZE).to(tl.int64) * stride_cs + kv_head * stride_ch
    # K is loaded transposed ([D, N]) so the score product needs no in-register transpose.
    k = tl.load(cache_ptr + slot_off[None, :] + offs_d[:, None], mask=mask_d[:, None] & load_mask[None, :], other=0.0)
    qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)
    qk = tl.where(score_mask, qk * sm_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        cache_ptr + stride_ckv + slot_off[:, None] + offs_d[None, :],
        mask=load_mask[:, None] & mask_d[None, :],
        other=0.0,
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _per_split(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Context positions each split of a `seq_len`-token context takes: whole tiles. The decode kernels and
    _decode_merge_kernel compute it alike, so they agree on which splits hold keys."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _split_range(qsl_ptr, seq_lens_ptr, seq, split, num_splits, BLOCK_N: tl.constexpr):
    """A decode program's (query token, first and end context position, whether split 0 holds the whole context)
    for its split of sequence `seq`. Splits are whole tiles, so only the last tile of the last non-empty split is
    partial. With the whole context in split 0 ("single") that split writes the output itself and nothing is
    merged: the same bits as a merge of one split (its float32 partial, weight exp2(0) = 1)."""
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(qsl_ptr + seq).to(tl.int64)
    per_split = _per_split(seq_len, num_splits, BLOCK_N)
    start = split * per_split
    return token, start, tl.minimum(start + per_split, seq_len), seq_len <= per_split


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, out_ptr, part_o_ptr, part_lse_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
    sm_scale_log2, v_scale, num_splits, num_heads, head_dim,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DIRECT_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):  # fmt: skip
    """Program (sequence b, KV head, split): the GQA group's queries over this split's share of the
    context. With one split, or a context that fits in split 0, it writes the output; otherwise a normalized
    partial output and its log2-sum-exp, which _decode_merge_kernel merges."""
    launch_next(USE_GDC)  # kernels/triton/pdl.py: FLOTILLA_PDL
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # the step's metadata (context lengths, block tables) is written before the step's first kernel, by the host or a
    # kernel that finished before this chain began (pdl.py): read before the wait, the first tile's pages too
    token, start, end, single = _split_range(qsl_ptr, seq_lens_ptr, seq, split, num_splits, BLOCK_N)
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    page = _pages(bt_row_ptr, start + offs_n, start + offs_n < end, PAGE_SIZE)
    wait_prior(USE_GDC)

    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_g
    mask_h = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        in_range = pos < end
        ahead = pos + BLOCK_N
        page_ahead = _pages(bt_row_ptr, ahead, ahead < end, PAGE_SIZE)  # the next tile's, a step ahead
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, cache_ptr, page, pos, in_range, in_range[None, :],
            offs_d, mask_d, kv_head, sm_scale_log2,
            stride_cb, stride_ckv, stride_cs, stride_ch, PAGE_SIZE, DOT_PRECISION,
        )  # fmt: skip
        page = page_ahead

    _finish_decode(acc, m_i, l_i, v_scale, out_ptr, part_o_ptr, part_lse_ptr, seq, token, split, heads, mask_h,
                   offs_d, mask_d, head_dim, num_heads, num_splits, stride_ot, stride_oh, single,
                   DIRECT_OUT)  # fmt: skip


@triton.jit
def _finish_decode(
    acc, m_i, l_i, out_scale, out_ptr, part_o_ptr, part_lse_ptr, seq, token, split, heads, mask_h,
    offs_d, mask_d, head_dim, num_heads, num_splits, stride_ot, stride_oh, single, DIRECT_OUT: tl.constexpr,
):  # fmt: skip
    """A decode program's epilogue (GQA and MLA kernels alike): with one split, or a context wholly in split 0
    (`single`, _split_range: then split 0 writes and the others, empty, write nothing, and no merge runs), the
    normalized output of its heads; otherwise the split's normalized partial output and log2-sum-exp, for
    _decode_merge_kernel. An empty split (or a padding sequence with seq_len 0) has l_i == 0: output 0, lse -inf."""
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None] * out_scale
    out_mask = mask_h[:, None] & mask_d[None, :]
    dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    if DIRECT_OUT:
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    elif single:  # the whole context was split 0's
        if split == 0:
            tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # an empty split writes its lse alone: the merge reads no partial output of a split with lse -inf
        row = (seq.to(tl.int64) * num_heads + heads) * num_splits + split  # part_* are [B, Hq, S(, D)]
        tl.store(part_o_ptr + row[:, None] * head_dim + offs_d[None, :], out, mask=out_mask & ~empty[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        tl.store(part_lse_ptr + row, lse, mask=mask_h)


@triton.jit
def _merge_splits(
    part_o_ptr, part_lse_ptr, out_ptr, seq, token, heads, mask_h, offs_d, mask_d, num_splits, num_heads, head_dim,
    stride_ot, stride_oh, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_S: tl.constexpr,
):  # fmt: skip
    """Writes out[token, heads] = the softmax-weighted sum of the heads' split partials (_finish_decode's). Empty
    splits (lse -inf, their partials never written) are not counted: a CUDA graph sizes the splits for the longest
    context it may meet, so at a short one most of them are empty.

    The splits are added one by one in split order, each an elementwise step on [BLOCK_H, BLOCK_D] (a tl.sum over
    the splits would add in an order set by the tile's layout), so the sum does not depend on the chunk or the
    layouts the compiler picks. Filled splits come first (_split_range), so the loop stops after the last filled
    one and loads CHUNK_S splits' partials at a time (merge_chunk), each beside its lse, none of an empty split's;
    loading all splits at once would spill registers at DeepSeek-V3's 512 columns."""
    offs_s = tl.arange(0, BLOCK_S)
    first = (seq.to(tl.int64) * num_heads + heads) * num_splits  # each head's split-0 row of part_*
    lse = tl.load(part_lse_ptr + first[:, None] + offs_s[None, :],
                  mask=mask_h[:, None] & (offs_s < num_splits)[None, :], other=float("-inf"))  # fmt: skip
    lse_max = tl.max(lse, 1)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # all splits empty: weights 0, output 0
    filled_end = tl.max(tl.where(lse != float("-inf"), offs_s[None, :] + 1, 0))  # after the last filled split
    offs_h = tl.arange(0, BLOCK_H)
    acc = tl.full((BLOCK_H, BLOCK_D), 0.0, tl.float32)
    total = tl.full((BLOCK_H,), 0.0, tl.float32)
    for chunk in range(0, (filled_end + CHUNK_S - 1) // CHUNK_S):
        for j in tl.static_range(CHUNK_S):
            s = chunk * CHUNK_S + j
            # past filled_end nothing is loaded: lse -inf, weight 0, partial 0 (a scalar condition enters the masks
            # through a bound: triton 3.9's CPU interpreter refuses masks that mix one in)
            lse_s = tl.load(part_lse_ptr + first + s, mask=mask_h & (offs_h < tl.where(s < filled_end, BLOCK_H, 0)),
                            other=float("-inf"))  # fmt: skip
            part = tl.load(part_o_ptr + (first + s)[:, None] * head_dim + offs_d[None, :],
                           mask=mask_h[:, None] & (offs_d < tl.where(s < filled_end, head_dim, 0))[None, :],
                           other=0.0)  # fmt: skip
            weight = tl.exp2(lse_s - lse_max)
            acc += weight[:, None] * tl.where((lse_s != float("-inf"))[:, None], part, 0.0)
            total += weight
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])  # fmt: skip


@triton.jit
def _decode_merge_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, qsl_ptr, seq_lens_ptr, num_splits, num_heads, head_dim, stride_ot, stride_oh,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_GDC: tl.constexpr = False,
):  # fmt: skip
    """Program (sequence, query head): the head's splits merged (_merge_splits), unless the decode kernel wrote the
    output itself (a context wholly in split 0: BLOCK_N is the decode kernel's, so both see the same splits)."""
    launch_next(USE_GDC)  # kernels/triton/pdl.py: FLOTILLA_PDL
    seq = tl.program_id(0)
    seq_len = tl.load(seq_lens_ptr + seq)  # the step's metadata: before the wait, as in _decode_kernel
    token = tl.load(qsl_ptr + seq).to(tl.int64)
    wait_prior(USE_GDC)  # before any return: the next kernel's wait covers the decode kernel through this one's
    if seq_len <= _per_split(seq_len, num_splits, BLOCK_N):
        return
    one = tl.arange(0, 1)
    offs_d = tl.arange(0, BLOCK_D)
    _merge_splits(part_o_ptr, part_lse_ptr, out_ptr, seq, token, tl.program_id(1) + one, one < 1, offs_d,
                  offs_d < head_dim, num_splits, num_heads, head_dim, stride_ot, stride_oh,
                  1, BLOCK_S, BLOCK_D, CHUNK_S)  # fmt: skip


def merge_chunk(block_s: int, block_d: int) -> int:
    """Splits a merge (_merge_splits) loads per step: a [CHUNK_S, block_d] float32 tile of at most 4,096 values (32
    registers a thread at 4 warps); block_d counts all the merged heads' columns (heads x head_dim)."""
    return max(1, min(block_s, 4096 // block_d))


@triton.jit
def _prefill_kernel(
    q_ptr, cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, bt_ptr,
    sm_scale_log2, v_scale, head_dim,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_cb, stride_ckv, stride_cs, stride_ch,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Program (sequence, tile of BLOCK_Q new tokens, KV head): rows are (token, group head) pairs; the
    keys are the cached context plus the new tokens up to each row's own position (causal)."""
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:  # the grid covers the longest query; shorter ones stop here
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < head_dim
    flat_tok = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + flat_tok[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_valid[:, None] & mask_d[None, :],
        other=0.0,
    )
    q_pos = cached + tok  # absolute position of each row's token: it sees keys at <= q_pos
    kv_end = tl.minimum(seq_len, cached + (q_tile + 1) * BLOCK_Q)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, BLOCK_N)
    for tile_start in range(0, kv_end, BLOCK_N):
        pos = tile_start + offs_n
        in_range = pos < kv_end
        visible = in_range[None, :] & (pos[None, :] <= q_pos[:, None])
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, cache_ptr, _pages(bt_row_ptr, pos, in_range, PAGE_SIZE), pos, in_range, visible,
            offs_d, mask_d, kv_head, sm_scale_log2,
            stride_cb, stride_ckv, stride_cs, stride_ch, PAGE_SIZE, DOT_PRECISION,
        )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None] * v_scale
    dst = out_ptr + flat_tok[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & mask_d[None, :])


def _check_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or kv_cache.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} is not [num_blocks, 2, block_size, {num_kv_heads}, {head_dim}]"
        )
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache needs a contiguous head_dim")


def _kv_scales(kv_cache: torch.Tensor, k_scale: float, v_scale: float) -> tuple[float, float]:
    """The scales the kernels apply: an FP8 cache's, 1.0 (an exact no-op) for any other cache."""
    return (float(k_scale), float(v_scale)) if is_fp8(kv_cache.dtype) else (1.0, 1.0)


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 products (the default TF32 would lose ~3 decimal digits)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(head_dim: int) -> int:
    return max(_MIN_DOT, triton.next_power_of_2(head_dim))


def _default_block_n(head_dim: int) -> int:
    """Keys per tile: 64 up to head_dim 128; 32 beyond, so pipelined K/V tiles still fit shared memory."""
    return 64 if head_dim <= 128 else 32


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write key/value [T, Hkv, D] of the new tokens into kv_cache at slot_mapping [T]; slot -1 (padding)
    is skipped inside the kernel, so there is no boolean-mask gather and no host sync. An FP8 cache gets
    key / k_scale and value / v_scale (as torch_ref.store_kv)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _check_cache(kv_cache, num_kv_heads, head_dim)
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key and value need a contiguous head_dim")
    _store_kv_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        *kv_cache.stride()[:4],
        num_kv_heads, head_dim, kv_cache.shape[2], float(k_scale), float(v_scale),
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        QUANT=is_fp8(kv_cache.dtype), FP8_MAX=FP8_KV_MAX,
    )  # fmt: skip


def _launch_options(num_warps: int | None, num_stages: int | None) -> dict[str, int]:
    return {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}


def _decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Context splits per sequence, a power of two (few distinct merge-kernel compilations)."""
    by_occupancy = triton.cdiv(_DECODE_TARGET_PROGRAMS, max(num_seqs * num_kv_heads, 1))
    by_length = triton.cdiv(max_seq_len, _DECODE_MIN_TOKENS_PER_SPLIT)
    wanted = max(1, min(by_occupancy, by_length, _DECODE_MAX_SPLITS))
    return 1 << (wanted.bit_length() - 1)


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence (meta.max_query_len == 1) over its paged context; query
    [T, Hq, D] -> [T, Hq, D]. Sequence b's token is query row meta.query_start_loc[b], so the rows may be some of a
    larger step's (kernels/attention/mixed_split.py), written into `out` (default: a new tensor like query).
    num_splits (default: sized to fill the GPU) may be fixed, e.g. for a CUDA graph: any value is correct for any
    seq_lens, empty splits drop out of the merge. k_scale and v_scale dequantize an FP8 cache (ignored for any
    other). num_warps / num_stages: the decode kernel's launch (triton's defaults when None), for
    scripts/dev/bench_attention's sweeps."""
    if meta.max_query_len > 1:
        raise ValueError(f"decode attention takes one new token per sequence, not up to {meta.max_query_len}")
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    _check_cache(kv_cache, num_kv_heads, head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    out = torch.empty_like(query) if out is None else out
    num_seqs = meta.num_seqs
    if num_tokens == 0 or num_seqs == 0:
        return out
    if query.stride(-1) != 1:
        raise ValueError("query needs a contiguous head_dim")
    group = num_heads // num_kv_heads
    k_scale, v_scale = _kv_scales(kv_cache, k_scale, v_scale)
    splits = num_splits if num_splits is not None else _decode_num_splits(num_seqs, num_kv_heads, meta.max_seq_len)
    block_d = _block_d(head_dim)
    if splits > 1:
        part_o = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=query.device)
    else:  # unused by the kernel (DIRECT_OUT), but it needs pointers
        part_o = part_lse = out
    block_s = triton.next_power_of_2(splits)
    block_n = max(_MIN_DOT, block_n or _default_block_n(head_dim))
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        query, kv_cache, out, part_o, part_lse, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        scale * k_scale * _LOG2E, v_scale, splits, num_heads, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        *kv_cache.stride()[:4],
        PAGE_SIZE=block_size, GROUP=group, BLOCK_H=max(_MIN_DOT, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=block_d, DIRECT_OUT=splits == 1, DOT_PRECISION=_dot_precision(query.dtype),
        **pdl_options(query.device), **_launch_options(num_warps, num_stages),
    )  # fmt: skip
    if splits > 1:
        _decode_merge_kernel[(num_seqs, num_heads)](
            part_o, part_lse, out, meta.query_start_loc, meta.seq_lens, splits, num_heads, head_dim, out.stride(0),
            out.stride(1), BLOCK_S=block_s, BLOCK_D=block_d, CHUNK_S=merge_chunk(block_s, block_d), BLOCK_N=block_n,
            **pdl_options(query.device),
        )  # fmt: skip
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    block_m: int = 64,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of a mixed batch (prefill chunks over cached prefixes, decodes) over the paged
    cache; query [T, Hq, D] -> [T, Hq, D]. The new tokens' K/V must already be stored (store_kv).
    block_m rows hold block_m // group tokens of all `group` query heads of one KV head. k_scale and
    v_scale dequantize an FP8 cache (ignored for any other)."""
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    _check_cache(kv_cache, num_kv_heads, head_dim)
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    out = torch.empty_like(query)
    if num_tokens == 0 or meta.num_seqs == 0:
        return out
    if query.stride(-1) != 1:
        raise ValueError("query needs a contiguous head_dim")
    group = num_heads // num_kv_heads
    k_scale, v_scale = _kv_scales(kv_cache, k_scale, v_scale)
    block_m = max(_MIN_DOT, block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (meta.num_seqs, triton.cdiv(meta.max_query_len, block_q), num_kv_heads)
    _prefill_kernel[grid](
        query, kv_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        scale * k_scale * _LOG2E, v_scale, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
        *kv_cache.stride()[:4],
        PAGE_SIZE=block_size, GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=max(_MIN_DOT, block_n or _default_block_n(head_dim)),
        BLOCK_D=_block_d(head_dim), DOT_PRECISION=_dot_precision(query.dtype),
    )  # fmt: skip
    return out


def forward(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
            k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """The backend's attention: the decode kernel when every sequence has one new token, else prefill.
    Decided from meta.max_query_len, a python int, so no device sync. Like the torch reference it expects
    the new tokens' K/V already stored; rows of query outside every sequence's range (there are none in
    metadata from AttentionMetadata.from_lists) are left unwritten."""
    if meta.max_query_len == 1:
        return paged_decode_attention(query, kv_cache, meta, scale, k_scale=k_scale, v_scale=v_scale)
    return paged_prefill_attention(query, kv_cache, meta, scale, k_scale=k_scale, v_scale=v_scale)
