"""Tiny random Qwen3-VL checkpoints (dense and MoE) and the pieces model tests build image prompts from.

write_tiny_qwen3_vl_model() saves a real HF folder through transformers' own classes (fp32, fixed seed), so flotilla's
vision tower and multimodal steps are checked against the reference with identical weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

IMAGE, VIDEO, VISION_START, VISION_END = 300, 301, 302, 303
"""The tiny models' special token ids (inside the 320-token vocabulary; text tokens are drawn below 300)."""
TEXT_VOCAB = 300
MERGE = 2
PATCH_DIM = 3 * 2 * 16 * 16
"""Values per patch: channels x temporal patch x patch x patch."""

_TEXT: dict[str, Any] = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1,
    # head_dim 32: 16 frequencies, t h w interleaved over the first 15, the last one temporal
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[6, 5, 5], mrope_interleaved=True),
)
_VISION: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16, temporal_patch_size=2, spatial_merge_size=MERGE,
    out_hidden_size=64, initializer_range=0.1,
    num_position_embeddings=36,  # a 6 x 6 grid: 4-patch sides shrink it, 8-patch sides stretch it
)
# moe -> (text overrides, vision overrides)
_VARIANTS: dict[bool, tuple[dict[str, Any], dict[str, Any]]] = {
    False: ({}, dict(depth=3, deepstack_visual_indexes=[0, 2])),
    # (hidden 64 and 2 * 48 differ, so a transposed expert tensor cannot pass for the stacked layout)
    True: (dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[1]),
           dict(depth=2, deepstack_visual_indexes=[1])),
}


def write_tiny_qwen3_vl_model(path: str | Path, moe: bool, seed: int = 0) -> Path:
    """Save a tiny random Qwen3-VL (moe: Qwen3-VL-MoE) checkpoint folder at `path`. Norm weights and biases are drawn
    at random (not HF's ones and zeros) so that each matters; the special tokens' lm_head rows are zero, so greedy
    decoding never emits a placeholder."""
    text, vision = _VARIANTS[moe]
    config_cls, model_cls = (("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration") if moe
                             else ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"))
    config = getattr(transformers, config_cls)(
        text_config={**_TEXT, **text}, vision_config={**_VISION, **vision}, image_token_id=IMAGE,
        video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            elif name.startswith("model.visual.") and name.endswith("bias"):
                p.normal_(0.0, 0.1)
        model.lm_head.weight[TEXT_VOCAB:] = 0.0
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf_vl_model(path: str | Path) -> nn.Module:
    """The transformers reference of a checkpoint folder written above, fp32, eval mode."""
    config = transformers.AutoConfig.from_pretrained(path)
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def image_tokens(grid: tuple[int, int, int]) -> list[int]:
    """An image's placeholder tokens, between its vision start and end tokens."""
    t, h, w = grid
    return [VISION_START] + [IMAGE] * (t * h * w // MERGE**2) + [VISION_END]


def prompt(*parts: list[int] | tuple[int, int, int]) -> list[int]:
    """Token ids from parts: a list is text, a (t, h, w) tuple an image's placeholders."""
    return [tok for part in parts for tok in (image_tokens(part) if isinstance(part, tuple) else part)]


def random_pixels(grids: list[tuple[int, int, int]], seed: int = 0) -> torch.Tensor:
    """float32 [sum t*h*w, PATCH_DIM]: random patches for images of these grids."""
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, PATCH_DIM, generator=torch.Generator().manual_seed(seed))


def hf_inputs(token_ids: list[int], pixel_values: torch.Tensor | None,
              grids: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:  # fmt: skip
    """transformers' forward / generate keyword arguments for one sequence with its images."""
    ids = torch.tensor([token_ids])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if grids:
        inputs |= {"pixel_values": pixel_values, "image_grid_thw": torch.tensor(grids),
                   "mm_token_type_ids": (ids == IMAGE).int()}
    return inputs


@torch.inference_mode()
def hf_vl_logits(hf_model: nn.Module, token_ids: list[int], pixel_values: torch.Tensor | None,
                 grids: list[tuple[int, int, int]]) -> torch.Tensor:  # fmt: skip
    """float32 [len, vocab]: the reference logits of every position of one sequence with its images."""
    return hf_model(**hf_inputs(token_ids, pixel_values, grids)).logits[0].float()
