"""Qwen3-VL's vision tower in plain torch: patches -> merged image tokens for the language model, plus the DeepStack
features that the first decoder layers add to those tokens' hidden states.

- Patch embedding: HF's Conv3d with kernel = stride = (temporal_patch, patch, patch) over one patch's pixels is a
  linear map of the flattened patch, so it runs as one GEMM (the checkpoint's 5D kernel is flattened at load).
- Learned absolute positions: a square grid of embeddings, bilinearly resampled (align_corners) to each image's
  patch grid, added to the patch embeddings.
- Blocks: pre-LayerNorm attention and GELU MLP; 2D rotary embedding (the first half of the rotated dims follow the
  patch's row, the second its column); full, non-causal attention within each frame of each image.
- Patches arrive in merge-block order (each merge x merge square contiguous), so the merger folds them into one
  token by a reshape: LayerNorm -> Linear -> GELU -> Linear to the language model's width. Each DeepStack merger
  does the same to the output of its block (with its LayerNorm after the fold).
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.kernels.rope import apply_rope
from flotilla.models.hf_config import VisionConfig
from flotilla.models.llama import Linear

_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = Linear(dim, 3 * dim, bias=True)
        self.proj = Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        """x [N, dim], cos_sin [N, head_dim] (each patch's rotary table row), cu_seqlens: the frames' boundaries."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rope(torch.arange(n, device=x.device), q, k, cos_sin)
        out = torch.empty_like(q)
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
            # [1, heads, len, head_dim]: 4-D, so that on a GPU SDPA takes a fused kernel (flash or memory-efficient)
            # rather than the math one, whose [heads, len, len] scores a large image could not hold
            seg = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
            out[start:end] = F.scaled_dot_product_attention(*seg)[0].transpose(0, 1)
        return self.proj(out.view(n, -1))


class VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {act!r}; supported: {', '.join(_ACTIVATIONS)}")
        self.linear_fc1 = Linear(dim, hidden, bias=True)
        self.linear_fc2 = Linear(hidden, dim, bias=True)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=1e-6)
        self.attn = VisionAttention(config.hidden_size, config.num_heads)
        self.mlp = VisionMLP(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos_sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """merge x merge patches -> one token of out_hidden_size; the LayerNorm runs before the fold (the final merger)
    or after it (DeepStack's, `postshuffle_norm`)."""

    def __init__(self, config: VisionConfig, postshuffle_norm: bool) -> None:
        super().__init__()
        self.folded = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.folded if postshuffle_norm else config.hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.folded, self.folded, bias=True)
        self.linear_fc2 = Linear(self.folded, config.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.folded)) if self.postshuffle_norm else self.norm(x).view(-1, self.folded)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size**2
        self.proj = Linear(self.patch_dim, config.hidden_size, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.proj(pixels.to(self.proj.weight.dtype))


class Qwen3VLVisionModel(nn.Module):
    """HF's Qwen3VLVisionModel (`model.visual.*`); forward(pixel_values, grid_thw) -> (embeds, deepstack)."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        if config.hidden_size % config.num_heads or (config.hidden_size // config.num_heads) % 4:
            raise ValueError(f"vision hidden_size {config.hidden_size} / num_heads {config.num_heads} must be a "
                             "multiple of 4 (the 2D rotary embedding's halves)")
        self.config = config
        self.merge = config.spatial_merge_size
        self.side = int(config.num_position_embeddings**0.5)
        """The learned position grid is side x side."""
        self.head_dim = config.hidden_size // config.num_heads
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size,
                                      _weight=torch.empty(config.num_position_embeddings, config.hidden_size))
        self.pos_embed.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, postshuffle_norm=False)
        self.deepstack_visual_indexes = config.deepstack_visual_indexes
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(config, postshuffle_norm=True)
                                                   for _ in config.deepstack_visual_indexes)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """pixel_values [sum t*h*w, C * T * P * P] (each image's patches in merge-block order, as the HF processor
        emits them), grid_thw int64 [N, 3] -> merged tokens [sum t*h*w / merge^2, out_hidden] and the DeepStack
        features [len(deepstack_visual_indexes), same tokens, out_hidden], images in order."""
        grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        expected = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape != (expected, self.patch_embed.patch_dim):
            raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; grid_thw {grids} needs "
                             f"({expected}, {self.patch_embed.patch_dim})")
        if any(h % self.merge or w % self.merge for _, h, w in grids):
            raise ValueError(f"image grids {grids} are not multiples of spatial_merge_size {self.merge}")
        x = self.patch_embed(pixel_values)
        x = x + self._position_embeddings(grids).to(x.dtype)
        cos_sin = self._rotary_table(grids, x.device)
        frames = [h * w for t, h, w in grids for _ in range(t)]
        cu_seqlens = [0, *itertools.accumulate(frames)]
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos_sin, cu_seqlens)
            if i in self.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.deepstack_visual_indexes.index(i)](x))
        embeds = self.merger(x)
        stacked = torch.stack(deepstack) if deepstack else embeds.new_empty((0, *embeds.shape))
        return embeds, stacked

    def _block_order(self, grid: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[h, w, ...] in raster order -> [h * w, ...] in merge-block order."""
        m = self.merge
        return grid.reshape(h // m, m, w // m, m, *grid.shape[2:]).transpose(1, 2).reshape(h * w, *grid.shape[2:])

    def _position_embeddings(self, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """float32 [sum t*h*w, hidden]: the learned grid resampled bilinearly (align_corners) to each image's."""
        table = self.pos_embed.weight
        out = []
        for t, h, w in grids:
            rows, row_weights = _bilinear_taps(h, self.side, table.device)
            cols, col_weights = _bilinear_taps(w, self.side, table.device)
            index = (rows[:, None, :, None] * self.side + cols[None, :, None, :]).reshape(h, w, 4)
            weight = (row_weights[:, None, :, None] * col_weights[None, :, None, :]).reshape(h, w, 4)
            embed = (F.embedding(index, table) * weight[..., None]).sum(2)
            out.append(self._block_order(embed, h, w).repeat(t, 1))
        return torch.cat(out)

    def _rotary_table(self, grids: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        """float32 [sum t*h*w, head_dim]: each patch's cos || sin, a quarter of the dims' angles from its row and a
        quarter from its column (apply_rope's table layout, one row per patch)."""
        half = self.head_dim // 2
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=device) / half))
        positions = []
        for t, h, w in grids:
            rows = torch.arange(h, device=device)[:, None].expand(h, w)
            cols = torch.arange(w, device=device)[None, :].expand(h, w)
            positions.append(self._block_order(torch.stack((rows, cols), dim=-1), h, w).repeat(t, 1))
        freqs = (torch.cat(positions)[..., None].float() * inv_freq).flatten(1)  # [N, (row, col) x head_dim / 4]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def load_tensor(self, name: str, tensor: torch.Tensor) -> str:
        """Copy checkpoint tensor `name` (relative to `model.visual.`) into its parameter; returns that parameter's
        name under this module. ValueError naming it on an unknown name or a shape mismatch."""
        params = dict(self.named_parameters())
        if name not in params:
            raise ValueError(f"checkpoint tensor 'model.visual.{name}' matches no parameter of the vision tower")
        param = params[name]
        if name == "patch_embed.proj.weight":  # the Conv3d kernel [out, C, T, P, P] as the GEMM's [out, C*T*P*P]
            tensor = tensor.reshape(tensor.shape[0], -1)
        if tensor.shape != param.shape:
            raise ValueError(f"checkpoint tensor 'model.visual.{name}' has shape {tuple(tensor.shape)} but the "
                             f"vision tower expects {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
        return name


def _bilinear_taps(size: int, side: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of `size` target positions on one axis: the two source rows of a `side`-long table that
    align_corners bilinear interpolation reads ([size, 2], clamped to the table) and their float32 weights."""
    index = torch.arange(size, dtype=torch.float32, device=device)
    src = index * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights
