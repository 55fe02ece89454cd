"""Tensor parallelism (Megatron-style): the process's rank in its tensor-parallel group and the layers that
split a model's weights over that group.

One process holds one rank; `init_tensor_parallel` joins the group (gloo on CPU, nccl on CUDA) before the
model is built, and every layer reads the group from `tp_group()` while it is constructed. With one rank
(the default, nothing initialised) every layer is the plain GEMM / lookup it replaces: no collective runs
and no branch beyond one `if` per layer.

- Column-parallel (`QKVParallelLinear`, `MergedColumnParallelLinear`): each rank keeps a slice of the
  output rows of every fused part (its q heads and kv heads; its gate and up columns), so the attention and
  the SiLU-and-mul that follow run on local data.
- Row-parallel (`RowParallelLinear`): each rank keeps the input columns matching that slice; the partial
  products are summed with one all-reduce (o_proj, down_proj).
- Vocab-parallel (`VocabParallelEmbedding`, `vocab_parallel_logits`): each rank keeps a contiguous range of
  the vocabulary; a lookup outside it gives zeros and an all-reduce fills them in; the LM head's logits are
  all-gathered and the padding of the last range cut off.

Checkpoints hold whole tensors: each layer's `load(...)` narrows a tensor to the rank's part (the loader
reads whole tensors and the model slices them).

FP8 block-scaled layers (`Fp8ColumnParallelLinear`, `Fp8RowParallelLinear`: DeepSeek's e4m3 `weight` with a
float32 `weight_scale_inv` per block) slice the weight and its scales together, so a rank's share must start
and end on the weight blocks (a partial last block only where the share ends the tensor); any other split
is refused when the layer is built.

Expert parallelism: MoE layers built while `ep_group()` has several ranks keep only their share of the
experts, whole (models/qwen3_moe.py). The group is an engine's data-parallel ranks, joined as a group of its own
(`init_expert_parallel`, actors/data_parallel.py; tokens travel to their experts by all-to-all), or the
tensor-parallel group itself (`expert_parallel_over_tensor_parallel`, with one data-parallel rank: the ranks hold
the same tokens, so each computes its experts' share of all of them and the MoE output's all-reduce sums them).
With both (data_parallel_size D x tensor_parallel_size T, `init_data_parallel_world`) the D*T ranks join one world:
the expert-parallel group is all of it and each data-parallel rank's T ranks form a tensor-parallel sub-group.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from flotilla.kernels.comm import stage_through_host, staged, through_host
from flotilla.kernels.linear import linear
from flotilla.kernels.moe.ep_allgather import ep_tokens
from flotilla.kernels.quant import Fp8LinearBackend
from flotilla.kernels.quant.fp8_linear import Fp8BlockLinear
from flotilla.kernels.quant.fp8_ref import num_blocks


@dataclass(frozen=True, slots=True)
class ParallelGroup:
    """This process's place in a group of ranks: its tensor-parallel group (TPGroup), or the expert-parallel
    group under enable_expert_parallel (EPGroup: MoE layers built while it is set keep only their share of the
    experts): an engine's data-parallel ranks, or the tensor-parallel group again."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    """None with one rank: no collective ever runs (the experts stay whole, no all-to-all)."""


TPGroup = EPGroup = ParallelGroup

_TP = TPGroup()


def _join_world(rank: int, size: int, init_method: str, device: torch.device, timeout_s: float,
                share_device: bool = False) -> ParallelGroup:
    """The process-wide group of `size` ranks at rendezvous `init_method` (tcp://host:port), joined as `rank`;
    blocks until every rank has joined. gloo for CPU tensors, nccl for CUDA ones; gloo through host memory when the
    ranks share one GPU (`share_device`: kernels/comm.py)."""
    shared = share_device and device.type == "cuda"
    backend = "nccl" if device.type == "cuda" and not shared else "gloo"
    dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank,
                            timeout=datetime.timedelta(seconds=timeout_s))
    stage_through_host(shared)
    return ParallelGroup(rank=rank, size=size, group=dist.group.WORLD)


def tp_group() -> TPGroup:
    """The tensor-parallel group of this process (rank 0 of 1 unless init_tensor_parallel ran)."""
    return _TP


