"""Fused MoE experts in triton: two grouped GEMMs over tokens sorted by expert.

In the spirit of vLLM's / SGLang's fused_moe: the slots (token, k-th choice) are grouped by expert and
padded so that every block of BLOCK_M rows belongs to one expert (routing.sort_by_expert); each program
multiplies one such block by one BLOCK_N slice of that expert's weights, so a grouped GEMM over all
experts is a single launch whose grid does not depend on the routing (CUDA-graph friendly).

- pass 1 (gate_up): rows gathered from hidden (token = slot // top_k), the gate and up columns of the
  same tile accumulated side by side, SiLU-and-mul applied in the epilogue; the [rows, I] result is
  written in sorted order, so pass 2 reads it contiguously.
- pass 2 (down): rows read in sorted order, the result scaled by the slot's routing weight in the
  epilogue and scattered to the slot's row of a [T * top_k, H] buffer.
- combine: the k rows of each token summed in float32 and rounded once (one plain reduction launch,
  deterministic, no atomics).

Batches of at most SMALL_BATCH_MAX_TOKENS tokens skip all of this: kernels/moe/triton_experts_small.py computes
them token by token in two launches, with no sorting and the combine inside the down pass.

Rounding follows kernels/moe/torch_ref.py: every value that the reference holds in the activation dtype
is rounded here too. Importing this module imports triton; the dispatch imports it only when chosen.

FP8 experts (`fused_experts_fp8`: DeepSeek-V3's e4m3 weights with float32 block scales, kept as the checkpoint
stores them) run the same kernel in its FP8 mode, as vLLM's fused_moe does with `use_fp8_w8a8` and a
`block_shape`: each pass's input is quantized per row and group of block_k columns (one float32 scale each;
pass 1's per token, pass 2's per sorted row; one triton launch before each pass, kernels/quant/fp8_quant_triton.py), both operands enter
tl.dot as e4m3 with a float32 accumulator, and each K step's partial product is scaled by its rows' group
scales times each column's weight-block scale (one scale load per column and step, so a tile may straddle
weight blocks along N; BLOCK_K divides block_k). w13's scales hold gate's block rows, then up's
(torch_ref.check_fp8_expert_scales has the shapes); the reference is torch_ref.fused_experts_fp8_w8a8.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flotilla import envs
from flotilla.kernels.arrivals import MAX_ARRIVAL_COUNTERS, arrival_counters
from flotilla.kernels.moe import triton_experts_small as small
from flotilla.kernels.moe.routing import ExpertBlocks, sort_by_expert
from flotilla.kernels.moe.torch_ref import check_fp8_expert_scales
from flotilla.kernels.quant.fp8_quant_triton import per_token_group_quantize


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_slots_ptr, block_experts_ptr, num_padded_ptr, weights_ptr,
    num_slots, stride_am, stride_we, stride_wn, stride_om,
    a_scale_ptr, w_scale_ptr, stride_asm, stride_wse, stride_wsn,
    N: tl.constexpr, K: tl.constexpr, TOP_K: tl.constexpr, GATE_UP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr = False, UP_SCALE_ROW: tl.constexpr = 0, BLOCK_SCALE_N: tl.constexpr = 1,
    BLOCK_SCALE_K: tl.constexpr = 1, combined_ptr=None, count_ptr=None, stride_cm=0, COMBINE: tl.constexpr = False,
    SWIGLU_LIMIT: tl.constexpr = 0.0,
):  # fmt: skip
    """One program: rows [pid_m * BLOCK_M, +BLOCK_M) of the sorted slots (one expert) times columns
    [pid_n * BLOCK_N, +BLOCK_N) of that expert's weight [N(, +N for up), K] transposed. With FP8, a and w are
    e4m3, a with one scale per row and BLOCK_SCALE_K columns, w with one per BLOCK_SCALE_N x BLOCK_SCALE_K
    block (up's from block row UP_SCALE_ROW on); the scale arguments are unused otherwise. COMBINE (down pass):
    after writing its slots' weighted rows, a program counts each slot in count_ptr[token, pid_n] (kernels/
    arrivals.py), and for a token whose last slot it wrote, sums the token's TOP_K rows in slot order, in float32,
    into combined_ptr[token] (rounded once, as the separate sum does): the combine without a launch of its own.
    SWIGLU_LIMIT > 0 (gate_up pass): gate clamped to at most it and up to within +-it before silu(gate) * up."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return  # the grid is sized for the worst case; blocks past the real padded length do nothing
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_slots_ptr + rows).to(tl.int64)
    valid = slots < num_slots
    if GATE_UP:
        a_rows = slots // TOP_K  # hidden row of the slot's token
    else:
        a_rows = rows.to(tl.int64)  # pass 1 wrote its output in sorted order
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    if FP8:
        a_scale_ptrs = a_scale_ptr + a_rows * stride_asm
        w_scale_ptrs = w_scale_ptr + expert * stride_wse + (offs_n // BLOCK_SCALE_N) * stride_wsn
        up_scale_ptrs = w_scale_ptr + expert * stride_wse + (UP_SCALE_ROW + offs_n // BLOCK_SCALE_N) * stride_wsn
    # tl.full, not tl.zeros: triton.language's @jit helpers (zeros, cdiv, sigmoid) break the CPU
    # interpreter when triton was imported before TRITON_INTERPRET=1; builtins do not.
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k_tile in range(0, (K + BLOCK_K - 1) // BLOCK_K):
        k_mask = offs_k < K - k_tile * BLOCK_K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP8:  # this K step's activation group and weight block column
            group = (k_tile * BLOCK_K) // BLOCK_SCALE_K
            a_scale = tl.load(a_scale_ptrs + group, mask=valid, other=0.0)
            w_scale = tl.load(w_scale_ptrs + group, mask=n_mask, other=0.0)
            acc += tl.dot(a, w) * a_scale[:, None] * w_scale[None, :]
        else:
            acc += tl.dot(a, w, input_precision=DOT_PRECISION)
        if GATE_UP:  # the up rows sit N rows below the gate rows of the same expert
            w_up = tl.load(w_ptrs + N * stride_wn, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if FP8:
                up_scale = tl.load(up_scale_ptrs + group, mask=n_mask, other=0.0)
                acc_up += tl.dot(a, w_up) * a_scale[:, None] * up_scale[None, :]
            else:
                acc_up += tl.dot(a, w_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    dtype = out_ptr.dtype.element_ty
    if GATE_UP:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        if SWIGLU_LIMIT > 0:
            gate = tl.minimum(gate, SWIGLU_LIMIT)
            up = tl.minimum(tl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, (act * up).to(dtype), mask=n_mask[None, :])
    else:
        weight = tl.load(weights_ptr + slots, mask=valid, other=0.0)
        y = acc.to(dtype).to(tl.float32) * weight[:, None]
        out_ptrs = out_ptr + slots[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, y.to(dtype), mask=valid[:, None] & n_mask[None, :])
        if COMBINE:
            tokens = slots // TOP_K
            counts = count_ptr + tokens * tl.num_programs(1) + pid_n
            tl.debug_barrier()  # every thread's rows stored before the counts publish them
            last = valid & (tl.atomic_add(counts, 1, mask=valid, sem="acq_rel") == TOP_K - 1)
            total = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
            mask = last[:, None] & n_mask[None, :]
            for j in range(TOP_K):  # ".cg": from L2, where the other programs' rows are
                rows_j = out_ptr + (tokens * TOP_K + j)[:, None] * stride_om + offs_n[None, :]
                total += tl.load(rows_j, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(combined_ptr + tokens[:, None] * stride_cm + offs_n[None, :], total.to(dtype), mask=mask)
            tl.atomic_xchg(counts, 0, mask=last)


TILE_KEYS = {"m": "block_m", "n": "block_n", "k": "block_k", "w": "num_warps", "s": "num_stages", "t": "small_tokens",
             "sn": "small_block_n", "sk": "small_block_k", "dn": "small_down_block_n", "dk": "small_down_block_k",
             "dw": "small_down_warps", "ds": "small_down_per_slot", "pn": "down_block_n", "pk": "down_block_k",
             "pw": "down_num_warps", "ps": "down_num_stages"}
"""FLOTILLA_MOE_TILES's short names: e.g. "m=16,n=128,k=128,w=4,s=3" (any subset); t, sn and sk are the
small-batch path's (kernels/moe/triton_experts_small.py): its largest batch (t=0: never) and its tiles; dn, dk and
dw its down pass's own tiles and warps (default: sn, sk and the gate_up pass's warps), ds=1 its down pass with a
program per slot (at one token the default is triton_experts_small.ONE_TOKEN_DOWN; any down tile given replaces
it, "ds=0" for the token-major pass). pn, pk, pw and ps are the sorted
GEMMs' down pass's own tiles, warps and stages (default: n, k, w and s, the gate_up pass's): the two passes' shapes
differ (Qwen3-30B-A3B's experts: N 768 x K 2,048 with gate and up side by side, against N 2,048 x K 768)."""


@functools.cache
def parse_tiles(text: str) -> dict[str, int]:
    """FLOTILLA_MOE_TILES's text -> the expert kernel's keyword arguments (ValueError naming a bad item)."""
    tiles = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if key not in TILE_KEYS or not value.isdigit():
            raise ValueError(f"FLOTILLA_MOE_TILES: {item!r} is not one of {', '.join(k + '=N' for k in TILE_KEYS)}")
        tiles[TILE_KEYS[key]] = int(value)
    return tiles


def env_tiles() -> dict[str, int]:
    """The expert kernel's tiles and launch options forced by FLOTILLA_MOE_TILES (for tuning sweeps,
    bench_kernels --moe-tiles); empty when unset."""
    return parse_tiles(envs.FLOTILLA_MOE_TILES)


def pick_block_m(num_slots: int, num_experts: int) -> int:
    """Rows per block: small when experts get few tokens each (decode), where padding would dominate. (The FP8
    experts' default; the bf16 ones take sorted_tiles.)"""
    per_expert = num_slots / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


SORTED_TILES = (
    (8, dict(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=3)),
    (16, dict(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=2)),
    (32, dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)),
    (None, dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4, down_block_n=256, down_block_k=64)),
)
"""(most slots per expert, tiles) of the bf16 sorted GEMMs, by the batch's mean slots per expert, tuned at
Qwen3-30B-A3B's experts (E=128, top-8) with bench_kernels. A block of rows should hold a whole expert's share where
it can: every extra block of an expert reads its weights again. The choices follow vLLM's tuned H200 configs for
E=128, N=768, with BLOCK_N halved, since each gate_up program here holds gate's and up's columns side by side. The
top tier's down pass takes 256-column tiles (N 2,048 x K 768: the gate_up pass's 128 would be 16 column tiles, each
rereading its rows for a 12-step K loop), faster at prompt-sized batches; the lower tiers measured best with 128."""


def sorted_tiles(num_slots: int, num_experts: int, element_size: int = 2) -> dict[str, int]:
    """The sorted GEMMs' default tiles and launch options for a batch of `num_slots` slots (SORTED_TILES). Wider
    elements (float32 models) get K tiles narrowed in proportion, so that each pipeline stage holds the bytes the
    bf16 tiles were sized for: the top tier's float32 stages would need 288 KiB of shared memory, past an H100's 227."""
    per_expert = num_slots / max(num_experts, 1)
    tiles = next(dict(tiles) for most, tiles in SORTED_TILES if most is None or per_expert <= most)
    for key in ("block_k", "down_block_k"):
        if key in tiles and element_size > 2:
            tiles[key] = max(16, tiles[key] * 2 // element_size)
    return tiles


def _expert_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, blocks: ExpertBlocks,
                 topk_weights: torch.Tensor, top_k: int, gate_up: bool, block_n: int, block_k: int,
                 w_scale: torch.Tensor | None = None, block_size: tuple[int, int] = (1, 1),
                 launch: dict | None = None, combined: torch.Tensor | None = None,
                 swiglu_limit: float = 0.0) -> bool:  # fmt: skip
    """One pass; with w_scale (FP8 weights), a is first quantized per row and block_size[1] group. `combined`
    ([T, H], down pass only): also sum each token's rows into it in the same launch (COMBINE) when the device's
    arrival counters allow; returns whether it did."""
    n = w.shape[1] // 2 if gate_up else w.shape[1]
    k = w.shape[2]
    if a.stride(-1) != 1 or w.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("fused_experts needs a contiguous last dimension in activations and weights")
    dot_precision = "ieee" if a.dtype == torch.float32 else "tf32"
    scales: tuple = (a, w, 0, 0, 0)  # unused without FP8: any pointers
    fp8: dict = {}
    if w_scale is not None:
        a, a_scale = per_token_group_quantize(a, block_size[1])
        w_scale = w_scale.float().contiguous()
        scales = (a_scale, w_scale, a_scale.stride(0), w_scale.stride(0), w_scale.stride(1))
        fp8 = dict(FP8=True, UP_SCALE_ROW=w_scale.shape[1] // 2 if gate_up else 0, BLOCK_SCALE_N=block_size[0],
                   BLOCK_SCALE_K=block_size[1])  # fmt: skip
    grid = (blocks.block_experts.numel(), triton.cdiv(n, block_n))
    counters = None
    if combined is not None and combined.shape[0] * grid[1] <= MAX_ARRIVAL_COUNTERS:
        counters = arrival_counters(out.device)
    combine = {} if counters is None else dict(combined_ptr=combined, count_ptr=counters,
                                                 stride_cm=combined.stride(0), COMBINE=True)  # fmt: skip
    _expert_gemm_kernel[grid](
        a, w, out, blocks.sorted_slots, blocks.block_experts, blocks.num_padded, topk_weights,
        blocks.num_slots, a.stride(0), w.stride(0), w.stride(1), out.stride(0), *scales,
        N=n, K=k, TOP_K=top_k, GATE_UP=gate_up, BLOCK_M=blocks.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision, **fp8, **combine, **(launch or {}),
        **({"SWIGLU_LIMIT": float(swiglu_limit)} if swiglu_limit and gate_up else {}),
    )  # fmt: skip
    return counters is not None


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    masked: bool = False,
    *,
    swiglu_limit: float | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    small_tokens: int | None = None,
    small_block_n: int | None = None,
    small_block_k: int | None = None,
    small_down_block_n: int | None = None,
    small_down_block_k: int | None = None,
    small_down_warps: int | None = None,
    small_down_per_slot: int | None = None,
    down_block_n: int | None = None,
    down_block_k: int | None = None,
    down_num_warps: int | None = None,
    down_num_stages: int | None = None,
) -> torch.Tensor:
    """Same contract as torch_ref.fused_experts: hidden [T, H], w13 [E, 2I, H], w2 [E, H, I],
    topk_weights float32 / topk_ids int [T, k] -> [T, H] in hidden's dtype; `masked`: topk_ids may hold negative
    ids, slots that add nothing; `swiglu_limit`: the clamped SwiGLU (torch_ref.fused_experts). Batches of at most
    `small_tokens` tokens (default triton_experts_small.SMALL_BATCH_MAX_TOKENS; 0: none) take the small-batch path,
    tiled by small_block_n / small_block_k; others the sorted GEMMs, with block sizes of at least 16 (tl.dot's minimum
    on NVIDIA GPUs).
    Tiles and launch options not given come from FLOTILLA_MOE_TILES, else the defaults (sorted_tiles by the batch's
    slots per expert)."""
    t = _tiles(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages,
               small_block_n=small_block_n, small_block_k=small_block_k, small_down_block_n=small_down_block_n,
               small_down_block_k=small_down_block_k, small_down_warps=small_down_warps,
               small_down_per_slot=small_down_per_slot, down_block_n=down_block_n, down_block_k=down_block_k,
               down_num_warps=down_num_warps, down_num_stages=down_num_stages)
    limit = small_tokens if small_tokens is not None else t.get("small_tokens", small.SMALL_BATCH_MAX_TOKENS)
    if 0 < hidden.shape[0] <= limit:
        down = {key: t[f"small_down_{key}"] for key in ("block_n", "block_k", "warps", "per_slot")
                if f"small_down_{key}" in t}
        if hidden.shape[0] == 1 and not down:  # one token: a program per slot (ONE_TOKEN_DOWN; "ds=0" says no)
            down = dict(small.ONE_TOKEN_DOWN)
        return small.fused_experts_small(hidden, w13, w2, topk_weights, topk_ids, t.get("small_block_n"),
                                         t.get("small_block_k"), _launch(t), down=down,
                                         swiglu_limit=swiglu_limit)  # fmt: skip
    t = {**sorted_tiles(topk_ids.numel(), w13.shape[0], hidden.element_size()), **t}
    down = {key: t[f"down_{key}"] for key in ("block_n", "block_k", "num_warps", "num_stages") if f"down_{key}" in t}
    return _two_passes(hidden, w13, w2, topk_weights, topk_ids, t["block_m"], t["block_n"], t["block_k"],
                       launch=_launch(t), masked=masked, down=down, swiglu_limit=swiglu_limit)  # fmt: skip


def _tiles(**given: int | None) -> dict[str, int]:
    """The caller's tiles and launch options over FLOTILLA_MOE_TILES's (None: not given)."""
    return {**env_tiles(), **{k: v for k, v in given.items() if v is not None}}


def _launch(tiles: dict[str, int]) -> dict[str, int]:
    return {k: tiles[k] for k in ("num_warps", "num_stages") if k in tiles}


def _two_passes(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, block_m: int | None, block_n: int, block_k: int,
                scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                block_size: tuple[int, int] = (1, 1), launch: dict | None = None,
                masked: bool = False, combine: bool = True, down: dict | None = None,
                swiglu_limit: float | None = None) -> torch.Tensor:  # fmt: skip
    """Sort, gate_up pass, down pass, combine; `scales` (w13's, w2's) for FP8 weights; `down`: the down pass's own
    block_n, block_k, num_warps and num_stages (any subset; else the gate_up pass's). `masked`: the slots of
    negative ids are in no expert's run, so the down pass never writes their rows: those start at zero.
    Up to SLOT_BLOCKS_MAX_TOKENS tokens (unmasked) each slot is a block of its own (slot_blocks: no sorting launch)
    and the down pass also sums each token's rows (combine=False: the separate sum, which the tests compare it to).
    Never with `masked`: a masked slot is never counted, so its token's last arrival would never come."""
    num_tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    if num_tokens == 0:
        return torch.empty_like(hidden)
    w13_scale, w2_scale = scales if scales is not None else (None, None)
    block_m = block_m or pick_block_m(num_tokens * top_k, num_experts)
    slots = slot_blocks(topk_ids, block_m) if num_tokens <= SLOT_BLOCKS_MAX_TOKENS and not masked else None
    blocks = slots or sort_by_expert(topk_ids, num_experts, block_m, masked)
    combine = combine and slots is not None
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    act = torch.empty(blocks.sorted_slots.numel(), two_i // 2, dtype=hidden.dtype, device=hidden.device)
    _expert_gemm(hidden, w13, act, blocks, weights, top_k, True, block_n, block_k, w13_scale, block_size, launch,
                 swiglu_limit=swiglu_limit or 0.0)
    per_slot = (torch.zeros if masked else torch.empty)(blocks.num_slots, hidden_size, dtype=hidden.dtype,
                                                        device=hidden.device)
    out = torch.empty_like(hidden) if combine else None
    down = down or {}
    down_launch = {**(launch or {}), **{k: down[k] for k in ("num_warps", "num_stages") if k in down}}
    if _expert_gemm(act, w2, per_slot, blocks, weights, top_k, False, down.get("block_n", block_n),
                    down.get("block_k", block_k), w2_scale, block_size, down_launch, combined=out):  # fmt: skip
        return out
    # one reduction launch: torch sums bf16/fp16 in float32 and rounds once, as sum(dtype=float32).to() does in two
    return per_slot.view(num_tokens, top_k, hidden_size).sum(dim=1)


SLOT_BLOCKS_MAX_TOKENS = 4
"""Batches of at most this many tokens run each (token, k) slot as a block of its own (slot_blocks)."""
_slot_rows: dict[tuple[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def slot_blocks(topk_ids: torch.Tensor, block_m: int) -> ExpertBlocks | None:
    """The slots of a tiny batch as blocks of one slot each (its row, then block_m - 1 padding rows): the expert of
    block i is topk_ids.flatten()[i], so nothing needs sorting and no launch runs (at batch 1 the align kernel is a
    noticeable part of each MoE layer). Two slots
    of one expert read its weights twice, which only costs at a few tokens. The row tables depend on the slot count
    alone and are cached per device; None when topk_ids is not contiguous, or during a CUDA graph capture before the
    tables exist."""
    if not topk_ids.is_contiguous():
        return None
    num_slots = topk_ids.numel()
    key = (num_slots, block_m, topk_ids.device)
    rows = _slot_rows.get(key)
    if rows is None:
        if topk_ids.is_cuda and torch.cuda.is_current_stream_capturing():
            return None
        sorted_slots = torch.full((num_slots, block_m), num_slots, dtype=torch.int32, device=topk_ids.device)
        sorted_slots[:, 0] = torch.arange(num_slots, dtype=torch.int32, device=topk_ids.device)
        rows = _slot_rows[key] = (sorted_slots.view(-1), torch.full((1,), num_slots * block_m, dtype=torch.int32,
                                                                        device=topk_ids.device))  # fmt: skip
    return ExpertBlocks(sorted_slots=rows[0], block_experts=topk_ids.view(-1), num_padded=rows[1],
                        num_slots=num_slots, block_m=block_m)


def fused_experts_fp8(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    masked: bool = False,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Same contract as torch_ref.fused_experts_fp8: hidden [T, H] (float), e4m3 w13 [E, 2I, H] / w2 [E, H, I]
    with their float32 block scales, topk_weights float32 / topk_ids int [T, k] -> [T, H] in hidden's dtype,
    computed as torch_ref.fused_experts_fp8_w8a8. block_k (default: the weights' block_k, at most 128) divides
    the weights' block_k, a power of two."""
    check_fp8_expert_scales(w13, w13_scale, w2, w2_scale, block_size)
    t = _tiles(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    bk = block_size[1]
    block_m, block_n = t.get("block_m"), t.get("block_n", 64)
    block_k = t.get("block_k") or min(bk, 128)
    if bk & (bk - 1) or bk % block_k:
        raise ValueError(f"the FP8 expert kernel steps K by {block_k}, which must divide the weights' block_k {bk} "
                         "(a power of two)")  # fmt: skip
    return _two_passes(hidden, w13, w2, topk_weights, topk_ids, block_m, block_n, block_k, (w13_scale, w2_scale),
                       block_size, _launch(t), masked)  # fmt: skip
