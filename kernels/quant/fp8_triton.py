"""A block-scaled FP8 GEMM in triton: y = dequant(x_fp8, x_scales) @ dequant(w_fp8, w_scale_inv)^T.

The activation is quantized per token and group of block_k columns in a launch of its own
(kernels/quant/fp8_quant_triton.py, exactly kernels/quant/fp8_ref.py's values). The kernel tiles the output in
BLOCK_M x BLOCK_N, walks K one weight block (BLOCK_K = block_k) at a time, multiplies the e4m3 tiles on the tensor
cores with a float32 accumulator and scales each partial product by its tokens' group scales times the weight
block's scale before adding it (BLOCK_N divides block_n, so a tile meets one weight block per K step).
Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (set before this module is imported) at tiny sizes.

Few tokens make few output tiles (at batch-1 decode DeepSeek-V3's q_a+kv_a projection, N 2112, is 17 tiles of 128
columns, each streaming all of K alone), so for small M the tiles are 64 columns and K is split (SPLIT_K programs
per tile, each over a contiguous run of K blocks) until there are about two programs per SM; the splits write
float32 partial sums, and the last of a tile's splits to finish adds them up, with the bias, into the output
(pick_tiles; arrivals counted with an atomic per tile, so no second launch). The sum runs in split order, so the
bits are those of the second launch (_split_k_sum_kernel), which `r=0` forces and which runs when there are more
tiles than arrival counters. FLOTILLA_FP8_TILES forces tiles for a sweep (`m=16,n=64,sk=4,w=4,s=3,r=1`, any
subset; scripts/dev/bench_kernels.py --fp8-tiles).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flotilla import envs
from flotilla.kernels.arrivals import MAX_ARRIVAL_COUNTERS, arrival_counters
from flotilla.kernels.quant.fp8_quant_triton import per_token_group_quantize
from flotilla.kernels.quant.fp8_ref import num_blocks


@triton.jit
def _fp8_block_gemm_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, bias_ptr, out_ptr,
    M, N, K: tl.constexpr,
    stride_am, stride_asm, stride_bn, stride_bsn, stride_om,
    BLOCK_SCALE_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr = 1,
    part_ptr=None, count_ptr=None, SUM_IN_KERNEL: tl.constexpr = False,
):  # fmt: skip
    """With SPLIT_K > 1, program (m, n, s) sums K blocks [s * per, (s + 1) * per) and stores float32 partials at
    part_ptr + s * M * N (the bias is the reduction's). Without SUM_IN_KERNEL a second launch
    (_split_k_sum_kernel) adds them into out_ptr; with it, the tile's last program to finish adds them: each
    program counts itself in count_ptr[tile] (an atomic add with release and acquire semantics, so its partials
    are visible before the count and the last one sees everyone's), and the one that counts SPLIT_K sums the
    SPLIT_K partials in split order, exactly as the second launch would, writes the output and sets the count
    back to 0 for the next call (or graph replay)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    scale_row = (pid_n * BLOCK_N) // BLOCK_SCALE_N  # the weight block row this tile lies in
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    K_BLOCKS: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    PER_SPLIT: tl.constexpr = (K_BLOCKS + SPLIT_K - 1) // SPLIT_K
    first = tl.program_id(2) * PER_SPLIT
    for i in range(PER_SPLIT):
        kb = first + i
        k = kb * BLOCK_K + rk
        k_ok = k < K  # (also false in a K block past the end: a split's idle steps)
        a = tl.load(a_ptr + rm[:, None] * stride_am + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + rn[:, None] * stride_bn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        in_k = kb < K_BLOCKS
        a_scale = tl.load(a_scale_ptr + rm * stride_asm + tl.minimum(kb, K_BLOCKS - 1), mask=m_ok, other=0.0)
        a_scale = tl.where(in_k, a_scale, 0.0)
        # a K block past the end (a split's idle steps) scales by 0. No mask mixes a scalar condition in: triton 3.9's
        # CPU interpreter refuses such masks ("mask has unsupported dtype"), so the index is clamped and the value
        # dropped instead
        b_scale = tl.load(b_scale_ptr + scale_row * stride_bsn + tl.minimum(kb, K_BLOCKS - 1))
        b_scale = tl.where(in_k, b_scale, 0.0)
        acc += tl.dot(a, tl.trans(b)) * a_scale[:, None] * b_scale
    if SPLIT_K > 1:
        tile_mask = m_ok[:, None] & n_ok[None, :]
        offs = rm[:, None] * N + rn[None, :]
        tl.store(part_ptr + tl.program_id(2) * M * N + offs, acc, mask=tile_mask)
        if SUM_IN_KERNEL:
            tile = pid_m * tl.num_programs(1) + pid_n
            tl.debug_barrier()  # every thread's partials stored before the count publishes them (CUTLASS's semaphore)
            if tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT_K - 1:  # the last of the tile's splits
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT_K):  # ".cg": from L2, where the other programs' partials are
                    total += tl.load(part_ptr + s * M * N + offs, mask=tile_mask, other=0.0, cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], total.to(out_ptr.dtype.element_ty),
                         mask=tile_mask)  # fmt: skip
                tl.atomic_xchg(count_ptr + tile, 0)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])  # fmt: skip


@triton.jit
def _split_k_sum_kernel(part_ptr, bias_ptr, out_ptr, MN, N, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK: tl.constexpr):  # fmt: skip
    """out = sum over the SPLIT_K float32 partials [SPLIT_K, M, N] (+ bias), in out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


TILE_KEYS = {"m": "block_m", "n": "block_n", "sk": "split_k", "w": "num_warps", "s": "num_stages",
             "r": "sum_in_kernel"}
"""FLOTILLA_FP8_TILES's short names: e.g. "m=16,n=64,sk=4" (any subset); "r=1" (the default) adds a K split's
partials in the GEMM's launch (its last program per tile), "r=0" in a second one."""
_FLAGS = ("r",)
"""The keys that take 0 or 1."""

SMALL_M = 64
"""Up to this many tokens the tiles are 64 columns wide and K may be split (pick_tiles)."""


@functools.cache
def parse_tiles(text: str) -> dict[str, int]:
    """FLOTILLA_FP8_TILES's text -> pick_tiles' overrides (ValueError naming a bad item)."""
    tiles = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key not in TILE_KEYS or not value.isdigit() or int(value) < (0 if key in _FLAGS else 1) \
                or (key in _FLAGS and int(value) > 1):  # fmt: skip
            raise ValueError(f"FLOTILLA_FP8_TILES: {item!r} is not one of "
                             f"{', '.join(k + ('=0|1' if k in _FLAGS else '=N') for k in TILE_KEYS)}")  # fmt: skip
        tiles[TILE_KEYS[key]] = int(value)
    return tiles


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def pick_tiles(m: int, n: int, k: int, block_size: tuple[int, int], num_sms: int,
               forced: dict[str, int] | None = None) -> dict[str, int]:  # fmt: skip
    """block_m / block_n / block_k / split_k (and num_warps / num_stages when forced) for an m x n x k GEMM:
    BLOCK_K is the weight's block_k and BLOCK_N divides block_n. Up to SMALL_M tokens, 64-column tiles and K
    split in up to K-blocks / 4 runs until the programs number about twice the SMs; else 128 columns, no split."""
    bn, bk = block_size
    if bk < 16 or bk & (bk - 1) or bn < 16 or bn & (bn - 1):
        raise ValueError(f"the triton FP8 GEMM needs power-of-two blocks of at least 16, got {bn}x{bk}")
    forced = forced or {}
    block_m = forced.get("block_m") or (16 if m <= 16 else 32 if m <= 32 else 64)
    block_n = forced.get("block_n") or min(bn, 64 if m <= SMALL_M else 128)
    if block_n > bn or bn % block_n:
        raise ValueError(f"FLOTILLA_FP8_TILES: n={block_n} must divide the weight's block rows ({bn})")
    k_blocks = -(-k // bk)
    split_k = forced.get("split_k")
    if split_k is None:
        tiles = -(-m // block_m) * -(-n // block_n)
        split_k = 1 if m > SMALL_M else max(1, min(-(-2 * num_sms // tiles), k_blocks // 4))
    tiles = {"block_m": block_m, "block_n": block_n, "block_k": bk, "split_k": min(split_k, k_blocks),
             "sum_in_kernel": forced.get("sum_in_kernel", 1)}
    return {**tiles, **{key: forced[key] for key in ("num_warps", "num_stages") if key in forced}}


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                     block_size: tuple[int, int] = (128, 128), tiles: dict[str, int] | None = None) -> torch.Tensor:  # fmt: skip
    """y = x W^T (+ b) with x quantized per token group and W's e4m3 blocks, accumulated in float32;
    x [..., K] -> [..., N] in x's dtype. `tiles` (parse_tiles' form) overrides FLOTILLA_FP8_TILES, for sweeps."""
    n, k = weight.shape
    if scale_inv.shape != (num_blocks(n, block_size[0]), num_blocks(k, block_size[1])):
        raise ValueError(f"scale_inv {tuple(scale_inv.shape)} does not fit a [{n}, {k}] weight in "
                         f"{block_size[0]}x{block_size[1]} blocks")  # fmt: skip
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*lead, n)
    weight, scale_inv = weight.contiguous(), scale_inv.float().contiguous()
    forced = tiles if tiles is not None else parse_tiles(envs.FLOTILLA_FP8_TILES)
    t = pick_tiles(m, n, k, block_size, _num_sms(x.device), forced)
    a, a_scale = per_token_group_quantize(x2, block_size[1])
    split_k = t["split_k"]
    launch = {key: t[key] for key in ("num_warps", "num_stages") if key in t}
    grid = (triton.cdiv(m, t["block_m"]), triton.cdiv(n, t["block_n"]), split_k)
    parts = None if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    counts = arrival_counters(x.device) if split_k > 1 and t["sum_in_kernel"] \
        and grid[0] * grid[1] <= MAX_ARRIVAL_COUNTERS else None  # fmt: skip
    _fp8_block_gemm_kernel[grid](
        a, a_scale, weight, scale_inv, bias if bias is not None else out, out,
        m, n, k,
        a.stride(0), a_scale.stride(0), weight.stride(0), scale_inv.stride(0), n,
        BLOCK_SCALE_N=block_size[0], HAS_BIAS=bias is not None,
        BLOCK_M=t["block_m"], BLOCK_N=t["block_n"], BLOCK_K=t["block_k"], SPLIT_K=split_k,
        part_ptr=parts, count_ptr=counts, SUM_IN_KERNEL=counts is not None, **launch,
    )  # fmt: skip
    if parts is not None and counts is None:
        block = 1024
        _split_k_sum_kernel[(triton.cdiv(m * n, block),)](
            parts, bias if bias is not None else out, out, m * n, n,
            SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=block,
        )  # fmt: skip
    return out.view(*lead, n)