def init_tensor_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float = 600.0, share_device: bool = False) -> TPGroup:
    """Join the group of `size` ranks at rendezvous `init_method` (tcp://host:port) as `rank`; blocks until
    every rank has joined. gloo for CPU tensors, nccl for CUDA ones (gloo with `share_device`). One group per
    process."""
    global _TP
    if size == 1:
        return _TP
    if _TP.size > 1:
        raise RuntimeError(f"this process already is rank {_TP.rank} of a tensor-parallel group of {_TP.size}")
    _TP = _join_world(rank, size, init_method, device, timeout_s, share_device)
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP
    if _TP.size > 1 and dist.is_initialized():  # (a sub-group's world may be gone with the expert group's)
        dist.destroy_process_group()
    _TP = TPGroup()


_EP = EPGroup()
_EP_OVER_TP = False
"""Whether the experts are spread over the tensor-parallel group (expert_parallel_over_tensor_parallel)."""
_EP_HOST: dist.ProcessGroup | None = None
"""With gather_tokens_over_expert_parallel: a gloo group of the expert-parallel ranks for host-side agreements."""


def ep_group() -> EPGroup:
    """The expert-parallel group of this process: the tensor-parallel group after
    expert_parallel_over_tensor_parallel, else the data-parallel ranks' group (rank 0 of 1 unless
    init_expert_parallel ran)."""
    return _TP if _EP_OVER_TP else _EP


def ep_ranks_share_tokens() -> bool:
    """Whether every rank of ep_group() holds the same tokens (it is the tensor-parallel group): a MoE layer
    then computes its experts' share of every token and the all-reduce that tensor parallelism runs anyway sums
    the shares; no all-to-all."""
    return _EP_OVER_TP


def expert_parallel_over_tensor_parallel() -> None:
    """Spread the experts over the tensor-parallel group (each rank keeps whole experts, not a slice of every
    one): vLLM's layout for tensor_parallel_size > 1 with enable_expert_parallel and one data-parallel rank. May
    run before init_tensor_parallel: the MoE layers read ep_group() when they are built."""
    global _EP_OVER_TP
    if _EP.size > 1:
        raise RuntimeError("this process already belongs to an expert-parallel group of data-parallel ranks")
    _EP_OVER_TP = True


def gather_tokens_over_expert_parallel() -> None:
    """After init_expert_parallel (collective: every rank calls it): MoE layers built from now on move tokens by
    all-gather / reduce-scatter (kernels/moe/ep_allgather.py, all2all_backend allgather_reducescatter), and the
    ranks get a gloo group to agree on each step's rows over (agree_on_rows)."""
    global _EP_HOST
    if _EP.size < 2:
        raise RuntimeError("gathering tokens needs an expert-parallel group of data-parallel ranks")
    _EP_HOST = _EP.group if dist.get_backend(_EP.group) == "gloo" else dist.new_group(backend="gloo")


def ep_gathers_tokens() -> bool:
    """Whether the expert-parallel MoE layers gather every rank's tokens (gather_tokens_over_expert_parallel)."""
    return _EP_HOST is not None


def ep_step(rows: int) -> contextlib.AbstractContextManager:
    """Where the expert-parallel layers gather tokens: ep_tokens(rows), the rows every rank exchanges in what runs
    inside (every rank enters it alike); elsewhere a context that does nothing."""
    return ep_tokens(rows) if ep_gathers_tokens() else contextlib.nullcontext()


def agree_on_rows(rows: int, eager: bool = False) -> tuple[int, bool]:
    """(the most `rows` of any expert-parallel rank, whether any rank runs its step `eager`): one all-reduce over
    the host group (collective: every rank calls it once per step, real or empty, in step order; a few tens of
    microseconds over gloo)."""
    assert _EP_HOST is not None
    most = torch.tensor([rows, int(eager)], dtype=torch.int64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=_EP_HOST)
    return int(most[0]), bool(most[1])


def init_expert_parallel(rank: int, size: int, init_method: str, device: torch.device,
                         timeout_s: float = 600.0, share_device: bool = False) -> EPGroup:
    """Join the expert-parallel group of `size` ranks at `init_method` (tcp://host:port) as `rank`, like
    init_tensor_parallel (whose group it cannot share: expert parallelism runs with one TP rank per process)."""
    global _EP
    if size == 1:
        return _EP
    if _EP.size > 1 or _TP.size > 1 or _EP_OVER_TP:
        raise RuntimeError("this process already belongs to a parallel group")
    _EP = _join_world(rank, size, init_method, device, timeout_s, share_device)
    return _EP


