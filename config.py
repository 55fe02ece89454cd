"""Engine configuration: one small frozen struct per concern, composed by EngineConfig.

Field names follow vLLM's where vLLM has one, so `LLM(max_num_seqs=...)` and `flotilla serve
--max-num-seqs` mean what a vLLM user expects. Every field maps 1:1 to a CLI flag (server/cli.py).
Structs travel to actor processes inside the topology (as JSON), so they hold only plain values.
"""

from __future__ import annotations

from typing import Literal

import msgspec

DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block when CacheConfig.block_size is unset and the attention kernels need no other size."""


class MultimodalLimits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Most media items one prompt may hold, by kind (vLLM's --limit-mm-per-prompt shape)."""

    image: int = 16
    """Images per prompt."""


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Which model, in which dtype, how long a sequence may be."""

    model: str | None = None
    """Hugging Face model folder (config.json + safetensors); default: the embedded SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """Weights and activations: auto (the checkpoint's dtype), float32, bfloat16, float16."""
    max_model_len: int | None = None
    """Longest prompt + output, in tokens; default: the model's, derived as vLLM does (max_position_embeddings, or
    YaRN's original_max_position_embeddings x factor; a longer one is refused)."""
    served_model_name: str | None = None
    """Name clients use in the `model` field; default: the folder name."""
    seed: int = 0
    """Seed for sampling in requests that carry no seed of their own."""
    load_format: Literal["auto", "dummy"] = "auto"
    """auto: read the safetensors; dummy: read only config.json and use random weights (benchmarks at real
    shapes)."""
    skip_tokenizer_init: bool = False
    """Run without a tokenizer: requests must be token ids, outputs are token ids (no text, no stop strings)."""
    chat_template: str | None = None
    """Chat template to render chat requests with instead of the model's: a file, or the Jinja template itself
    (a value with a brace or a newline that names no file); default: the model folder's."""
    limit_mm_per_prompt: MultimodalLimits = MultimodalLimits()
    """Most images one prompt of a model that takes images may hold, as JSON: '{"image": 4}' (more is a 400)."""

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The paged KV cache."""

    block_size: int | None = None
    """Tokens per KV block, a power of two; default: 16, or 64 for an MLA model (DeepSeek-style) on FlashMLA, whose
    kernel pages 64 tokens."""
    kv_cache_blocks: int | None = None
    """Number of KV blocks; default: as many as gpu_memory_utilization (GPU) or cpu_kv_cache_gib (CPU) allows."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory this engine may use (weights + activations + KV) when sizing the KV cache; engines
    sharing one GPU each take their own fraction (e.g. 0.45 each for a prefill and a decode engine)."""
    cpu_kv_cache_gib: float = 1.0
    """KV cache size on CPU, in GiB, when kv_cache_blocks is not given."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes across requests."""
    num_state_snapshots: int | None = None
    """Hybrid models (gated delta nets): recurrent-state snapshots kept for prefix caching (a cached prefix resumes
    only from a snapshot, taken where prompts' cached prefixes end) and, on a disaggregated engine, for the prompts'
    states in transfer; default: max_num_seqs; 0: no prefix caching for such models. Each costs what one running
    sequence's state does."""
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = "auto"
    """KV cache storage: auto (the model's dtype), or fp8 / fp8_e4m3 (e4m3 with per-layer K and V scales, 1.0
    unless calibrated: half the bytes of a 16-bit cache, so twice the tokens, at a small accuracy cost)."""

    def __post_init__(self) -> None:
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_cache_blocks is not None and self.kv_cache_blocks < 2:
            raise ValueError("kv_cache_blocks must be at least 2")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ValueError("num_state_snapshots must be >= 0")


class SpeculativeConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Speculative decoding, as vLLM's `speculative_config` dict: `{"method": "mtp", "num_speculative_tokens": 1}`."""

    method: Literal["mtp"] = "mtp"
    """mtp: the checkpoint's own multi-token-prediction layer (DeepSeek-V3's) drafts the tokens."""
    num_speculative_tokens: int = 1
    """Draft tokens per sequence and step; the one MTP layer runs that many times, each on its own draft."""

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Continuous batching limits and policy."""

    max_num_seqs: int = 256
    """Most sequences in one step (the largest running batch); default: vLLM's for the GPU, 1,024 on one of 70 GiB
    or more other than an A100, else 256 (CPU, and an EngineConfig built directly); 256 for a hybrid model, which
    holds one recurrent-state slot per sequence."""
    max_num_batched_tokens: int = 8192
    """Token budget of one step (prefill chunks + decodes); default: vLLM's, 16,384 for the offline LLM on a GPU of
    70 GiB or more other than an A100 (long prompts in fewer steps), else 8,192 (serving: a longer step is a longer
    gap for the decodes in it)."""
    enable_chunked_prefill: bool = True
    """Split long prompts across steps so decodes keep flowing; off = a prompt runs whole or waits."""
    policy: Literal["fcfs", "priority"] = "fcfs"
    """fcfs: arrival order; priority: lower `priority` first, arrival order among equals."""
    max_waiting_requests: int = 4096
    """Requests queued beyond this are refused (HTTP 429) instead of growing memory without bound."""
    max_steps_in_flight: int = 3
    """Steps planned ahead of their results: 1 waits for each result before planning the next step; 2 plans step
    N+1 while the worker runs step N (vLLM's async scheduling); 3 also hides the round trip result -> scheduler ->
    plan -> launch behind a second step, so the short steps of a small model do not wait for the scheduler."""
    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding, as JSON on the command line (e.g. '{"method": "mtp", "num_speculative_tokens": 1}'):
    decodes verify drafted tokens; a step is planned ahead of the last one's result only as the same decodes again in
    the step CUDA graphs (at most 2 in flight), otherwise once the result is in; default: off."""

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if self.max_steps_in_flight < 1:
            raise ValueError("max_steps_in_flight must be at least 1")

    def length_limit(self, max_model_len: int, kv_tokens: int) -> tuple[int, str | None]:
        """The longest sequence the engine can run and, when that is less than max_model_len, why: no longer than
        the KV cache holds, nor (without chunked prefill) than one step's token budget, which a prompt and any
        recompute after preemption must fit."""
        limits = {f"the KV cache holds {kv_tokens} tokens": kv_tokens}
        if not self.enable_chunked_prefill:
            limits[f"without chunked prefill a step takes {self.max_num_batched_tokens} tokens"] = \
                self.max_num_batched_tokens  # fmt: skip
        why, limit = min(limits.items(), key=lambda kv: kv[1])
        return (limit, why) if limit < max_model_len else (max_model_len, None)


DEVICE_BATCH_OPTIONS = ("max_num_seqs", "max_num_batched_tokens")
"""Options whose default depends on the GPU and on offline or serving use (batch_defaults)."""


def batch_defaults(device_bytes: int, device_name: str, *, offline: bool, hybrid: bool) -> dict[str, int]:
    """max_num_seqs and max_num_batched_tokens as vLLM picks them for a device of `device_bytes` (0: no GPU):
    larger on a GPU of 70 GiB or more other than an A100 (where vLLM measured a large step slower), and, for a
    hybrid model, no more sequences than state slots it can afford."""
    large = device_bytes >= 70 * 2**30 and "a100" not in device_name.lower()
    return {"max_num_seqs": 1024 if large and not hybrid else 256,
            "max_num_batched_tokens": 16384 if large and offline else 8192}


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where and how the model runs."""

    device: str = "auto"
    """Device the model runs on: auto (cuda if available, else cpu), cpu, cuda or cuda:N."""
    attention_backend: str = "auto"
    """Attention kernels: auto picks the fastest usable backend (on CUDA flashinfer_triton where FlashInfer is
    installed and the model is 16-bit, else triton; torch on CPU; for an MLA model flash_mla on Hopper, else triton).
    Force one by name: torch, triton, flashinfer or flashinfer_triton (FlashInfer for prefill, triton's decode kernel
    in CUDA graphs; float16 or bfloat16 models only);
    an MLA model takes torch, triton, flash_mla or flashinfer; sparse attention (DeepSeek-V3.2, GLM-5) and
    DeepSeek-V4 take torch or triton (auto: triton on CUDA)."""
    enforce_eager: bool = False
    """Run every step eagerly, without CUDA graphs (for debugging and profiling)."""
    prefill_cuda_graphs: Literal["auto", "all", "off"] = "auto"
    """CUDA graphs of one sequence's prompt chunk of up to 512 tokens, replayed instead of launched (one rank, no
    speculative decoding; actors/prefill_graphs.py): auto captures them for the MLA attention backends (triton,
    flash_mla), all for the GQA triton and flashinfer_triton backends too, off for none."""
    tp_cuda_graphs: bool = False
    """Capture decode CUDA graphs under tensor parallelism too, the NCCL all-reduces inside them (TP x EP included,
    not the data-parallel expert all-to-all); off by default until validated on two GPUs."""
    ep_cuda_graphs: bool = False
    """Capture decode CUDA graphs under data x expert parallelism with all2all_backend allgather_reducescatter (the
    MoE layers' all-gathers and reduce-scatters inside them); off by default until validated on two GPUs."""
    step_trace: str | None = None
    """Append one JSON line per step to this file (the first rank's worker): its sequences, tokens, and when its plan
    arrived, its launch returned and its results were ready; `python -m flotilla.actors.step_trace FILE` sums it up."""
    fused_ops: Literal["auto", "torch", "triton"] = "auto"
    """Elementwise kernels of each layer (RMSNorm, SiLU-and-mul, RoPE + KV store): auto (triton on CUDA,
    torch elsewhere), triton, or torch (the references)."""
    moe_backend: Literal["auto", "torch", "triton", "deep_gemm"] = "auto"
    """Kernels of a MoE model's experts: auto (triton on CUDA, torch elsewhere), or force one (deep_gemm needs
    deep_gemm and a Hopper GPU); a model without experts refuses a forced one."""
    fp8_backend: Literal["auto", "torch", "triton", "deep_gemm"] = "auto"
    """GEMMs of an FP8 block-scaled checkpoint's linears (DeepSeek-V3's e4m3 weights with 128x128 scales): auto
    (triton on CUDA, torch elsewhere), or force one (deep_gemm: DeepGEMM's fp8_gemm_nt, Hopper only); a model
    without FP8 weights refuses a forced one."""
    image_encoder: Literal["step", "actor", "remote"] = "step"
    """Where a model that takes images runs its vision tower: step (in the first prefill step that holds an image's
    tokens); actor (an encoder actor beside each worker, in its process, decodes and encodes a request's images as
    it arrives, and the scheduler starts its prefill once they are ready); remote (as actor, but the tower runs in a
    vision encoder of its own process, on image_encoder_device, and each worker's encoder actor reads the
    embeddings from it over the KV data plane, kv_transfer_backend dlslime_tcp or local)."""
    image_encoder_device: str | None = None
    """Device of the vision encoder of its own (image_encoder = remote), e.g. cuda:1 for a GPU to itself; default:
    the worker's device."""


class ParallelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one engine's model is spread over devices."""

    tensor_parallel_size: int = 1
    """Worker ranks that each hold a slice of every layer (attention heads, MLP and expert intermediate dims,
    vocabulary) and all-reduce its output; one process per rank, on cuda:RANK with NCCL (gloo on CPU)."""
    data_parallel_size: int = 1
    """Data-parallel ranks, each with its own scheduler, KV cache and workers holding a whole copy of the attention
    and dense layers; each new request goes to the least loaded rank. Rank d uses the GPUs from
    cuda:d*tensor_parallel_size on."""
    enable_expert_parallel: bool = False
    """Spread a MoE model's routed experts, whole, over all data_parallel_size x tensor_parallel_size ranks instead
    of slicing every expert (vLLM's flag). Across data-parallel ranks (wide EP) tokens travel to their experts'
    ranks and back (all2all_backend) and the ranks step in lockstep; across tensor-parallel ranks each rank computes
    its own experts' share and the all-reduce sums them. Attention, dense layers and shared experts are unchanged.
    Needs a MoE model."""
    distributed_executor_backend: Literal["mp", "ray"] = "mp"
    """How the engine's processes are started (vLLM's flag): mp, one local process each; ray, one Ray actor each,
    placed on a Ray cluster (ray_address) with a GPU for each worker; the actors talk over ZeroMQ as with mp. Needs
    the ray extra (pip install 'flotilla[ray]')."""
    ray_address: str | None = None
    """The Ray cluster for distributed_executor_backend ray (e.g. ray://head:10001 or head:6379); default: the
    RAY_ADDRESS of the environment, else a Ray instance started on this machine."""
    ray_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """How an engine's processes spread over the Ray cluster's nodes (its placement group's strategy): PACK, as
    few nodes as fit; STRICT_PACK, one node (a tensor-parallel group on one NVLink domain); SPREAD, STRICT_SPREAD."""
    ranks_share_device: bool = False
    """Every rank of the engine (tensor and data parallel) runs on the one configured GPU, its collectives over gloo
    through host memory, and every step eager: the parallel code paths on a machine with one GPU (slow; for checks,
    not serving). NCCL cannot pair two ranks on one GPU."""
    all2all_backend: Literal["auto", "all_to_all", "allgather_reducescatter"] = "auto"
    """How wide EP (enable_expert_parallel with data_parallel_size > 1) moves tokens to their experts and back
    (vLLM's flag): all_to_all sends each (token, expert) pair to its expert's rank (uneven sizes, read back to the
    host every layer); allgather_reducescatter gathers every rank's tokens on every rank and reduce-scatters the
    results (static shapes, no host sync per layer). auto: all_to_all. Does nothing without data parallelism."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be at least 1")
        if self.data_parallel_size < 1:
            raise ValueError("data_parallel_size must be at least 1")

    @property
    def gathers_tokens(self) -> bool:
        """Whether wide EP runs by all-gather / reduce-scatter (kernels/moe/ep_allgather.py)."""
        return (self.all2all_backend == "allgather_reducescatter" and self.enable_expert_parallel
                and self.data_parallel_size > 1)

    @property
    def expert_parallel_size(self) -> int:
        """Ranks the experts are spread over: tensor_parallel_size x data_parallel_size with
        enable_expert_parallel, else 1."""
        return self.tensor_parallel_size * self.data_parallel_size if self.enable_expert_parallel else 1


class DisaggConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Prefill-decode disaggregation and serving other nodes: the engine's role, how its KV blocks move, and how long
    it serves a front end that went away."""

    role: Literal["both", "prefill", "decode", "encoder"] = "both"
    """Prefill-decode disaggregation role: both runs prompts and generation here; prefill runs prompts, samples the
    first token and hands the prompt's KV to a decode engine; decode pulls that KV and generates; encoder runs only a
    model's vision tower, for the prefills of engines with image_encoder = remote that the router pairs it with."""
    kv_transfer_backend: Literal["dlslime_tcp", "cuda_ipc", "torch_dist", "local"] = "dlslime_tcp"
    """How KV blocks move between engines: dlslime_tcp (one-sided reads over TCP, between processes or hosts; a GPU
    KV cache goes through host staging buffers); cuda_ipc (GPU caches of processes on one host, on one GPU or
    several: device-to-device copies through CUDA IPC); torch_dist (NCCL send/recv straight between GPU KV caches,
    e.g. over NVLink within a host; gloo on CPU); local (both engines in one process: a tensor copy)."""
    kv_host: str = "127.0.0.1"
    """Address the KV data plane serves this engine's blocks on (torch_dist: its rendezvous store and gloo
    sockets); never a wildcard, since dlslime checks no access."""
    kv_transfer_timeout_s: float = 30.0
    """Seconds a KV migration (or the peers' endpoint exchange) may take before its request fails."""
    kv_staging: Literal["auto", "always", "never"] = "auto"
    """Move KV blocks through host staging buffers: auto (when the KV cache is on a GPU and the backend reads host
    memory only, i.e. dlslime_tcp), always (also on CPU, to test the GPU path anywhere), or never."""
    kv_staging_blocks: int = 64
    """Size of a staging buffer in blocks per layer: a migration moves at most this many blocks per round
    (torch_dist: per send)."""

    frontend_grace_s: float = 5.0
    """Another node's front end that routed requests here (a shared registry) and has been unreachable this long has
    its sequences aborted, seconds (a reconnect within it changes nothing)."""

    def __post_init__(self) -> None:
        if self.frontend_grace_s < 0:
            raise ValueError("frontend_grace_s must not be negative")
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError("kv_transfer_timeout_s must be positive")
        if self.kv_transfer_backend in ("torch_dist", "cuda_ipc") and self.kv_staging == "always":
            raise ValueError(f"kv_staging=always does not apply to {self.kv_transfer_backend}: it moves blocks from "
                             "the KV cache's own memory")
        if self.kv_staging_blocks < 1:
            raise ValueError("kv_staging_blocks must be at least 1")


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Everything an engine needs; each actor reads the parts it uses."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    worker: WorkerConfig = WorkerConfig()
    parallel: ParallelConfig = ParallelConfig()
    disagg: DisaggConfig = DisaggConfig()

    @classmethod
    def from_options(cls, **options: object) -> EngineConfig:
        """Build from flat vLLM-style keyword options (`LLM(block_size=8, max_num_seqs=4)`)."""
        parts: dict[str, dict[str, object]] = {part: {} for part in _PARTS}
        owners = {name: part for part, sub in _PARTS.items() for name in sub.__struct_fields__}
        for name, value in options.items():
            if name not in owners:
                known = ", ".join(sorted(owners))
                raise TypeError(f"unknown engine option {name!r}; known options: {known}")
            parts[owners[name]][name] = value
        return cls(**{part: msgspec.convert(values, _PARTS[part]) for part, values in parts.items()})

    def __post_init__(self) -> None:
        if self.worker.image_encoder == "remote" and self.disagg.kv_transfer_backend in ("torch_dist", "cuda_ipc"):
            raise ValueError("image_encoder=remote stages the embeddings in host memory: kv_transfer_backend must be "
                             f"dlslime_tcp or local, not {self.disagg.kv_transfer_backend}")

    def to_dict(self) -> dict:
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, data: dict) -> EngineConfig:
        return msgspec.convert(data, cls)


_PARTS: dict[str, type[msgspec.Struct]] = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "worker": WorkerConfig,
    "parallel": ParallelConfig, "disagg": DisaggConfig,
}
