"""ModelRunner: the compute core of the GPU worker (no sockets): StepPlan in, StepResult out.

It owns the model, the paged KV cache (one allocation, a view per layer) and per-sequence state, so a plan carries
only what changed: new sequences in full, running ones as a token count and appended block ids. The
token a decode step feeds is the one this runner sampled last step, which is why the scheduler can
plan step N+1 before it has seen step N's result.

Under tensor parallelism every rank runs a runner with the same plans; the model's layers all-reduce
between them (models/parallel.py). Rank 0 alone samples and broadcasts the sampled tokens, so every rank
feeds the same tokens to the next step (each keeps them on its device) whatever floating-point noise or
sampler state could otherwise tell the ranks apart; only rank 0's StepResult is sent to the scheduler.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections import deque

import numpy as np
import torch

from flotilla.actors import grammar
from flotilla.actors.cuda_graphs import STATIC_TABLE_BACKENDS, DecodeGraphs, decodes_only, reserve_flashinfer_workspace
from flotilla.actors.encoder import ImageEncoder
from flotilla.actors.grammar import Grammars, SequenceGrammar
from flotilla.actors.pending_step import Patch, PendingStep, add_patch, apply_patch
from flotilla.actors.kv_memory import zeroed_cache
from flotilla.actors.prefill_graphs import PREFILL_GRAPH_TOKENS, PrefillGraphs, prefill_graph_backends
from flotilla.actors.prompt_logprobs import score_prompts
from flotilla.actors.seq_state import SeqState
from flotilla.actors.spec_decode import MTPSpeculator, check_speculative_config
from flotilla.actors.spec_graphs import SpecGraphs
from flotilla.config import DEFAULT_BLOCK_SIZE, EngineConfig
from flotilla.kernels import jit_log
from flotilla.kernels.attention import AttentionMetadata, kv_cache_torch_dtype, positions_from_lists
from flotilla.kernels.comm import through_host
from flotilla.kernels.sampling import SamplerOutput, SamplingTensors, greedy_argmax, sample
from flotilla.kernels.staging import upload
from flotilla.models.context_length import load_max_model_len
from flotilla.models.loader import LoadedModel, load_model
from flotilla.models.model_folder import eos_token_ids, load_tokenizer, model_dir, takes_images
from flotilla.models.parallel import broadcast_from_first, ep_step, init_tensor_parallel, tp_group
from flotilla.sampling_params import SamplingParams
from flotilla.transport.messages import NewSequence, StepPlan, StepResult

log = logging.getLogger(__name__)

KV_FREE_MARGIN_BYTES = 256 << 20
"""Memory the KV cache leaves free on the GPU beyond its share: later allocations outside the profiling run (CUDA
graphs' pools, NCCL's buffers) take theirs from it."""


def resolve_device(name: str, rank: int | None = None) -> torch.device:
    """The device `name` means; with a tensor-parallel `rank`, that rank's GPU (the first one + rank)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if rank is not None and device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