def init_data_parallel_world(dp_rank: int, dp_size: int, tp_rank: int, tp_size: int, init_method: str,
                             device: torch.device, timeout_s: float = 600.0,
                             share_device: bool = False) -> tuple[TPGroup, EPGroup]:
    """Data parallelism x tensor parallelism x expert parallelism: join the world of every rank of the engine
    (dp_size x tp_size processes, global rank dp_rank * tp_size + tp_rank) at `init_method`; it is the
    expert-parallel group, and each data-parallel rank's tp_size ranks form a tensor-parallel sub-group (every
    process creates every sub-group, in the same order, as torch.distributed.new_group requires). Sets both
    tp_group() and ep_group(); blocks until every rank has joined."""
    global _TP, _EP
    if _EP.size > 1 or _TP.size > 1 or _EP_OVER_TP:
        raise RuntimeError("this process already belongs to a parallel group")
    if not (0 <= dp_rank < dp_size and 0 <= tp_rank < tp_size):
        raise ValueError(f"rank (dp {dp_rank}, tp {tp_rank}) is not in a world of {dp_size} x {tp_size}")
    world = _join_world(dp_rank * tp_size + tp_rank, dp_size * tp_size, init_method, device, timeout_s,
                        share_device)
    groups = [dist.new_group(list(range(d * tp_size, (d + 1) * tp_size))) for d in range(dp_size)]
    _TP = TPGroup(rank=tp_rank, size=tp_size, group=groups[dp_rank])
    _EP = world
    return _TP, _EP


def destroy_expert_parallel() -> None:
    global _EP, _EP_OVER_TP, _EP_HOST
    _EP_HOST = None
    if _EP.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _EP, _EP_OVER_TP = EPGroup(), False


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks (in place); x itself with one rank."""
    tp = _TP
    if tp.size > 1:
        staged(lambda t: dist.all_reduce(t, group=tp.group), x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """The ranks' x concatenated along the last dim, in rank order."""
    tp = _TP
    if tp.size == 1:
        return x
    local = x.cpu() if through_host() else x.contiguous()
    parts = [torch.empty_like(local) for _ in range(tp.size)]
    dist.all_gather(parts, local, group=tp.group)
    return torch.cat(parts, dim=-1).to(x.device)


def broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's x on every rank (in place)."""
    tp = _TP
    if tp.size > 1:  # group_src: the group's rank 0 (a data-parallel rank's sub-group starts at d * tp globally)
        staged(lambda t: dist.broadcast(t, group_src=0, group=tp.group), x)
    return x


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel size {parts}")
    return total // parts


def check_shape(src: torch.Tensor, shape: tuple[int, ...], checkpoint_name: str, param_name: str) -> None:
    """ValueError naming both tensors unless the checkpoint tensor has the (whole, unsharded) shape."""
    if tuple(src.shape) != tuple(shape):
        raise ValueError(f"checkpoint tensor {checkpoint_name!r} has shape {tuple(src.shape)} but parameter "
                         f"{param_name!r} expects {tuple(shape)}")


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(src)


