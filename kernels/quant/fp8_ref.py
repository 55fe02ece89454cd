"""FP8 (e4m3) block-scaled weights as DeepSeek's checkpoints store them, in torch: the reference.

A weight W [N, K] is cut in blocks of block_n x block_k (128 x 128 in DeepSeek-V3); each block holds
e4m3 values and one float32 `weight_scale_inv` s (the name is DeepSeek's: the factor that *multiplies*
the stored values back), so W[n, k] ~ W_fp8[n, k] * s[n // block_n, k // block_k], the scales being
[ceil(N / block_n), ceil(K / block_k)] (the last row / column of blocks may be partial). Activations are
quantized dynamically per token and group of block_k columns (1 x 128), one float32 scale each.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max
"""448: the largest finite e4m3fn value; a block's amax maps onto it."""
FP8_MAX_INV = 1.0 / FP8_MAX
"""The scale of an activation group is amax times this (a float32 multiply)."""
_MIN_AMAX = 1e-12
"""An all-zero block gets this amax, so its scale is tiny but not zero (no 0/0)."""


def num_blocks(size: int, block: int) -> int:
    """ceil(size / block): blocks along one dim, the last one possibly partial."""
    return -(-size // block)


def block_quantize(weight: torch.Tensor, block_size: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (e4m3 [N, K], float32 scale_inv [ceil(N/bn), ceil(K/bk)]), each
    block scaled so its largest magnitude becomes FP8_MAX."""
    if weight.dim() != 2:
        raise ValueError(f"block_quantize takes a 2-D weight, got shape {tuple(weight.shape)}")
    (n, k), (bn, bk) = weight.shape, block_size
    nb, kb = num_blocks(n, bn), num_blocks(k, bk)
    padded = F.pad(weight.float(), (0, kb * bk - k, 0, nb * bn - n))
    blocks = padded.view(nb, bn, kb, bk)
    scale_inv = blocks.abs().amax(dim=(1, 3)).clamp(min=_MIN_AMAX) / FP8_MAX  # [nb, kb]
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * bn, kb * bk)[:n, :k].contiguous(), scale_inv


def expand_block_scales(scale_inv: torch.Tensor, shape: tuple[int, int], block_size: tuple[int, int]) -> torch.Tensor:
    """scale_inv [ceil(N/bn), ceil(K/bk)] -> one scale per element [N, K] (float32)."""
    (n, k), (bn, bk) = shape, block_size
    want = (num_blocks(n, bn), num_blocks(k, bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv has shape {tuple(scale_inv.shape)}, but a [{n}, {k}] weight in {bn}x{bk} blocks "
                         f"needs {want}")  # fmt: skip
    return scale_inv.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


def block_dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int] = (128, 128),
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """e4m3 weight [N, K] and its block scales -> the weight in `dtype` (the product taken in float32)."""
    scales = expand_block_scales(scale_inv, (weight.shape[0], weight.shape[1]), block_size)
    return (weight.float() * scales).to(dtype)


def dequantize_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], block_size: tuple[int, int],
                          dtype: torch.dtype,
                          fp4: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                          ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
    """A checkpoint's (name, tensor) stream with each e4m3 weight `X` and its block scales `X_scale_inv` (in whichever
    order the two come) turned into one `dtype` weight `X` (stacked [E, N, K] experts block by block per expert);
    other tensors pass as they are. `fp4`: how a weight packed as FP4 in int8 (DeepSeek-V4's experts) dequantizes
    with its scales. A weight or scales left without the other at the end is an error naming them."""
    pending: dict[str, torch.Tensor] = {}  # weight name -> the first of (weight, scales) seen
    packed = (FP8_DTYPE,) if fp4 is None else (FP8_DTYPE, torch.int8)
    for name, tensor in weights:
        is_scale = name.endswith("_scale_inv")
        if not is_scale and tensor.dtype not in packed:
            yield name, tensor
            continue
        weight = name.removesuffix("_scale_inv")
        other = pending.pop(weight, None)
        if other is None:
            pending[weight] = tensor
            continue
        q, scales = (other, tensor) if is_scale else (tensor, other)
        if q.dtype == torch.int8:
            yield weight, fp4(q, scales).to(dtype)  # type: ignore[misc]
        elif q.dim() == 3:
            yield weight, torch.stack([block_dequantize(w, sc, block_size, dtype) for w, sc in zip(q, scales)])
        else:
            yield weight, block_dequantize(q, scales, block_size, dtype)
    if pending:
        shown = ", ".join(sorted(pending)[:4])
        raise ValueError(f"FP8 weights without their block scales (or scales without weights): {shown}")


def per_token_group_quantize(x: torch.Tensor, group_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: x [..., K] -> (e4m3 [..., K], float32 scales [..., ceil(K/group)]),
    one scale per token and group of `group_size` columns (amax x FP8_MAX_INV)."""
    k = x.shape[-1]
    groups = num_blocks(k, group_size)
    padded = F.pad(x.float(), (0, groups * group_size - k)).view(*x.shape[:-1], groups, group_size)
    # times the float32 reciprocal, not / FP8_MAX: torch's CUDA kernels divide by a scalar that way and its CPU ones
    # do not, so written out like this the scales are the same bits on CPU, CUDA and the triton kernel
    scales = padded.abs().amax(dim=-1).clamp(min=_MIN_AMAX) * FP8_MAX_INV
    q = (padded / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(*x.shape[:-1], groups * group_size)[..., :k].contiguous(), scales


def per_token_group_dequantize(q: torch.Tensor, scales: torch.Tensor, group_size: int = 128) -> torch.Tensor:
    """The float32 values per_token_group_quantize's output stands for."""
    k = q.shape[-1]
    return q.float() * scales.float().repeat_interleave(group_size, dim=-1)[..., :k]


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                     block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:  # fmt: skip
    """y = x W^T (+ b), W dequantized into x's dtype first: weight-only, exact up to the matmul (CPU path)."""
    w = block_dequantize(weight, scale_inv, block_size, dtype=x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def fp8_block_linear_w8a8(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                          bias: torch.Tensor | None = None, block_size: tuple[int, int] = (128, 128)) -> torch.Tensor:  # fmt: skip
    """What the FP8 GEMM kernels compute: x quantized per token and group of block_k, both sides
    dequantized, the product in float32, the result in x's dtype (the triton / deep_gemm reference)."""
    q, s = per_token_group_quantize(x, block_size[1])
    y = F.linear(per_token_group_dequantize(q, s, block_size[1]), block_dequantize(weight, scale_inv, block_size))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