class ModelRunner:
    """Loads the model, sizes and allocates the KV cache, executes plans."""

    def __init__(self, config: EngineConfig, progress: bool = True, rank: int = 0,
                 dist_init_method: str | None = None, per_rank_device: bool = True) -> None:
        """rank, dist_init_method: this runner's tensor-parallel rank and the group's rendezvous (tcp://host:port),
        needed when config.parallel.tensor_parallel_size > 1. per_rank_device: rank r runs on the configured GPU +
        r (False: on the configured device itself, as a Ray actor that sees only its own GPU does)."""
        self.config = config
        self.rank = rank
        self.tp_size = config.parallel.tensor_parallel_size
        self._log_jit = jit_log.install_from_env()  # FLOTILLA_LOG_JIT=1: a line per triton compile, with its step
        jit_log.context = "engine start"
        shared = config.parallel.ranks_share_device
        self.device = resolve_device(config.worker.device,
                                     rank if self.tp_size > 1 and per_rank_device and not shared else None)
        if self.device.type == "cuda" and self.device.index is not None:
            # this thread's current device: triton launches on it, so a worker on cuda:1 (an engine of a fleet, a TP
            # rank) must not leave it at cuda:0 ("Pointer argument cannot be accessed from Triton"); plain "cuda" is
            # the current device already (set_device refuses a device without an index)
            torch.cuda.set_device(self.device)
        if self.tp_size > 1 and tp_group().size == 1:  # (joined already under DP x TP x EP: a sub-group)
            if dist_init_method is None:
                raise ValueError("tensor_parallel_size > 1 needs the ranks' rendezvous address (dist_init_method)")
            if self.device.type != "cuda":  # the ranks share the host's cores; more threads than cores would thrash
                ranks = self.tp_size * config.parallel.data_parallel_size
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
            init_tensor_parallel(rank, self.tp_size, dist_init_method, self.device, share_device=shared)
        elif self.tp_size > 1 and (tp_group().size, tp_group().rank) != (self.tp_size, rank):
            raise RuntimeError(f"this process is tensor-parallel rank {tp_group().rank} of {tp_group().size}, "
                               f"not rank {rank} of {self.tp_size}")
        t0 = time.perf_counter()
        # "auto" choices are resolved by the model for its device and head size
        kwargs = {"attention_backend": config.worker.attention_backend}
        if config.worker.fused_ops != "auto":
            kwargs["fused_ops"] = config.worker.fused_ops
        if config.worker.moe_backend != "auto":  # only MoE models take it: a dense model refuses it at load
            kwargs["moe_backend"] = config.worker.moe_backend
        if config.worker.fp8_backend != "auto":  # likewise only models with FP8 block-scaled weights
            kwargs["fp8_backend"] = config.worker.fp8_backend
        spec = config.scheduler.speculative_config
        if spec is not None:
            check_speculative_config(config)
            kwargs["mtp"] = True
        if config.worker.image_encoder == "remote" and takes_images(model_dir(config)):
            kwargs["vision_tower"] = False  # (a vision encoder of its own makes the embeddings)
        self.loaded: LoadedModel = load_model(config.model.model, dtype=config.model.dtype, device=self.device,
                                              progress=progress, model_kwargs=kwargs,
                                              load_format=config.model.load_format)
        self.load_seconds = time.perf_counter() - t0
        self.model = self.loaded.module.eval()
        if config.worker.fp8_backend != "auto" and getattr(self.model, "fp8_backend_name", None) is None:
            raise ValueError(f"fp8_backend={config.worker.fp8_backend!r} was forced but {self.loaded.model_dir.name} "
                             "has no FP8 weights (no fp8 quantization_config); leave it at auto")
        self.hf_config = self.loaded.config
        self.dtype = self.loaded.dtype
        self.encoder = (ImageEncoder(self.model, self.loaded.model_dir, self.device, self.dtype)
                        if hasattr(self.model, "encode_images") else None)
        """A model that takes images: its vision tower, run for the prefill chunks that hold image tokens."""
        settle = getattr(self.model, "settle_kv_layout", None)  # a model whose kernels need their own page size
        self.block_size = (settle(config.cache.block_size, config.cache.kv_cache_dtype) if settle is not None
                           else config.cache.block_size or DEFAULT_BLOCK_SIZE)  # fmt: skip
        self.max_model_len = load_max_model_len(config.model.max_model_len, self.loaded.model_dir)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.model.seed)
        self.kv_dtype = kv_cache_torch_dtype(config.cache.kv_cache_dtype, self.dtype,
                                             self.model.attention_backend_name, self.device)
        self.num_state_slots = 0
        """Sequences whose recurrent state (a hybrid model's linear-attention layers) the runner holds; 0: none."""
        self.num_state_snapshots = 0
        """Snapshots of such states for prefix caching (rows num_state_slots.. of the state pools)."""
        self.state_history_rows = 0
        """Speculative decoding: rows after the snapshots that hold a verify step's states token by token."""
        self._free_state_slots: list[int] = []
        self._grammars: Grammars | None = None
        """Structured outputs' compiled grammars (built with the first constrained sequence)."""
        if hasattr(self.model, "allocate_state"):
            self._allocate_state()
        if self.device.type == "cuda" and not config.worker.enforce_eager:
            reserve_flashinfer_workspace(self.model, config.scheduler.max_num_seqs, self.device)
        self.num_blocks = self._num_kv_blocks()
        # one block more than the scheduler is told about: padded rows of CUDA-graph batches write there
        # one allocation, a view per layer: the KV data plane reaches every layer through one region
        shape = self.model.kv_cache_shape(self.num_blocks + 1, self.block_size)
        self.kv_caches = list(zeroed_cache((self.model.num_layers, *shape), self.kv_dtype, self.device).unbind(0))
        self.seqs: dict[str, SeqState] = {}
        self._pending: deque[PendingStep] = deque()
        self._st_cache: tuple[tuple, SamplingTensors] | None = None
        """The last step's sampling options, reused while the same sequences sample (see _sampling_tensors)."""
        self.spec = MTPSpeculator(self, spec.num_speculative_tokens) if spec is not None else None
        """Speculative decoding: runs every step (verify + draft)."""
        self.graphs: DecodeGraphs | None = None
        # under tensor parallelism the graphs capture the NCCL all-reduces (tp_cuda_graphs); never with the expert
        # all-to-all, whose dispatch reads counts back (an expert-parallel worker is eager unless
        # data_parallel_worker.ep_graphs_enabled)
        tp_ok = self.tp_size == 1 or (config.worker.tp_cuda_graphs and (not config.parallel.enable_expert_parallel
                                                                        or config.parallel.data_parallel_size == 1))
        static = self.model.attention_backend_name in STATIC_TABLE_BACKENDS
        graphs_ok = (self.device.type == "cuda" and not config.worker.enforce_eager and tp_ok
                     and not through_host())  # (a collective through host memory cannot be captured)
        hybrid = bool(self.num_state_slots)  # (its recurrent-state slots: graph inputs of decode and verify steps)
        max_blocks = -(-self.max_model_len // self.block_size)
        if self.spec is not None:
            # a speculating runner replays graphs of its uniform steps instead (static tables only; one rank, as the
            # verify step's tokens would be broadcast and the MTP layer's all-to-alls padded per step otherwise)
            if (graphs_ok and static and self.tp_size == 1 and not self.spec.mtp_ep_layers
                    and getattr(self.model, "multi_token_graphs", True)):
                self.spec.graphs = SpecGraphs(self.model, self.kv_caches, self.block_size, self.num_blocks,
                                              config.scheduler.max_num_seqs, max_blocks,
                                              self.spec.num_speculative_tokens, self.device,
                                              self.num_state_slots + self.num_state_snapshots if hybrid else None)
                # the scheduler plans a uniform step ahead (actors/batching.py _plan_ahead), launched before the
                # host knows what the step before accepted; not in expert-parallel lockstep. With one draft only: a
                # longer draft chain already covers the host's turn between steps, and planning ahead then only
                # adds the device's corrections (measured: docs/benchmarks.md, MTP)
                self.spec.defer = (config.scheduler.max_steps_in_flight > 1
                                   and config.parallel.expert_parallel_size == 1
                                   and self.spec.num_speculative_tokens == 1)
        elif graphs_ok and (self.model.attention_backend_name == "flashinfer" or static):
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, scratch_block=self.num_blocks,
                                       max_batch=config.scheduler.max_num_seqs, max_blocks_per_seq=max_blocks,
                                       device=self.device, state_slots=hybrid)
        self.prefill_graphs: PrefillGraphs | None = None
        """One sequence's prompt chunks replayed from graphs (actors/prefill_graphs.py; prefill_cuda_graphs)."""
        if (graphs_ok and static and self.spec is None and self.tp_size == 1 and not hybrid
                and getattr(self.model, "multi_token_graphs", True)
                and self.model.attention_backend_name in prefill_graph_backends(config.worker.prefill_cuda_graphs)
                and min(config.scheduler.max_num_batched_tokens, self.max_model_len) >= PREFILL_GRAPH_TOKENS[0]
                and not (config.parallel.enable_expert_parallel and config.parallel.data_parallel_size > 1)):
            self.prefill_graphs = PrefillGraphs(self.model, self.kv_caches, self.block_size, self.num_blocks,
                                                self.max_model_len, config.scheduler.max_num_batched_tokens,
                                                self.device)  # fmt: skip
        log.info("model %s loaded in %.2f s on %s (%s%s); KV cache %d blocks x %d = %d tokens (%s)%s",
                 self.loaded.model_dir.name, self.load_seconds, self.device, str(self.dtype).removeprefix("torch."),
                 f", tensor-parallel rank {rank} of {self.tp_size}" if self.tp_size > 1 else "",
                 self.num_blocks, self.block_size, self.num_blocks * self.block_size,
                 str(self.kv_dtype).removeprefix("torch."),
                 f"; recurrent state for {self.num_state_slots} sequences and {self.num_state_snapshots} "
                 f"snapshots ({self.state_bytes / 2**30:.2f} GiB)" if self.num_state_slots else "")

    def _allocate_state(self) -> None:
        """A hybrid model: one recurrent-state slot per sequence the scheduler may run at once (max_num_seqs),
        allocated before the KV cache is sized so that it comes out of the same budget."""
        config = self.config
        self.num_state_slots = config.scheduler.max_num_seqs
        snapshots = config.cache.num_state_snapshots
        # (a disaggregated engine moves each prompt's state through one, prefix caching or not)
        self.num_state_snapshots = ((self.num_state_slots if snapshots is None else snapshots)
                                    if config.cache.enable_prefix_caching or config.disagg.role != "both" else 0)
        spec = config.scheduler.speculative_config
        self.state_history_rows = self.num_state_slots * (spec.num_speculative_tokens + 1) if spec else 0
        self.model.allocate_state(self.num_state_rows, self.dtype, self.device)
        self._free_state_slots = list(range(self.num_state_slots - 1, -1, -1))

    @property
    def state_pools(self) -> list[torch.Tensor]:
        """The recurrent-state pools ([rows, ...] each; snapshot slot s is row num_state_slots + s): what a KV
        migration moves with the blocks; [] without recurrent state."""
        return self.model.state_tensors() if self.num_state_slots else []

    @property
    def num_state_rows(self) -> int:
        """Rows of the state pools: running slots, then snapshots, then a verify step's history."""
        return self.num_state_slots + self.num_state_snapshots + self.state_history_rows

    @property
    def state_bytes(self) -> int:
        """Bytes of the recurrent-state pools (0 without them)."""
        return self.num_state_rows * self.model.state_bytes_per_slot(self.dtype) if self.num_state_slots else 0

    # ---- sizing -------------------------------------------------------------------------------------

    @property
    def kv_bytes_per_block(self) -> int:
        per_layer = int(np.prod(self.model.kv_cache_shape(1, self.block_size)))
        return per_layer * self.model.num_layers * torch.finfo(self.kv_dtype).bits // 8

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_blocks is not None:
            return cache.kv_cache_blocks
        if self.device.type == "cuda":
            budget = self._gpu_kv_budget()
        else:  # (the GPU's profiling run counts the state pools, allocated already, in its peak)
            budget = cache.cpu_kv_cache_gib * 2**30 - self.state_bytes
        blocks = int(budget // self.kv_bytes_per_block)
        if blocks < 2:
            raise RuntimeError(f"not enough memory for a KV cache: {budget / 2**30:.2f} GiB left for it; "
                               "lower max_model_len or max_num_batched_tokens, raise gpu_memory_utilization, "
                               "or set kv_cache_blocks")
        return blocks

    @torch.inference_mode()
    def _gpu_kv_budget(self) -> float:
        """Bytes the KV cache may take: gpu_memory_utilization of the GPU minus what the largest step needs.

        A profiling run pushes max_num_batched_tokens through the model (prompts of up to max_model_len over
        a scratch cache) and samples max_num_seqs rows; its peak memory (weights + activations + logits) is what
        the KV cache must leave of this engine's share. The share is this engine's alone, as vLLM's is: engines
        sharing a GPU each take theirs (0.45 and 0.45, say), and what other processes hold is not subtracted, only
        checked against the memory free now, so two engines starting together on one GPU size alike.
        """
        sched = self.config.scheduler
        tokens = max(1, sched.max_num_batched_tokens)
        per_seq = min(tokens, self.max_model_len)
        lens = [per_seq] * (tokens // per_seq) + ([tokens % per_seq] if tokens % per_seq else [])
        blocks_each = [-(-n // self.block_size) for n in lens]
        scratch = [torch.empty(self.model.kv_cache_shape(sum(blocks_each), self.block_size), dtype=self.kv_dtype,
                               device=self.device) for _ in range(self.model.num_layers)]
        starts = np.cumsum([0, *blocks_each])
        tables = [list(range(a, b)) for a, b in zip(starts[:-1], starts[1:])]
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        log.info("profiling run: %d tokens through the model (on a first start with these shapes, triton compiles "
                 "its kernels here and in the graph capture after it: minutes for a large model)", tokens)
        t0 = time.perf_counter()
        meta = AttentionMetadata.from_lists([0] * len(lens), lens, tables, self.block_size, device=self.device)
        if self.num_state_slots:  # (scratch state: every slot is zeroed when a sequence gets it)
            meta.state_slots = torch.arange(len(lens), device=self.device) % self.num_state_slots
        positions = positions_from_lists([0] * len(lens), lens, device=self.device)
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        with ep_step(tokens):  # every expert-parallel rank runs it alike
            hidden = self.model(ids, positions, scratch, meta)
        rows = min(sched.max_num_seqs, tokens)
        logits = self.model.compute_logits(hidden[:rows])
        image_cache = self.encoder.profile() if self.encoder is not None else 0  # (the tower's peak, its cache)
        st = SamplingTensors.build([SamplingParams(temperature=0.7, top_p=0.9, top_k=50)] * rows, [0] * rows,
                                   device=self.device, vocab_size=logits.shape[1])
        sample(logits, st, 20, generator=self.generator)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        scratch_bytes = sum(t.numel() * t.element_size() for t in scratch)
        del scratch, hidden, logits
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        utilization = self.config.cache.gpu_memory_utilization
        budget = total * utilization - (peak - scratch_bytes) - image_cache
        log.info("profiling run: %.1f s, peak %.2f GiB for %d tokens; %.2f GiB of %.2f GiB left for the KV cache",
                 time.perf_counter() - t0, (peak - scratch_bytes) / 2**30, tokens, budget / 2**30, total / 2**30)
        if budget > free - KV_FREE_MARGIN_BYTES:
            others = total - free - torch.cuda.memory_reserved(self.device)
            raise RuntimeError(
                f"gpu_memory_utilization {utilization} leaves {budget / 2**30:.2f} GiB for the KV cache, but only "
                f"{free / 2**30:.2f} GiB of the GPU are free ({others / 2**30:.2f} GiB held outside this engine's "
                "allocator: other processes, CUDA contexts); lower gpu_memory_utilization or set kv_cache_blocks")
        return budget

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    # ---- the step ---------------------------------------------------------------------------------------
    #
    # A step is launched (inputs staged, forward and sampling queued on the device, the sampled tokens'
    # copy to pinned host memory queued behind them) and later finished (wait for that copy, append the
    # tokens, build the StepResult). Between the two the host is free to launch the next step: a token
    # the next step feeds that is not on the host yet is gathered from the previous step's device tensor,
    # so the device never waits for the host to learn a token it produced (SGLang's overlap scheduler and
    # vLLM's async scheduling do the same).

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Launch a step and wait for its result; for callers that do not overlap steps."""
        if self._pending:
            raise RuntimeError("execute() while launched steps are pending: finish them first")
        self.launch(plan)
        return self.finish_oldest()

    @property
    def num_pending(self) -> int:
        """Launched steps not yet finished."""
        return len(self._pending)

    def oldest(self) -> tuple[int, torch.cuda.Event | None]:
        """The oldest pending step's number and the event that marks its results as on the host (None: there
        is nothing to wait for)."""
        p = self._pending[0]
        return p.step, p.event

    def oldest_finished(self) -> bool:
        """Whether the oldest pending step's result is ready as it is (a step that finished at launch: a speculating
        one, an empty or a failed one): finish_oldest then waits for nothing and touches no sequence, so any thread
        may call it."""
        return self._pending[0].result is not None

    def finish_oldest(self) -> StepResult:
        """Finish the oldest launched step (blocks until its device work is done) and return its result."""
        p = self._pending.popleft()
        try:
            return p.finish()
        finally:
            p.release()

    def close(self) -> None:
        """Drop the model, the KV cache, the graphs and every other tensor this runner holds, and hand the memory
        back to the device: a later engine in the same process (an inline LLM after another, as bench_mtp runs
        them) then finds it free, where otherwise the first engine's memory would stay reachable through the
        stopped actors and the second would run out of device memory. The runner is unusable afterwards."""
        device = self.device
        if self.__dict__.get("spec") is not None:  # a speculator (and its graphs) someone still holds lets go too
            self.spec.close()
        if self.__dict__.get("_grammars") is not None:
            self._grammars.close()
        self.__dict__.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def fail(self, step: int, error: str) -> None:
        """Queue a failed step's result in order (its launch raised)."""
        self._pending.append(PendingStep.done(StepResult(step=step, error=error)))

    @torch.inference_mode()
    def launch(self, plan: StepPlan, graph_size: int | None = None) -> None:
        """Stage and queue one step; its result comes from a later finish_oldest() (steps finish in order).

        graph_size: None lets the runner choose (a decode batch that fits replays a graph); 0 runs the step eager; a
        captured size replays that graph (the decode batch padded to it: what expert-parallel ranks that gather
        tokens agreed on, actors/data_parallel_worker.py step_rows). The caller turns an exception into a StepResult
        with an error; the runner stays usable.
        """
        for rid in plan.finished_rids:
            gone = self.seqs.pop(rid, None)
            if gone is not None and gone.state_slot >= 0:
                self._free_state_slots.append(gone.state_slot)
            if gone is not None and gone.images is not None:
                self.encoder.release(rid)  # (what an encoder actor pinned for it)
        for ns in plan.new_seqs:
            self.seqs[ns.rid] = SeqState.new(
                ns.token_ids, num_prompt_tokens=len(ns.token_ids) - ns.num_output_tokens,
                num_computed=ns.num_computed_tokens, block_ids=ns.block_ids, sampling=ns.sampling,
                needs_history=_needs_history(ns.sampling), grammar=self._grammar_of(ns.sampling),
                prompt_logprobs=None if ns.num_output_tokens else ns.sampling.prompt_logprobs,  # (else: sent)
                images=None if not ns.images or self.encoder is None else self.encoder.sequence(
                    ns.token_ids, len(ns.token_ids) - ns.num_output_tokens, ns.images))
        if self.num_state_slots and plan.new_seqs:
            self._assign_state_slots(plan.new_seqs)
        if not plan.rids:
            self._pending.append(PendingStep.done(StepResult(step=plan.step)))
            return
        seqs = [self.seqs[rid] for rid in plan.rids]
        num_new = plan.num_new_tokens.tolist()
        if self._log_jit:
            jit_log.context = f"step {plan.step}: {len(seqs)} sequences, {sum(num_new)} tokens"
        if plan.new_block_ids is not None and len(plan.new_block_ids):
            counts = plan.new_block_counts
            ends = np.cumsum(counts)
            for i in np.flatnonzero(counts).tolist():  # only the sequences that got blocks (~1 in 16 at decode)
                seqs[i].add_blocks(plan.new_block_ids[ends[i] - counts[i]:ends[i]])
        if self.spec is not None:
            result = self.spec.step(plan.step, plan.rids, seqs, num_new)
            self._save_states(plan, seqs)  # (prefill chunks only: no draft rolls their state back)
            self._pending.append(PendingStep.done(result) if isinstance(result, StepResult) else result)
            return
        cached = [s.num_computed for s in seqs]
        ids, patch = self._input_ids(seqs, cached, num_new)
        if graph_size is None:
            graph_size = (self.graphs.padded_size(len(seqs)) if self.graphs is not None and decodes_only(plan)
                          and self.graphs.fits(len(seqs)) else 0)  # fmt: skip
        if graph_size:
            # one new token per sequence, each sampling the next: a captured decode step
            logits, greedy = self._decode_by_graph(seqs, cached, ids, patch, graph_size)
            self._save_states(plan, seqs)
            scores = None
            sampling_rows = list(range(len(seqs)))
            for s in seqs:
                s.num_computed += 1
        else:
            pg = self.prefill_graphs
            if (pg is not None and len(seqs) == 1 and not patch and seqs[0].images is None
                    and pg.fits(cached[0], num_new[0])):
                hidden = pg.run(ids, cached[0], seqs[0].block_ids)  # one sequence's chunk: a replay
            else:
                input_ids = upload(ids, self.device)
                apply_patch(input_ids, patch, self.device)
                meta = AttentionMetadata.from_lists(cached, num_new, [s.block_ids for s in seqs], self.block_size,
                                                    device=self.device)
                if self.num_state_slots:
                    meta.state_slots = upload(np.fromiter((s.state_slot for s in seqs), dtype=np.int64,
                                                          count=len(seqs)), self.device)
                images = (None if self.encoder is None else
                          self.encoder.step_inputs([s.images for s in seqs], cached, num_new))
                at = [c + s.rope_delta for s, c in zip(seqs, cached)] if self.encoder is not None else cached
                positions = positions_from_lists(at, num_new, device=self.device)
                hidden = self.model(input_ids, positions, self.kv_caches, meta, **(images or {}))
            self._save_states(plan, seqs)
            scores = score_prompts(self.model.compute_logits, hidden, plan.rids, seqs, cached, num_new,
                                   self.config.scheduler.max_num_seqs)
            # a sequence samples when this step reaches the end of its known tokens
            sampling_rows = [i for i, (s, c, n) in enumerate(zip(seqs, cached, num_new)) if c + n == s.length]
            for s, n in zip(seqs, num_new):
                s.num_computed += n
            if not sampling_rows:
                self._pending.append(PendingStep.done(StepResult(step=plan.step)) if scores is None else
                                     PendingStep.launch(plan.step, [], [], None, False, self.device, scores))
                return
            ends = np.cumsum(num_new)[sampling_rows] - 1
            logits = self.model.compute_logits(hidden[upload(ends, self.device)])
            greedy = None
        sampled = [seqs[i] for i in sampling_rows]
        sampled_rids = [plan.rids[i] for i in sampling_rows]
        if self.rank == 0:
            out, want = self._sample(sampled, sampled_rids, logits, greedy)
        else:  # rank 0 samples for the group: these ranks only need its tokens (broadcast below)
            out, want = SamplerOutput(token_ids=torch.empty(len(sampled), dtype=torch.int64, device=self.device)), None
        token_ids = broadcast_from_first(out.token_ids)  # (int64 on every rank; in place)
        for row, s in enumerate(sampled):  # the token exists on the device now, on the host after finish
            s.device_tokens[s.length] = (token_ids, row)
            s.length += 1
        self._pending.append(PendingStep.launch(plan.step, sampled_rids, sampled, out, want is not None, self.device,
                                             scores))

    def _assign_state_slots(self, new_seqs: list[NewSequence]) -> None:
        """Give each new sequence a free recurrent-state slot: zeroed, or a copy of the snapshot its prefix hit
        resumes from."""
        if len(new_seqs) > len(self._free_state_slots):
            raise RuntimeError(f"{len(new_seqs)} new sequences but {len(self._free_state_slots)} free recurrent-state "
                               f"slots of {self.num_state_slots}: the scheduler ran more than max_num_seqs")
        zeroed, restored, snapshots = [], [], []
        for ns in new_seqs:
            s = self.seqs[ns.rid]
            s.state_slot = self._free_state_slots.pop()
            if ns.state_snapshot >= 0:
                restored.append(s.state_slot)
                snapshots.append(self.num_state_slots + ns.state_snapshot)
            elif ns.num_computed_tokens:
                raise RuntimeError(f"sequence {ns.rid} has {ns.num_computed_tokens} cached tokens but no state "
                                   "snapshot to resume its recurrent state from")
            else:
                zeroed.append(s.state_slot)
        if zeroed:
            self.model.reset_state(upload(np.array(zeroed, dtype=np.int64), self.device))
        if restored:
            self.copy_states(snapshots, restored)

    def _save_states(self, plan: StepPlan, seqs: list[SeqState]) -> None:
        """The snapshots the plan asks for, after its step (where cached prefixes end, for prefix hits)."""
        if plan.state_save_rows is not None:
            self.copy_states([seqs[i].state_slot for i in plan.state_save_rows.tolist()],
                              (plan.state_save_slots + self.num_state_slots).tolist())

    def copy_states(self, src: list[int], dst: list[int]) -> None:
        """Recurrent-state rows src -> dst (running slots and snapshots share the pools)."""
        self.model.copy_state(upload(np.array(src, dtype=np.int64), self.device),
                              upload(np.array(dst, dtype=np.int64), self.device))

    def _sample(self, sampled: list[SeqState], rids: list[str], logits: torch.Tensor,
                greedy: torch.Tensor | None = None) -> tuple[SamplerOutput, int | None]:
        """Sample the next token of each sequence; also the most logprobs any of them asked for. `greedy`: the
        logits' argmax where a decode graph computed it."""
        history = any(s.needs_history for s in sampled)
        if history and any(s.host_length < s.length for s in sampled):
            self._drain()  # penalties read every output token on the host
        masked = self.mask_grammars(logits, sampled)
        if masked and greedy is not None:  # a graph's argmax came before the masks: the masked rows' again
            rows = upload(np.array(masked, dtype=np.int64), self.device)
            greedy = greedy.index_put((rows,), greedy_argmax(logits.index_select(0, rows)))
        st = self._sampling_tensors(sampled, rids, history, logits.shape[1])
        want = max((s.sampling.logprobs for s in sampled if s.sampling.logprobs is not None), default=None)
        return sample(logits, st, want, generator=self.generator, greedy_ids=greedy), want

    def _grammar_of(self, sampling: SamplingParams) -> SequenceGrammar | None:
        """A constrained sequence's matcher, its grammar's compile started (on the rank that samples)."""
        so = sampling.structured_outputs
        if so is None or self.rank != 0:
            return None
        if self._grammars is None:
            path = model_dir(self.config)
            tokenizer = load_tokenizer(path)
            self._grammars = Grammars(tokenizer, self.model.config.vocab_size, eos_token_ids(tokenizer, path))
        stop = sorted({*self._grammars.stop_token_ids, *sampling.stop_token_ids})
        return SequenceGrammar(self._grammars.start(so), stop, so.after)

    def mask_grammars(self, logits: torch.Tensor, row_seqs: list[SeqState], verify: bool = False) -> list[int]:
        """Mask the logits rows (one per entry of row_seqs) of constrained sequences to what their grammars allow
        next (waiting for their last tokens to reach the host first); the rows masked. verify: a sequence's rows
        are speculative decoding's, in order: row j is the position after its drafts[:j]."""
        rows: dict[int, tuple[list[int], SequenceGrammar, list[int]]] = {}
        seqs: dict[int, SeqState] = {}
        for i, s in enumerate(row_seqs):
            if s.grammar is not None:
                rows.setdefault(id(s), ([], s.grammar, s.drafts if verify else []))[0].append(i)
                seqs[id(s)] = s
        if not rows:
            return []
        if any(s.host_length < s.length for s in seqs.values()):
            self._drain()  # a matcher follows the tokens sampled so far
        for s in seqs.values():
            s.grammar.follow(s.tokens[s.num_prompt_tokens:])
        return grammar.apply(logits, list(rows.values()), self._grammars.batch)

    def _sampling_tensors(self, sampled: list[SeqState], rids: list[str], history: bool,
                          vocab: int) -> SamplingTensors:
        """The step's sampling options on the device. Consecutive decode steps mostly sample the same sequences,
        and then the options are the same tensors as last step (the sampler only reads them): reused, unless a
        row's options change per step (penalties read the history; seeded rows hash the generation index)."""
        key = (tuple(rids), vocab)
        cached = self._st_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        st = SamplingTensors.build(
            [s.sampling for s in sampled], [s.length - s.num_prompt_tokens for s in sampled],
            device=self.device, vocab_size=vocab,
            prompt_token_ids=[s.tokens[:s.num_prompt_tokens] for s in sampled] if history else None,
            output_token_ids=[s.tokens[s.num_prompt_tokens:] for s in sampled] if history else None)
        reusable = not history and st.seeded_rows.numel() == 0
        self._st_cache = (key, st) if reusable else None
        return st

    def _drain(self) -> None:
        """Finish every pending step's host side now (their results stay queued for finish_oldest). Over a copy: the
        worker's loop thread sends (pops) the oldest step as soon as it is finished, while this goes on."""
        for p in list(self._pending):
            p.finish()

    def _input_ids(self, seqs: list[SeqState], cached: list[int], num_new: list[int]) -> tuple[np.ndarray, Patch]:
        """The step's flat input ids from host buffers, and the tokens only the device knows yet (sampled by a
        step not finished), grouped by the tensor that holds them: id(tensor) -> (tensor, flat indices, rows)."""
        patch: Patch = {}
        if len(num_new) == len(seqs) == sum(num_new):  # pure decode: one token each, one pass, no slicing
            ids = np.zeros(len(seqs), dtype=np.int64)
            for i, s in enumerate(seqs):
                c = s.num_computed
                if c < s.host_length:
                    ids[i] = s.buffer[c]
                else:
                    add_patch(patch, i, *s.device_tokens[c])
            return ids, patch
        ids = np.zeros(sum(num_new), dtype=np.int64)
        at = 0
        for s, c, n in zip(seqs, cached, num_new):
            known = min(c + n, s.host_length)
            if known > c:
                ids[at:at + known - c] = s.buffer[c:known]
            for pos in range(max(c, known), c + n):
                add_patch(patch, at + pos - c, *s.device_tokens[pos])
            at += n
        return ids, patch

    def _decode_by_graph(self, seqs: list[SeqState], cached: list[int], ids: np.ndarray,
                         patch: Patch, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        bs = self.block_size
        pos = np.asarray(cached, dtype=np.int64)
        tables = [s.table for s in seqs]  # storage with spare room: the plan reads each one's first pages
        blocks = np.fromiter((t[c // bs] for t, c in zip(tables, cached)), dtype=np.int64, count=len(seqs))
        rope = pos if self.encoder is None else pos + np.fromiter((s.rope_delta for s in seqs), np.int64, len(seqs))
        state = (np.fromiter((s.state_slot for s in seqs), dtype=np.int64, count=len(seqs)) if self.num_state_slots
                 else None)
        assert self.graphs is not None
        return self.graphs.run(ids, rope, blocks * bs + pos % bs, pos + 1, tables,
                               patch=lambda input_ids: apply_patch(input_ids, patch, self.device), size=size,
                               state_slots=state)


def _needs_history(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