def _empty(*shape: int) -> nn.Parameter:
    # Uninitialized: weights always come from a checkpoint (or load_format=dummy); honours the default
    # device/dtype context the loader builds the model in.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) for a weight fused from parts (shard ids) stacked along the output dim; each rank keeps
    its slice of every part. `parts` maps a shard id to (full rows, this rank's rows, first row taken from
    the checkpoint tensor), in the order the parts are stacked."""

    def __init__(self, in_features: int, parts: dict[str, tuple[int, int, int]], bias: bool) -> None:
        super().__init__()
        self.parts = parts
        self.offsets: dict[str, int] = {}
        at = 0
        for shard, (_, rows, _) in parts.items():
            self.offsets[shard] = at
            at += rows
        self.in_features = in_features
        self.out_features = at
        """Rows on this rank."""
        self.weight = _empty(at, in_features)
        self.bias = _empty(at) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def load(self, param: nn.Parameter, src: torch.Tensor, names: tuple[str, str], shard: str) -> None:
        """Copy this rank's rows of checkpoint tensor `src` (part `shard`, all its rows) into `param` (weight
        or bias); names = (checkpoint tensor, parameter) for errors."""
        full, rows, first = self.parts[shard]
        check_shape(src, (full, *param.shape[1:]), *names)
        _copy(param.data.narrow(0, self.offsets[shard], rows), src.narrow(0, first, rows))


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q/k/v projection split by heads: each rank keeps num_heads / tp query heads and
    num_kv_heads / tp kv heads, or, with more ranks than kv heads, one kv head shared by tp / num_kv_heads
    ranks (the kv head its query heads attend to)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        tp = tp_group()
        self.num_heads = divide(num_heads, tp.size, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "num_key_value_heads")
            kv_first = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(f"the tensor-parallel size {tp.size} is neither a divisor nor a multiple of "
                                 f"num_key_value_heads ({num_kv_heads})")
            self.num_kv_heads = 1  # replicated: rank r keeps kv head r // (tp / num_kv_heads)
            kv_first = tp.rank // (tp.size // num_kv_heads)
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, {
            "q": (num_heads * head_dim, q, tp.rank * q),
            "k": (num_kv_heads * head_dim, kv, kv_first * head_dim),
            "v": (num_kv_heads * head_dim, kv, kv_first * head_dim),
        }, bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Equal-sized parts (gate and up) fused along the output dim, each split evenly over the ranks."""

    def __init__(self, in_features: int, part_size: int, shards: tuple[str, ...], bias: bool) -> None:
        tp = tp_group()
        rows = divide(part_size, tp.size, "intermediate_size")
        super().__init__(in_features, {s: (part_size, rows, tp.rank * rows) for s in shards}, bias)


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T (+ b): each rank keeps the input columns of its column-parallel
    input's slice; one all-reduce, then the bias once. With reduce_results=False the rank's partial sum is
    returned (bias on rank 0 only) for the caller to add to others before one all-reduce of its own."""

    def __init__(self, in_features: int, out_features: int, bias: bool, reduce_results: bool = True) -> None:
        super().__init__()
        tp = self.tp = tp_group()
        self.in_features = divide(in_features, tp.size, "the input size of a row-parallel layer")
        self.full_in_features = in_features
        self.reduce_results = reduce_results
        self.weight = _empty(out_features, self.in_features)
        self.bias = _empty(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        return _row_parallel_output(linear(x, self.weight), self.bias, self.reduce_results, self.tp)

    def load(self, param: nn.Parameter, src: torch.Tensor, names: tuple[str, str], shard: str | None = None) -> None:
        if param is self.bias:
            check_shape(src, tuple(param.shape), *names)
            _copy(param.data, src)
            return
        check_shape(src, (param.shape[0], self.full_in_features), *names)
        _copy(param.data, src.narrow(1, self.tp.rank * self.in_features, self.in_features))


class VocabParallelEmbedding(nn.Module):
    """Token embedding [vocab, hidden] split by vocabulary range: rank r keeps rows [r * n, (r + 1) * n) with
    n = ceil(vocab / tp) (the last range padded with rows never looked up). The same split serves as a
    vocab-parallel LM head (`vocab_parallel_logits`), tied or not."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp = self.tp = tp_group()
        self.num_embeddings = num_embeddings
        self.rows = -(-num_embeddings // tp.size)
        self.start = tp.rank * self.rows
        self.weight = _empty(self.rows, embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))

    def load(self, param: nn.Parameter, src: torch.Tensor, names: tuple[str, str], shard: str | None = None) -> None:
        check_shape(src, (self.num_embeddings, param.shape[1]), *names)
        rows = max(0, min(self.rows, self.num_embeddings - self.start))
        _copy(param.data.narrow(0, 0, rows), src.narrow(0, self.start, rows))
        if rows < self.rows:  # padding: zeros, so a padded logit is finite (and cut off anyway)
            param.data[rows:].zero_()


def _row_parallel_output(partial: torch.Tensor, bias: torch.Tensor | None, reduce_results: bool,
                         tp: TPGroup) -> torch.Tensor:
    """A row-parallel layer's output from this rank's partial product: summed over the ranks then biased, or
    (reduce_results=False) left partial, biased on rank 0 alone so that the caller's sum adds the bias once."""
    if reduce_results:
        partial = all_reduce(partial)
    elif tp.rank != 0:
        return partial
    return partial if bias is None else partial + bias


