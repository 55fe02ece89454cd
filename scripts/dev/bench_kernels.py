"""Kernel micro-benchmark on the GPU: each backend of flotilla's MoE, FP8 and MLA kernels at real model sizes.

One JSON line per measurement ({"bench", "backend", the point, "ms", metrics, "iters", "first_ms"}), a
{"skipped": reason} line for a backend that cannot run here (once per bench and backend), an {"error": ...} line
for a point that raised (the others go on), an "env" line first and a "summary" line last. Benches (--only):

- moe:      Qwen3-30B-A3B experts (E=128, top_k=8, H=2048, I=768, bf16), triton_experts.fused_experts vs
            deep_gemm_experts.fused_experts over T tokens routed by routing.select_experts on random logits.
            tflops = 2*T*top_k*3*H*I / time; gbps = bytes of the distinct experts hit (3*H*I*2 each) / time.
- fp8_moe:  DeepSeek-V3 experts (E=256, top_k=8, H=7168, I=2048, e4m3 weights, 128x128 float32 block scales,
            grouped routing 8 groups / 4), triton_experts.fused_experts_fp8 vs deep_gemm_experts.fused_experts_fp8;
            gbps counts 3*H*I bytes per distinct expert (scales left out).
- fp8_gemm: dense block-scaled FP8 GEMM at DeepSeek-V3's N x K (q_b 24576x1536, o_proj 7168x16384, kv_a+q_a
            2112x7168, 4096x7168): fp8_triton.fp8_block_linear vs kernels/quant's _deep_gemm_linear (both quantize
            the bf16 activations first, inside the time), and cuBLAS bf16 (torch.matmul on the dequantized weight)
            as the yardstick; tflops = 2*M*N*K / time; gbps = the weight's bytes (N*K in e4m3, 2*N*K in bf16) / time.
- mla:      MLA decode at DeepSeek-V3 sizes (128 heads, kv_lora_rank 512, rope 64, block 64 shuffled, bf16 cache):
            triton_mla.paged_mla_decode vs flash_mla_backend.paged_mla_decode, the latter as every layer but the
            first runs it ("flash_mla": the step's scheduler metadata reused) and as the first layer
            ("flash_mla_first": metadata made in the call); gbps = batch*ctx*576*2 bytes / time.
- gemv:     one-row bf16 linear layers (batch-1 decode) at Qwen3-30B-A3B's attention and router shapes and
            Qwen3-8B's: cuBLAS (F.linear) vs kernels/triton/gemv.py and its --gemv-tiles variants;
            gbps = the weight's 2*N*K bytes / time (a graph's 10 calls reread a weight that fits in L2).
- gdn:      Gated DeltaNet at Qwen3.5-35B-A3B's sizes (16 key / 32 value heads of 128, float32 state [Hv, Dk, Dv]
            in a pool of slots): decode (one token per sequence: triton's gated_delta_rule_update over B sequences,
            gbps = the state's bytes read and written, 2*B*Hv*Dk*Dv*4, plus q, k, v and o) and prefill (fla's
            chunk_gated_delta_rule, with fla-core installed, and the torch chunked reference, over S sequences of
            T tokens); tflops counts the recurrent form's 6*Dk*Dv flops per token and value head (S k, the update,
            S q), so the chunked kernels' rate is an effective one. Also the output's gated RMSNorm ("norm": torch's
            kernels/gdn.gated_rms_norm against triton's one launch, gbps = o, z and out bytes) at the decode batches.
- routing:  routing.select_experts + routing.sort_by_expert at T=1, 256, 1,024 and 4,096 (Qwen3: E=128, top_k=8)
            in their torch versions (routing.*_torch: "torch") or as the engine runs them on CUDA ("fused": the
            one-launch grouping at every size, past the engine's routing.FUSED_ALIGN_MAX_SLOTS too), as plain
            launches ("eager") and replayed from a CUDA graph ("graph").

Timing: the first call is timed alone (first_ms: triton / DeepGEMM JIT compiles land there), then a short run
sizes `iters` so the timed run lasts about --target-s, with CUDA events (bench_attention._time: 3 warm-up calls,
then the mean). A fixed seed makes every run route the same tokens. moe, fp8_moe and fp8_gemm time each point as
plain launches ("mode": "eager") and, up to --graph-tokens tokens, also replayed from a CUDA graph of 10 calls
("mode": "graph", ms per call): a decode step runs them in a graph, and eager timing of a point of a few tens of
microseconds measures the host's launch cost (a triton launch is ~20-40 us of Python) more than the kernel.

    python -m flotilla.scripts.dev.bench_kernels --json /tmp/kernels.json
    python -m flotilla.scripts.dev.bench_kernels --only moe,fp8_moe --quick

--cpu-smoke runs every bench at tiny sizes without CUDA through the torch references and DeepGEMM's expert layouts
over their torch GEMM stand-ins (triton, DeepGEMM's dense GEMM and FlashMLA skipped), to test the plumbing only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator

import numpy as np
import torch

from flotilla.kernels.attention.metadata import AttentionMetadata
from flotilla.kernels.moe.routing import (
    select_experts,
    select_experts_grouped,
    select_experts_torch,
    sort_by_expert,
    sort_by_expert_torch,
)
from flotilla.scripts.dev.kernel_bench import (  # the harness; GRAPH_REPS and Bench are also this module's for tests
    GPU_SIZES,
    GRAPH_REPS,  # noqa: F401 - tests read it here
    QUICK,
    SMOKE_ALIGNMENT,
    SMOKE_SIZES,
    Backends,
    Bench,
    Sizes,
    _capture,
    _recover,
    _runnable,
    _triton_reason,
)

BENCHES = ("moe", "fp8_moe", "fp8_gemm", "mla", "routing", "gemv", "gdn")
GEMV_SHAPES = (("q30_qkv", 5120, 2048), ("q30_o", 2048, 4096), ("q30_router", 128, 2048), ("q8_qkv", 6144, 4096),
               ("q8_o", 4096, 4096), ("q8_gate_up", 24576, 4096), ("q8_down", 4096, 12288))
"""(name, N, K) of bench gemv (on the CPU smoke run only the first, shrunk)."""


# --- moe / fp8_moe -------------------------------------------------------------------------------------------------


def _moe_backends(bench: Bench, fp8: bool) -> Backends:
    from flotilla.kernels.moe import deep_gemm_experts, deep_gemm_usable, torch_ref

    backends: Backends = []
    reason = _triton_reason(bench)
    if reason is None:
        from flotilla.kernels.moe import triton_experts  # imports triton

        fused = triton_experts.fused_experts_fp8 if fp8 else triton_experts.fused_experts
        backends.append(("triton", fused))
        for text in bench.moe_tiles:  # a tuning sweep: the same kernel with other tiles / warps / stages
            tiles = triton_experts.parse_tiles(text)
            backends.append((f"triton[{text}]", lambda *a, fused=fused, tiles=tiles: fused(*a, **tiles)))
    else:
        backends.append(("triton", reason))
    dg_fn = getattr(deep_gemm_experts, "fused_experts_fp8" if fp8 else "fused_experts", None)
    if dg_fn is None:
        backends.append(("deep_gemm", "deep_gemm_experts has no fused_experts_fp8 yet"))
    elif bench.smoke:  # DeepGEMM's layout and combine over the torch stand-in of its grouped GEMM
        gemm = deep_gemm_experts.grouped_fp8_gemm_reference if fp8 else deep_gemm_experts.grouped_gemm_reference
        backends.append(("deep_gemm_layout_ref", lambda *a: dg_fn(*a, gemm=gemm, alignment=SMOKE_ALIGNMENT)))
    elif deep_gemm_usable():
        backends.append(("deep_gemm", dg_fn))
    else:
        backends.append(("deep_gemm", "deep_gemm is not importable or the GPU is older than Hopper"))
    if bench.smoke:
        backends.append(("torch", torch_ref.fused_experts_fp8_w8a8 if fp8 else torch_ref.fused_experts))
    return backends


def _random_fp8(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Random e4m3 values (normal, sd 1), made a slice of the first dim at a time to bound the bf16 scratch."""
    from flotilla.kernels.quant.fp8_ref import FP8_DTYPE

    out = torch.empty(shape, dtype=FP8_DTYPE, device=device)
    step = max(1, (1 << 28) // max(1, math.prod(shape[1:])))
    for i in range(0, shape[0], step):
        chunk = out[i : i + step]
        chunk.copy_(torch.randn(chunk.shape, generator=gen, device=device, dtype=torch.bfloat16).to(FP8_DTYPE))
    return out


def bench_moe(bench: Bench, sizes: Sizes) -> None:
    backends = _runnable(bench, "moe", _moe_backends(bench, fp8=False))
    if not backends:
        return
    e, top_k, h, inter = sizes.moe
    dev, gen = bench.device, bench.generator()
    w13 = (torch.randn(e, 2 * inter, h, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(e, h, inter, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
    for t in sizes.moe_tokens:
        hidden = torch.randn(t, h, generator=gen, device=dev).to(torch.bfloat16)
        weights, ids = select_experts(torch.randn(t, e, generator=gen, device=dev), top_k, True)
        hit = int(torch.unique(ids).numel())
        flops, nbytes = 2 * t * top_k * 3 * h * inter, hit * 3 * h * inter * 2
        for backend, fn in backends:
            bench.point_modes({"bench": "moe", "backend": backend, "E": e, "top_k": top_k, "H": h, "I": inter,
                               "tokens": t, "experts_hit": hit},
                              t, fn, hidden, w13, w2, weights, ids, flops=flops, nbytes=nbytes)  # fmt: skip
    del w13, w2
    _recover(dev)


def bench_fp8_moe(bench: Bench, sizes: Sizes) -> None:
    backends = _runnable(bench, "fp8_moe", _moe_backends(bench, fp8=True))
    if not backends:
        return
    e, top_k, h, inter, groups, topk_groups = sizes.fp8_moe
    block = (128, 128)
    dev, gen = bench.device, bench.generator()
    w13, w2 = _random_fp8((e, 2 * inter, h), gen, dev), _random_fp8((e, h, inter), gen, dev)
    # scales ~ 1e-2 (weights of sd ~0.01): [E, 2I/128, H/128] (gate's rows then up's) and [E, H/128, I/128]
    w13_scale = torch.rand(e, 2 * inter // 128, h // 128, generator=gen, device=dev) * 1e-2 + 5e-3
    w2_scale = torch.rand(e, h // 128, inter // 128, generator=gen, device=dev) * 1e-2 + 5e-3
    for t in sizes.fp8_moe_tokens:
        hidden = torch.randn(t, h, generator=gen, device=dev).to(torch.bfloat16)
        logits = torch.randn(t, e, generator=gen, device=dev)
        weights, ids = select_experts_grouped(logits, top_k, groups, topk_groups, None, True, 2.5)
        hit = int(torch.unique(ids).numel())
        flops, nbytes = 2 * t * top_k * 3 * h * inter, hit * 3 * h * inter
        for backend, fn in backends:
            bench.point_modes({"bench": "fp8_moe", "backend": backend, "E": e, "top_k": top_k, "H": h, "I": inter,
                               "tokens": t, "experts_hit": hit},
                              t, fn, hidden, w13, w13_scale, w2, w2_scale, weights, ids, block, flops=flops,
                              nbytes=nbytes)  # fmt: skip
    del w13, w2
    _recover(dev)


# --- fp8_gemm ------------------------------------------------------------------------------------------------------


def bench_fp8_gemm(bench: Bench, sizes: Sizes) -> None:
    from flotilla.kernels import quant
    from flotilla.kernels.quant import fp8_ref

    candidates: Backends = []
    reason = _triton_reason(bench)
    if reason is None:
        from flotilla.kernels.quant import fp8_triton  # imports triton

        candidates.append(("triton", fp8_triton.fp8_block_linear))
        for text in bench.fp8_tiles:  # a tuning sweep: the same kernel with other tiles / K splits
            tiles = fp8_triton.parse_tiles(text)
            candidates.append((f"triton[{text}]", lambda *a, tiles=tiles: fp8_triton.fp8_block_linear(*a, tiles=tiles)))
    else:
        candidates.append(("triton", reason))
    if bench.smoke:
        candidates.append(("deep_gemm", "needs deep_gemm on a Hopper GPU (no torch stand-in for the dense GEMM)"))
        candidates.append(("torch", fp8_ref.fp8_block_linear_w8a8))
    elif quant.deep_gemm_usable():
        candidates.append(("deep_gemm", quant._deep_gemm_linear))
    else:
        candidates.append(("deep_gemm", "deep_gemm with fp8_gemm_nt is not importable or the GPU is pre-Hopper"))
    backends = _runnable(bench, "fp8_gemm", candidates)
    dev, gen = bench.device, bench.generator()
    for shape, n, k in sizes.gemm_shapes:
        weight = _random_fp8((n, k), gen, dev)
        scale = torch.rand(-(-n // 128), -(-k // 128), generator=gen, device=dev) * 1e-2 + 5e-3
        dense = fp8_ref.block_dequantize(weight, scale, (128, 128), torch.bfloat16)
        for m in sizes.gemm_m:
            x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
            flops = 2 * m * n * k
            base = {"bench": "fp8_gemm", "shape": shape, "N": n, "K": k, "M": m}
            for backend, fn in backends:
                bench.point_modes({**base, "backend": backend}, m, fn, x, weight, scale, None, (128, 128),
                                  flops=flops, nbytes=n * k)  # fmt: skip
            bench.point_modes({**base, "backend": "torch_bf16"}, m, torch.matmul, x, dense.t(), flops=flops,
                              nbytes=2 * n * k)  # fmt: skip
        del weight, dense
    _recover(dev)


# --- gemv ----------------------------------------------------------------------------------------------------------


def bench_gemv(bench: Bench, sizes: Sizes) -> None:
    import torch.nn.functional as F

    candidates: Backends = [("cublas", F.linear)]
    reason = _triton_reason(bench)
    if reason is None:
        from flotilla.kernels.triton import gemv  # imports triton

        candidates.append(("triton", gemv.gemv))
        for text in bench.gemv_tiles:
            tiles = {{"n": "block_n", "k": "block_k", "w": "num_warps"}[key]: int(value)
                     for key, _, value in (item.partition("=") for item in text.split(","))}
            candidates.append((f"triton[{text}]", lambda *a, tiles=tiles: gemv.gemv(*a, **tiles)))
    else:
        candidates.append(("triton", reason))
    backends = _runnable(bench, "gemv", candidates)
    dev, gen = bench.device, bench.generator()
    dtype = torch.float32 if bench.smoke else torch.bfloat16
    shapes = (("tiny", 96, 160),) if bench.smoke else GEMV_SHAPES
    for shape, n, k in shapes:
        weight = (torch.randn(n, k, generator=gen, device=dev) * k**-0.5).to(dtype)
        x = torch.randn(1, k, generator=gen, device=dev).to(dtype)
        for backend, fn in backends:
            bench.point_modes({"bench": "gemv", "shape": shape, "N": n, "K": k, "backend": backend}, 1, fn, x, weight,
                              flops=2 * n * k, nbytes=weight.numel() * weight.element_size())  # fmt: skip
        del weight
    _recover(dev)


# --- mla -----------------------------------------------------------------------------------------------------------


def bench_mla(bench: Bench, sizes: Sizes) -> None:
    from flotilla.kernels.mla import flash_mla_backend as fmb
    from flotilla.kernels.mla import torch_ref

    heads, latent, rope, block = sizes.mla
    candidates: Backends = []
    reason = _triton_reason(bench)
    if reason is None:
        from flotilla.kernels.mla import triton_mla  # imports triton

        candidates.append(("triton", triton_mla.paged_mla_decode))
    else:
        candidates.append(("triton", reason))
    if fmb.flash_mla_usable():
        candidates.append(("flash_mla", fmb.paged_mla_decode))
    else:
        candidates.append(("flash_mla", "flash_mla is not importable or the GPU is not a Hopper"))
    if bench.smoke:
        candidates.append(("torch", torch_ref.paged_mla))
    backends = _runnable(bench, "mla", candidates)
    if not backends:
        return
    dev, gen, ctx = bench.device, bench.generator(), sizes.mla_ctx
    scale = (128 + rope) ** -0.5  # DeepSeek-V3's qk_nope 128 + rope 64 (any value times the same)
    pages = -(-ctx // block)
    rng = np.random.default_rng(bench.seed)
    for batch in sizes.mla_batch:
        num_blocks = batch * pages + 1
        cache = torch.randn(num_blocks, block, latent + rope, generator=gen, device=dev).to(torch.bfloat16)
        tables = rng.permutation(num_blocks - 1)[: batch * pages].reshape(batch, pages)
        meta = AttentionMetadata.from_lists([ctx - 1] * batch, [1] * batch, tables.tolist(), block, device=dev)
        q_latent = torch.randn(batch, heads, latent, generator=gen, device=dev).to(torch.bfloat16)
        q_pe = torch.randn(batch, heads, rope, generator=gen, device=dev).to(torch.bfloat16)
        nbytes = batch * ctx * (latent + rope) * 2
        base = {"bench": "mla", "heads": heads, "batch": batch, "ctx": ctx, "block": block}
        for backend, fn in backends:
            bench.point({**base, "backend": backend}, fn, q_latent, q_pe, cache, meta, scale, nbytes=nbytes)
            if backend == "flash_mla":  # a step's first layer: the scheduler metadata made in the call
                bench.point({**base, "backend": "flash_mla_first"}, _first_layer, fn, q_latent, q_pe, cache, meta,
                            scale, nbytes=nbytes)  # fmt: skip
        del cache
    _recover(dev)


def _first_layer(fn: Callable[..., torch.Tensor], q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float) -> torch.Tensor:  # fmt: skip
    """A step's first MLA layer: no scheduler metadata yet, so the call makes it."""
    meta.backend_state.clear()
    return fn(q_latent, q_pe, cache, meta, scale)


# --- gdn -----------------------------------------------------------------------------------------------------------


def _gdn_decode_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor,
                      slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The torch reference behind triton's gated_delta_rule_update's contract (raw a, b; q, k before the norm)."""
    from flotilla.kernels import gdn

    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    return gdn.gated_delta_rule(q, k, v, g, b.sigmoid(), state, slots, np.arange(q.shape[0] + 1))


def bench_gdn(bench: Bench, sizes: Sizes) -> None:
    from flotilla.kernels import gdn

    hk, hv, dk, dv = sizes.gdn
    decode: Backends = [("torch", _gdn_decode_torch)] if bench.smoke else []
    prefill: Backends = [("torch", gdn.gated_delta_rule)]
    reason = _triton_reason(bench)
    if reason is None:
        from flotilla.kernels.triton import gdn as triton_gdn  # imports triton

        decode.append(("triton", triton_gdn.gated_delta_rule_update))
        for text in bench.gdn_tiles:  # a tuning sweep: the same kernel with other tiles / warps
            tiles = {{"v": "block_v", "w": "num_warps"}[key]: int(value)
                     for key, _, value in (item.partition("=") for item in text.split(","))}
            decode.append((f"triton[{text}]",
                           lambda *a, tiles=tiles: triton_gdn.gated_delta_rule_update(*a, **tiles)))
        if triton_gdn.fla_available():
            prefill.append(("fla", lambda q, k, v, g, beta, state, slots, qsl: triton_gdn.chunk_gated_delta_rule(
                q, k, v, g, beta, state, slots, torch.from_numpy(qsl).to(q.device, torch.int32), qsl)))
        else:
            prefill.append(("fla", "flash-linear-attention (fla-core) is not installed"))
    else:
        decode.append(("triton", reason))
        prefill.append(("fla", reason))
    norms: Backends = [("torch", lambda o, z, w, eps: gdn.gated_rms_norm(o.reshape(-1, o.shape[-1]),
                                                                       z.reshape(-1, o.shape[-1]), w, eps))]
    if reason is None:
        norms.append(("triton", triton_gdn.gated_rms_norm))
    decode, prefill = _runnable(bench, "gdn", decode), _runnable(bench, "gdn", prefill)
    dev, gen = bench.device, bench.generator()
    dtype = torch.float32 if bench.smoke else torch.bfloat16
    A_log = torch.rand(hv, generator=gen, device=dev)
    dt_bias = torch.rand(hv, generator=gen, device=dev)
    flops_per_token = 6 * hv * dk * dv
    for batch in sizes.gdn_batch:
        state = torch.randn(batch, hv, dk, dv, generator=gen, device=dev) * 0.1
        slots = torch.randperm(batch, generator=gen, device=dev)
        q, k = (torch.randn(batch, hk, dk, generator=gen, device=dev).to(dtype) for _ in range(2))
        v = torch.randn(batch, hv, dv, generator=gen, device=dev).to(dtype)
        a, b = (torch.randn(batch, hv, generator=gen, device=dev).to(dtype) for _ in range(2))
        nbytes = 2 * state.numel() * 4 + (q.numel() + k.numel() + 2 * v.numel()) * q.element_size()
        for backend, fn in decode:
            bench.point_modes({"bench": "gdn", "pass": "decode", "batch": batch, "backend": backend}, batch, fn, q, k,
                              v, a, b, A_log, dt_bias, state, slots, flops=batch * flops_per_token, nbytes=nbytes)
        del state
        o = torch.randn(batch, hv, dv, generator=gen, device=dev).to(dtype)
        z = torch.randn(batch, hv * dv + 64, generator=gen, device=dev).to(dtype)[:, 32:32 + hv * dv]  # (strided)
        weight = torch.ones(dv, device=dev, dtype=dtype)
        for backend, fn in norms:
            bench.point_modes({"bench": "gdn", "pass": "norm", "batch": batch, "backend": backend}, batch, fn, o, z,
                              weight, 1e-6, nbytes=3 * o.numel() * o.element_size())
    for seqs, tokens in sizes.gdn_prefill:
        t = seqs * tokens
        state = torch.zeros(seqs, hv, dk, dv, device=dev)
        slots = torch.arange(seqs, device=dev)
        qsl = np.arange(0, t + 1, tokens)
        q, k = (torch.randn(t, hk, dk, generator=gen, device=dev).to(dtype) for _ in range(2))
        v = torch.randn(t, hv, dv, generator=gen, device=dev).to(dtype)
        g = -torch.rand(t, hv, generator=gen, device=dev) * 0.1  # log decay: a state fades slowly, as trained ones do
        beta = torch.rand(t, hv, generator=gen, device=dev).to(dtype)
        for backend, fn in prefill:
            bench.point({"bench": "gdn", "pass": "prefill", "seqs": seqs, "tokens": tokens, "backend": backend}, fn,
                        q, k, v, g, beta, state, slots, qsl, flops=t * flops_per_token)
        del state
    _recover(dev)


# --- routing -------------------------------------------------------------------------------------------------------


def bench_routing(bench: Bench, sizes: Sizes) -> None:
    e, top_k, _, _ = sizes.moe
    dev, gen = bench.device, bench.generator()
    cuda = dev.type == "cuda"
    fused_reason = _triton_reason(bench) if cuda else "off CUDA routing runs torch"
    if fused_reason is not None:
        bench.emit({"bench": "routing", "backend": "fused", "skipped": fused_reason})
    for t in sizes.routing_tokens:
        logits = torch.randn(t, e, generator=gen, device=dev)
        block_m = 16
        if fused_reason is None:
            from flotilla.kernels.moe.triton_experts import pick_block_m  # imports triton

            block_m = pick_block_m(t * top_k, e)

        for backend in ("torch", "fused"):
            if backend == "fused" and fused_reason is not None:
                continue
            base = {"bench": "routing", "backend": backend, "E": e, "top_k": top_k, "tokens": t, "block_m": block_m}
            # "fused" groups every size in one launch, past routing.FUSED_ALIGN_MAX_SLOTS too: the points above it
            # say where that limit belongs
            route = _route if backend == "fused" else _route_torch
            with _align_limit(t * top_k if backend == "fused" else None):
                bench.point({**base, "mode": "eager"}, route, logits, top_k, e, block_m)
                if cuda:
                    try:
                        replay = _capture(lambda: route(logits, top_k, e, block_m))  # noqa: B023 - used at once
                    except Exception as exc:  # noqa: BLE001 - a capture failure is this point's result
                        bench.emit({**base, "mode": "graph", "error": f"capture: {type(exc).__name__}: {exc}"[:2000]})
                        _recover(dev)
                        continue
                    bench.point({**base, "mode": "graph"}, replay)


@contextlib.contextmanager
def _align_limit(slots: int | None) -> Iterator[None]:
    """routing.FUSED_ALIGN_MAX_SLOTS raised to at least `slots` inside (None: left as it is)."""
    from flotilla.kernels.moe import routing

    saved = routing.FUSED_ALIGN_MAX_SLOTS
    if slots is not None:
        routing.FUSED_ALIGN_MAX_SLOTS = max(saved, slots)
    try:
        yield
    finally:
        routing.FUSED_ALIGN_MAX_SLOTS = saved


def _route(logits: torch.Tensor, top_k: int, num_experts: int, block_m: int) -> object:
    """What an MoE layer does before its experts: top-k routing, then the slots grouped by expert."""
    return sort_by_expert(select_experts(logits, top_k, True)[1], num_experts, block_m)


def _route_torch(logits: torch.Tensor, top_k: int, num_experts: int, block_m: int) -> object:
    """_route in the torch versions (about 25 launches on CUDA)."""
    return sort_by_expert_torch(select_experts_torch(logits, top_k, True)[1], num_experts, block_m)


# --- main ----------------------------------------------------------------------------------------------------------

RUNNERS = {"moe": bench_moe, "fp8_moe": bench_fp8_moe, "fp8_gemm": bench_fp8_gemm, "mla": bench_mla,
           "routing": bench_routing, "gemv": bench_gemv, "gdn": bench_gdn}  # fmt: skip


def _env_record(device: torch.device, args: argparse.Namespace) -> dict:
    record = {"bench": "env", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "python": platform.python_version(), "seed": args.seed,
              "target_s": args.target_s, "quick": args.quick, "cpu_smoke": args.cpu_smoke}  # fmt: skip
    for package in ("triton", "deep_gemm", "flash_mla"):
        if importlib.util.find_spec(package) is None:
            record[package] = None
            continue
        try:
            record[package] = getattr(__import__(package), "__version__", "importable")
        except Exception as exc:  # noqa: BLE001 - a broken install is worth reporting, not fatal
            record[package] = f"import fails: {type(exc).__name__}: {exc}"[:300]
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--only", default=",".join(BENCHES),
                   help="benches to run, comma-separated, from: %(default)s")  # fmt: skip
    p.add_argument("--quick", action="store_true",
                   help=f"fewer points ({', '.join(f'{k}={v}' for k, v in QUICK.items())}) and --target-s 0.05 "
                        "unless given")  # fmt: skip
    p.add_argument("--target-s", type=float, default=None,
                   help="seconds each point's timed run lasts, roughly (default 0.2; 0.05 with --quick)")  # fmt: skip
    p.add_argument("--mla-ctx", type=int, default=None,
                   help=f"MLA context length in tokens (default {GPU_SIZES.mla_ctx})")  # fmt: skip
    p.add_argument("--moe-tiles", default="",
                   help="extra triton expert-kernel variants for moe / fp8_moe, ';'-separated, each like "
                        "FLOTILLA_MOE_TILES: m=BLOCK_M,n=BLOCK_N,k=BLOCK_K,w=num_warps,s=num_stages (any subset), "
                        "the sorted down pass's own pn=BLOCK_N,pk=BLOCK_K,pw=num_warps,ps=num_stages, "
                        "and the small-batch path's t=most tokens (0: off),sn=BLOCK_N,sk=BLOCK_K, "
                        "e.g. 'n=128,k=128,s=4;pn=256,pk=64;t=0;sn=8,sk=256'")  # fmt: skip
    p.add_argument("--moe-tokens", default=None,
                   help="moe's batch sizes, comma-separated (default: %s; with --quick %s)" % (
                       ",".join(map(str, GPU_SIZES.moe_tokens)), ",".join(map(str, QUICK["moe_tokens"]))))  # fmt: skip
    p.add_argument("--fp8-moe-tokens", default=None,
                   help="fp8_moe's batch sizes, comma-separated (default: %s; with --quick %s)" % (
                       ",".join(map(str, GPU_SIZES.fp8_moe_tokens)), ",".join(map(str, QUICK["fp8_moe_tokens"]))))  # fmt: skip
    p.add_argument("--fp8-tiles", default="",
                   help="extra triton FP8 GEMM variants for fp8_gemm, ';'-separated, each like FLOTILLA_FP8_TILES: "
                        "m=BLOCK_M,n=BLOCK_N,sk=SPLIT_K,w=num_warps,s=num_stages (any subset), e.g. "
                        "'n=128,sk=1;n=64,sk=4' (the first: the tiles before K was split for small batches)")  # fmt: skip
    p.add_argument("--gemm-m", default=None,
                   help="fp8_gemm's token counts, comma-separated (default: %s)" % ",".join(map(str, GPU_SIZES.gemm_m)))  # fmt: skip
    p.add_argument("--gemv-tiles", default="",
                   help="extra triton gemv variants for gemv, ';'-separated, each like n=BLOCK_N,k=BLOCK_K,w=num_warps "
                        "(any subset), e.g. 'n=4,k=2048;n=16,k=512,w=4'")  # fmt: skip
    p.add_argument("--gdn-tiles", default="",
                   help="extra triton delta-rule decode variants for gdn, ';'-separated, each like v=BLOCK_V,w=num_warps "
                        "(any subset), e.g. 'v=16,w=4;v=64,w=8'")  # fmt: skip
    p.add_argument("--graph-tokens", type=int, default=256,
                   help="moe, fp8_moe and fp8_gemm points of at most this many tokens are also timed replayed from a "
                        "CUDA graph (records with \"mode\": \"graph\"), as decode steps run them; 0: eager only")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, inputs and routing logits")
    p.add_argument("--json", default=None, help="also write every record (a JSON list) to this file")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="tiny sizes on CPU through the torch references (plumbing test, timings meaningless)")  # fmt: skip
    args = p.parse_args(argv)
    only = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = sorted(set(only) - set(BENCHES))
    if unknown:
        p.error(f"unknown bench(es) {', '.join(unknown)}; choices: {', '.join(BENCHES)}")
    if args.target_s is None:
        args.target_s = 0.05 if args.quick else 0.2
    if args.cpu_smoke:
        device, sizes = torch.device("cpu"), SMOKE_SIZES
    elif torch.cuda.is_available():
        device, sizes = torch.device("cuda"), GPU_SIZES
        if args.quick:
            sizes = dataclasses.replace(GPU_SIZES, **QUICK)
    else:
        p.error("no CUDA device here: run on a GPU, or pass --cpu-smoke to test the plumbing at tiny sizes")
    if args.mla_ctx is not None:
        sizes = dataclasses.replace(sizes, mla_ctx=args.mla_ctx)
    if args.gemm_m:
        sizes = dataclasses.replace(sizes, gemm_m=tuple(int(t) for t in args.gemm_m.split(",")))
    if args.moe_tokens:
        sizes = dataclasses.replace(sizes, moe_tokens=tuple(int(t) for t in args.moe_tokens.split(",")))
    if args.fp8_moe_tokens:
        sizes = dataclasses.replace(sizes, fp8_moe_tokens=tuple(int(t) for t in args.fp8_moe_tokens.split(",")))
    torch.manual_seed(args.seed)
    bench = Bench(device, args.target_s, args.seed, args.cpu_smoke,
                  [t.strip() for t in args.moe_tiles.split(";") if t.strip()],
                  [t.strip() for t in args.fp8_tiles.split(";") if t.strip()], args.graph_tokens,
                  [t.strip() for t in args.gemv_tiles.split(";") if t.strip()],
                  [t.strip() for t in args.gdn_tiles.split(";") if t.strip()])  # fmt: skip
    bench.emit(_env_record(device, args))
    t0 = time.perf_counter()
    for name in BENCHES:
        if name not in only:
            continue
        try:
            RUNNERS[name](bench, sizes)
        except Exception as exc:  # noqa: BLE001 - setup failed (allocation, import): the other benches still run
            bench.emit({"bench": name, "error": f"{type(exc).__name__}: {exc}"[:2000],
                        "where": traceback.format_exc(limit=-3)[-1500:]})  # fmt: skip
            _recover(device)
    counts = {kind: sum(kind in r for r in bench.records) for kind in ("ms", "skipped", "error")}
    bench.emit({"bench": "summary", "measured": counts["ms"], "skipped": counts["skipped"], "errors": counts["error"],
                "wall_s": round(time.perf_counter() - t0, 1)})  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(bench.records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
