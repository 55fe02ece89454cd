"""The linear-layer factory of models whose checkpoints may carry FP8 block-scaled weights (DeepSeek-V3 / Kimi-K2):
one place decides, per layer, between float and FP8, and between replicated, column- and row-parallel."""

from __future__ import annotations

from torch import nn

from flotilla.kernels.quant import Fp8LinearBackend
from flotilla.kernels.quant.fp8_linear import Fp8BlockLinear
from flotilla.models.llama import Linear
from flotilla.models.parallel import (
    ColumnParallelLinear,
    Fp8ColumnParallelLinear,
    Fp8RowParallelLinear,
    RowParallelLinear,
    divide,
    tp_group,
)


class Linears:
    """Builds this tensor-parallel rank's linear layers: replicated, column-parallel (its rows: heads, or an
    MLP's intermediate slice) or row-parallel (the matching input columns); FP8 block-scaled ones
    (kernels/quant) when `block_size` is set, else float (models/parallel.py). With one rank, the plain layers."""

    def __init__(self, block_size: tuple[int, int] | None = None, backend: Fp8LinearBackend | None = None) -> None:
        self.block_size = block_size
        self.backend = backend

    def replicated(self, in_features: int, out_features: int, bias: bool = False) -> nn.Module:
        """Every rank keeps the whole layer (the latent projections: per token, not per head)."""
        if self.block_size is None:
            return Linear(in_features, out_features, bias)
        return Fp8BlockLinear(in_features, out_features, bias, self.block_size, self.backend)

    def can_fuse(self, part_sizes: dict[str, int]) -> bool:
        """Whether parts (shard id -> rows) can stack into one layer: always for float weights; with FP8 ones every
        part but the last must be whole weight blocks of rows, since a block's scale covers one part's rows only
        (the last may end on a partial block, as the tensor does)."""
        if self.block_size is None:
            return True
        return all(rows % self.block_size[0] == 0 for rows in list(part_sizes.values())[:-1])

    def replicated_fused(self, in_features: int, part_sizes: dict[str, int], what: str,
                         bias: bool = False) -> nn.Module:  # fmt: skip
        """Parts (shard id -> rows) stacked along the output dim into one layer that every rank keeps whole (DeepSeek's
        q_a and kv_a latent projections: one GEMM, one activation quantization, instead of two); loads like a
        column-parallel layer whose every rank takes all rows. FP8 parts must pass `can_fuse`."""
        parts = {shard: (full, full, 0) for shard, full in part_sizes.items()}
        if self.block_size is None:
            return ColumnParallelLinear(in_features, parts, bias)
        return Fp8ColumnParallelLinear(in_features, parts, bias, self.block_size, self.backend, what)

    def column(self, in_features: int, part_sizes: dict[str, int], what: str, bias: bool = False,
               quantized: bool = True) -> nn.Module:  # fmt: skip
        """Output rows fused from parts (shard id -> rows), each split evenly over the ranks; `quantized=False`
        makes a float layer even in an FP8 model (kv_b_proj, dequantized at load)."""
        tp = tp_group()
        parts = {}
        for shard, full in part_sizes.items():
            rows = divide(full, tp.size, f"the output size of {what}")
            parts[shard] = (full, rows, tp.rank * rows)
        if self.block_size is None or not quantized:
            return ColumnParallelLinear(in_features, parts, bias)
        return Fp8ColumnParallelLinear(in_features, parts, bias, self.block_size, self.backend, what)

    def row(self, in_features: int, out_features: int, what: str, bias: bool = False,
            reduce_results: bool = True) -> nn.Module:  # fmt: skip
        """Input columns split over the ranks; the partial products summed by one all-reduce, or left to the
        caller's (reduce_results=False)."""
        if self.block_size is None:
            return RowParallelLinear(in_features, out_features, bias, reduce_results)
        return Fp8RowParallelLinear(in_features, out_features, bias, self.block_size, self.backend, reduce_results,
                                    what)  # fmt: skip