def vocab_parallel_logits(hidden: torch.Tensor, head: VocabParallelEmbedding,
                          out: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [N, H] -> float32 logits [N, vocab] on every rank: each rank's vocabulary range, gathered. `out`: a
    float32 [N, vocab] tensor to write them into (a decode graph's buffer) instead of a new one."""
    local = F.linear(hidden, head.weight)
    if head.tp.size > 1:
        local = all_gather_last_dim(local)[:, :head.num_embeddings]
    return local.float() if out is None else out.copy_(local)


def _fp8_misaligned(what: str, unit: str, rows: int, full: int, first: int, block: int, tp: TPGroup) -> ValueError:
    if tp.size == 1:  # only fused parts can be off the blocks
        return ValueError(f"{what}: fusing parts of {rows} {unit} needs each to be a multiple of the weight block "
                          f"({block})")
    return ValueError(f"{what}: tensor-parallel rank {tp.rank} of {tp.size} would keep {rows} of its {full} {unit} "
                      f"from {first} on, which do not fall on the FP8 weight blocks of {block}: each rank's share "
                      f"must be a multiple of the weight block (use a tensor-parallel size that splits it into "
                      f"whole blocks)")


class Fp8ColumnParallelLinear(Fp8BlockLinear):
    """A column-parallel layer (as ColumnParallelLinear: parts stacked along the output dim, this rank's rows
    of each) with FP8 block-scaled weights: the rows of `weight` and the matching block rows of
    `weight_scale_inv`. `what` names the layer in errors."""

    def __init__(self, in_features: int, parts: dict[str, tuple[int, int, int]], bias: bool,
                 block_size: tuple[int, int], backend: Fp8LinearBackend | None = None,
                 what: str = "an FP8 layer") -> None:  # fmt: skip
        tp = tp_group()
        bn = int(block_size[0])
        self.parts = parts
        self.offsets: dict[str, int] = {}
        at = 0
        for i, (shard, (full, rows, first)) in enumerate(parts.items()):
            ends_tensor = i == len(parts) - 1 and first + rows == full  # a partial last block is the tensor's own
            if first % bn or (rows % bn and not ends_tensor):
                raise _fp8_misaligned(what, "rows", rows, full, first, bn, tp)
            self.offsets[shard] = at
            at += rows
        super().__init__(in_features, at, bias, block_size, backend)

    def load(self, param: nn.Parameter, src: torch.Tensor, names: tuple[str, str], shard: str) -> None:
        """This rank's rows of checkpoint tensor `src` (part `shard`, whole): weight, bias, or block scales."""
        full, rows, first = self.parts[shard]
        at = self.offsets[shard]
        if param is self.weight_scale_inv:
            bn = self.block_size[0]
            check_shape(src, (num_blocks(full, bn), param.shape[1]), *names)
            blocks = num_blocks(rows, bn)
            _copy(param.data.narrow(0, at // bn, blocks), src.narrow(0, first // bn, blocks))
            return
        check_shape(src, (full, *param.shape[1:]), *names)
        _copy(param.data.narrow(0, at, rows), src.narrow(0, first, rows))


class Fp8RowParallelLinear(Fp8BlockLinear):
    """A row-parallel layer (as RowParallelLinear, reduce_results included) with FP8 block-scaled weights: this
    rank's input columns of `weight` and the matching block columns of `weight_scale_inv`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block_size: tuple[int, int],
                 backend: Fp8LinearBackend | None = None, reduce_results: bool = True,
                 what: str = "an FP8 layer") -> None:  # fmt: skip
        tp = tp_group()
        local = divide(in_features, tp.size, f"the input size of {what}")
        if tp.size > 1 and local % int(block_size[1]):
            raise _fp8_misaligned(what, "input columns", local, in_features, tp.rank * local,
                                  int(block_size[1]), tp)
        super().__init__(local, out_features, bias, block_size, backend)
        self.tp = tp
        self.full_in_features = in_features
        self.reduce_results = reduce_results

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        partial = self.backend.linear(x, self.weight, self.weight_scale_inv, None, self.block_size)
        return _row_parallel_output(partial, self.bias, self.reduce_results, self.tp)

    def load(self, param: nn.Parameter, src: torch.Tensor, names: tuple[str, str], shard: str | None = None) -> None:
        """This rank's input columns of checkpoint tensor `src` (whole): weight or block scales; the bias whole."""
        if param is self.bias:
            check_shape(src, tuple(param.shape), *names)
            _copy(param.data, src)
            return
        local, first = self.in_features, self.tp.rank * self.in_features
        if param is self.weight_scale_inv:
            bn, bk = self.block_size
            check_shape(src, (num_blocks(self.out_features, bn), num_blocks(self.full_in_features, bk)), *names)
            _copy(param.data, src.narrow(1, first // bk, num_blocks(local, bk)))
            return
        check_shape(src, (param.shape[0], self.full_in_features), *names)
        _copy(param.data, src.narrow(1, first, local))
