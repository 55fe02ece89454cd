"""The harness of scripts/dev/bench_kernels.py: the sizes every bench runs at, and Bench, which times a point as plain
launches and, for decode-sized points on CUDA, replayed from a CUDA graph, and prints and keeps its JSON records.
The benches themselves are in bench_kernels.py."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

@dataclass(frozen=True)
class Sizes:
    """Every bench's shapes: the real models' on the GPU, tiny ones for --cpu-smoke."""

    moe: tuple[int, int, int, int]  # E, top_k, H, I
    moe_tokens: tuple[int, ...]
    fp8_moe: tuple[int, int, int, int, int, int]  # E, top_k, H, I, groups, topk_groups
    fp8_moe_tokens: tuple[int, ...]
    gemm_shapes: tuple[tuple[str, int, int], ...]  # (name, N, K)
    gemm_m: tuple[int, ...]
    mla: tuple[int, int, int, int]  # heads, kv_lora_rank, rope, block
    mla_batch: tuple[int, ...]
    mla_ctx: int
    routing_tokens: tuple[int, ...]
    gdn: tuple[int, int, int, int] = (16, 32, 128, 128)  # key heads, value heads, Dk, Dv (Qwen3.5-35B-A3B's)
    gdn_batch: tuple[int, ...] = (1, 16, 64, 256)
    gdn_prefill: tuple[tuple[int, int], ...] = ((1, 4096), (8, 512), (1, 16384))  # (sequences, tokens each)


GPU_SIZES = Sizes(
    moe=(128, 8, 2048, 768), moe_tokens=(1, 16, 64, 256, 1024, 4096),
    fp8_moe=(256, 8, 7168, 2048, 8, 4), fp8_moe_tokens=(1, 64, 512, 4096),
    gemm_shapes=(("q_b", 24576, 1536), ("o_proj", 7168, 16384), ("kv_a+q_a", 2112, 7168), ("4096x7168", 4096, 7168),
                 ("dense_gate_up", 36864, 7168), ("dense_down", 7168, 18432)),
    gemm_m=(1, 64, 4096),
    mla=(128, 512, 64, 64), mla_batch=(1, 16, 64, 128), mla_ctx=4096,
    routing_tokens=(1, 256, 1024, 4096),
)  # fmt: skip
QUICK = {"moe_tokens": (1, 64, 1024, 4096), "fp8_moe_tokens": (1, 512), "gemm_m": (1, 64, 4096), "mla_batch": (1, 64)}
SMOKE_SIZES = Sizes(
    moe=(8, 2, 64, 32), moe_tokens=(1, 5),
    fp8_moe=(8, 2, 256, 128, 4, 2), fp8_moe_tokens=(1, 5),
    gemm_shapes=(("tiny", 256, 128),), gemm_m=(1, 3),
    mla=(4, 512, 64, 64), mla_batch=(1, 2), mla_ctx=100,
    routing_tokens=(1, 6), gdn=(2, 4, 16, 16), gdn_batch=(1, 3), gdn_prefill=((1, 70), (3, 9)),
)  # fmt: skip
SMOKE_ALIGNMENT = 16
"""DeepGEMM's row alignment stand-in on CPU (its own is 128)."""


class Bench:
    """Runs the points, times them, prints and keeps the records."""

    def __init__(self, device: torch.device, target_s: float, seed: int, smoke: bool,
                 moe_tiles: list[str] | None = None, fp8_tiles: list[str] | None = None,
                 graph_tokens: int = 0, gemv_tiles: list[str] | None = None,
                 gdn_tiles: list[str] | None = None) -> None:  # fmt: skip
        self.device, self.target_s, self.seed, self.smoke = device, target_s, seed, smoke
        self.gemv_tiles = gemv_tiles or []
        """Extra triton gemv variants, each like "n=8,k=1024,w=8" (BLOCK_N, BLOCK_K, num_warps; any subset)."""
        self.gdn_tiles = gdn_tiles or []
        """Extra triton delta-rule decode variants, each like "v=16,w=4" (BLOCK_V, num_warps; any subset)."""
        self.moe_tiles = moe_tiles or []
        """Extra triton expert-kernel variants, each a FLOTILLA_MOE_TILES string ("m=16,n=128,k=128,w=4,s=3")."""
        self.fp8_tiles = fp8_tiles or []
        """Extra triton FP8 GEMM variants, each a FLOTILLA_FP8_TILES string ("m=16,n=64,sk=4,w=4,s=3")."""
        self.graph_tokens = graph_tokens
        """Points of at most this many tokens are also timed replayed from a CUDA graph (point_modes)."""
        self.capture: Callable[[Callable[[], object]], Callable[[], object]] | None = \
            _capture if device.type == "cuda" else None  # fmt: skip
        """Makes a replayable graph of a function (None: no graphs here, on CPU)."""
        self.records: list[dict] = []

    def emit(self, record: dict) -> None:
        print(json.dumps(record), flush=True)
        self.records.append(record)

    def generator(self) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.seed)

    def measure(self, fn: Callable[[], object]) -> tuple[float, float, int]:
        """(ms per call, ms of the first call, iterations timed)."""
        cuda = self.device.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        first_ms = (time.perf_counter() - t0) * 1e3
        if not cuda:  # the smoke run: plumbing only, two plain calls
            t0 = time.perf_counter()
            for _ in range(2):
                fn()
            return (time.perf_counter() - t0) * 1e3 / 2, first_ms, 2
        from flotilla.scripts.dev.bench_attention import _time  # CUDA events, 3 warm-up calls, us per call

        estimate_us = _time(fn, 3)
        iters = int(min(max(self.target_s * 1e6 / max(estimate_us, 1.0), 5), 20000))
        return _time(fn, iters) / 1e3, first_ms, iters

    def point(self, base: dict, fn: Callable[..., object], *args: object, flops: float = 0, nbytes: float = 0,
              reps: int = 1) -> None:  # fmt: skip
        """Time fn(*args) and emit base + ms (+ tflops from `flops`, gbps from `nbytes`, when given); on an exception
        emit base + error and go on. `reps`: one call of fn does the work that many times (ms is per time)."""
        try:
            ms, first_ms, iters = self.measure(lambda: fn(*args))
            ms /= reps
            record = {**base, "ms": round(ms, 4)}
            if flops:
                record["tflops"] = round(flops / ms / 1e9, 3)
            if nbytes:
                record["gbps"] = round(nbytes / ms / 1e6, 3)
            self.emit({**record, "iters": iters, "first_ms": round(first_ms, 1)})
        except Exception as exc:  # noqa: BLE001 - one failing point must not end the run
            self.emit({**base, "error": f"{type(exc).__name__}: {exc}"[:2000],
                       "where": traceback.format_exc(limit=-3)[-1500:]})  # fmt: skip
            _recover(self.device)


    def point_modes(self, base: dict, tokens: int, fn: Callable[..., object], *args: object, flops: float = 0,
                    nbytes: float = 0) -> None:  # fmt: skip
        """point() as plain launches ("mode": "eager"), and for at most graph_tokens tokens also replayed from a CUDA
        graph ("mode": "graph") holding GRAPH_REPS calls: a decode step runs these kernels inside a graph, where a
        triton launch's ~20-40 us of Python on the host, which eager timing of a small point measures, is gone."""
        self.point({**base, "mode": "eager"}, fn, *args, flops=flops, nbytes=nbytes)
        if self.capture is None or tokens > self.graph_tokens:
            return
        graph = {**base, "mode": "graph", "graph_reps": GRAPH_REPS}
        try:
            replay = self.capture(lambda: [fn(*args) for _ in range(GRAPH_REPS)])
        except Exception as exc:  # noqa: BLE001 - a capture failure is this point's result
            self.emit({**graph, "error": f"capture: {type(exc).__name__}: {exc}"[:2000]})
            _recover(self.device)
            return
        self.point(graph, replay, flops=flops, nbytes=nbytes, reps=GRAPH_REPS)


GRAPH_REPS = 10
"""Calls per captured graph in point_modes: the graph's own launch is shared by them."""


def _recover(device: torch.device) -> None:
    """After a failed point: let pending work finish (a sticky CUDA error shows up in the next points) and free."""
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def _triton_reason(bench: Bench) -> str | None:
    """Why the triton kernels are left out of this run (None: they run)."""
    if bench.smoke:
        return "the CPU smoke run leaves the triton kernels out (tests/test_*triton*.py run them interpreted)"
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


Backends = list[tuple[str, Callable | str]]
"""(backend name, its function, or why it cannot run here)."""


def _runnable(bench: Bench, name: str, backends: Backends) -> Backends:
    """The runnable backends; a skipped line for each other one."""
    keep = []
    for backend, fn in backends:
        if isinstance(fn, str):
            bench.emit({"bench": name, "backend": backend, "skipped": fn})
        else:
            keep.append((backend, fn))
    return keep



def _capture(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured in a CUDA graph (after warm-up calls on a side stream, which compile any triton kernel)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay
