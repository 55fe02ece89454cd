"""Qwen3-VL (dense: Qwen3-VL-2B ... 32B; MoE: Qwen3-VL-30B-A3B, 235B-A22B): Qwen3's or Qwen3-MoE's text stack with a
vision tower (models/qwen3_vl_vision.py) whose tokens replace the image placeholders' embeddings.

Two things set the text model apart from plain Qwen3:
- DeepStack: the vision tower also yields one feature per early decoder layer; feature k is added to the hidden
  states of the image tokens after decoder layer k.
- Interleaved M-RoPE: every token has a (temporal, height, width) position; rotary frequency j takes its angle from
  the component its slot in the cycle t, h, w, t, h, w, ... names (the h and w slots only within their
  mrope_section's count, t elsewhere). Text tokens have three equal components, which is plain RoPE; image tokens
  get their grid's rows and columns. `mrope_positions` computes a prompt's positions on the host; after the prompt
  every later token's position is (its index + rope_delta) in all three components.

The step interface is LlamaForCausalLM's; a step that carries image tokens passes their embeddings (and DeepStack
features) and its tokens' 3-row positions as keyword arguments. Loads the released checkpoints' layout:
`model.visual.*`, `model.language_model.*`, `lm_head.*`; MoE experts stacked either as transformers keeps them
([E, 2I, H], [E, H, I]) or as the Hub's folders hold them ([E, H, 2I], [E, I, H]).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from flotilla.kernels.attention import AttentionMetadata
from flotilla.models.hf_config import HFModelConfig
from flotilla.models.qwen3 import Qwen3ForCausalLM
from flotilla.models.qwen3_moe import Qwen3MoeForCausalLM
from flotilla.models.qwen3_vl_vision import Qwen3VLVisionModel

_DEFAULT_MROPE_SECTION = (24, 20, 20)
"""transformers' mrope_section when rope_parameters gives none."""
_STACKED_EXPERTS = re.compile(r"^.*\.mlp\.experts\.(?P<proj>gate_up_proj|down_proj)$")


def mrope_positions(input_ids: Sequence[int], image_grid_thw: Sequence[tuple[int, int, int]], spatial_merge_size: int,
                    image_token_id: int, vision_start_token_id: int) -> tuple[np.ndarray, int]:
    """int64 [3, L] (temporal, height, width) positions of a prompt with images, and its rope_delta (the position of
    the token after the prompt minus L): transformers' get_rope_index for image inputs. Each image is a run of
    t * h * w / merge^2 image tokens right after a vision-start token, images in the order of image_grid_thw; its
    tokens take (start + frame, start + row, start + column) and the text after it resumes at start + max(h, w) /
    merge. ValueError when the placeholders do not match the grids."""
    ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
    positions = np.empty((3, ids.size), dtype=np.int64)
    is_image = ids == image_token_id
    grids = list(image_grid_thw)
    done, pos, image = 0, 0, 0  # tokens placed, the next text position, images placed
    while done < ids.size:
        following = np.flatnonzero(is_image[done:])
        text_end = ids.size if following.size == 0 else done + int(following[0])
        positions[:, done:text_end] = np.arange(pos, pos + text_end - done)
        pos += text_end - done
        done = text_end
        if done == ids.size:
            break
        if image >= len(grids):
            raise ValueError(f"the prompt has image tokens beyond its {len(grids)} image(s)")
        if done == 0 or ids[done - 1] != vision_start_token_id:
            raise ValueError(f"image {image}'s tokens at {done} do not follow a vision-start token")
        t, h, w = (int(v) for v in grids[image])
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        n = t * gh * gw
        if done + n > ids.size or not is_image[done:done + n].all() or (done + n < ids.size and is_image[done + n]):
            raise ValueError(f"image {image} (grid {(t, h, w)}) needs exactly {n} image tokens at {done}")
        frame, row, col = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        positions[:, done:done + n] = np.stack((frame, row, col)).reshape(3, n) + pos
        pos += max(h, w) // spatial_merge_size
        done += n
        image += 1
    if image != len(grids):
        raise ValueError(f"the prompt has placeholders for {image} image(s), but {len(grids)} were given")
    return positions, int(positions.max(initial=-1)) + 1 - ids.size


class Qwen3VLMixin:
    """What a Qwen3-VL model adds to its text model class (Qwen3 or Qwen3-MoE): the vision tower, the multimodal
    step and the checkpoint's layout. Set up by `_init_vision` at the end of the subclass's __init__."""

    config: HFModelConfig
    model: torch.nn.Module

    def _init_vision(self, vision_tower: bool) -> None:
        config = self.config
        if config.vision is None:
            raise ValueError("config.json has no vision_config: not a Qwen3-VL checkpoint")
        if config.mrope_section is not None and not config.mrope_interleaved:
            raise ValueError("Qwen3-VL's M-RoPE is interleaved, but config.json's rope_parameters say "
                             "mrope_interleaved: false")
        if config.vision.out_hidden_size != config.hidden_size:
            raise ValueError(f"vision out_hidden_size {config.vision.out_hidden_size} != the text model's hidden_size "
                             f"{config.hidden_size}")
        self.visual = Qwen3VLVisionModel(config.vision) if vision_tower else None
        """None: built without it (image_encoder = remote: a vision encoder of its own makes the embeddings)."""
        self.num_deepstack = len(config.vision.deepstack_visual_indexes)
        """Decoder layers (the first ones) whose output gets a DeepStack feature added at the image tokens."""
        section = config.mrope_section or _DEFAULT_MROPE_SECTION
        half = self.model.rotary_emb.head_dim // 2
        component = [1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
                     for j in range(half)]
        self.mrope_component = tuple(component * 2)
        """Per column of the cos || sin table: the position row (0 t, 1 h, 2 w) its angle follows."""

    @classmethod
    def vision_tower(cls, config: HFModelConfig) -> Qwen3VLVisionTower:
        """The model's vision tower alone (an encoder of its own loads only that part of the checkpoint)."""
        return Qwen3VLVisionTower(config)

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The vision tower: pixel_values [sum t*h*w patches, C * T * P * P] and grid_thw int64 [N, 3] -> the images'
        tokens [n_tokens, hidden] and DeepStack features [n_deepstack, n_tokens, hidden], images in order."""
        if self.visual is None:
            raise RuntimeError("this model was built without its vision tower: a vision encoder of its own makes its "
                               "image embeddings (image_encoder = remote)")
        return self.visual(pixel_values, grid_thw)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, *, mm_embeds: torch.Tensor | None = None,
                mm_index: torch.Tensor | None = None, deepstack: torch.Tensor | None = None,
                mrope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids/positions int64 [T] -> final hidden states [T, hidden], as a text model (positions 1D: t = h = w).
        mm_index int64 [M]: the rows of this step's tokens that are image tokens; mm_embeds [M, hidden] replaces
        their embeddings; deepstack [n, M, hidden]: feature k is added to them after decoder layer k (k < n);
        mrope_positions int64 [3, T]: the tokens' (t, h, w) positions, which then replace `positions`."""
        if mm_embeds is None and deepstack is None and mrope_positions is None:
            return self.model(input_ids, positions, kv_caches, meta)
        if (mm_embeds is not None or deepstack is not None) and mm_index is None:
            raise ValueError("mm_embeds and deepstack need mm_index (the rows they belong to)")
        if deepstack is not None and deepstack.shape[0] > len(self.model.layers):
            raise ValueError(f"{deepstack.shape[0]} DeepStack features for {len(self.model.layers)} decoder layers")
        text = self.model
        hidden = text.embed_tokens(input_ids)
        if mm_embeds is not None:
            hidden = hidden.index_copy(0, mm_index, mm_embeds.to(hidden.dtype))
        cos_sin_cache = text.rotary_emb.cos_sin_cache
        if mrope_positions is not None:
            cos_sin_cache = self._mrope_cos_sin(cos_sin_cache, mrope_positions)
            positions = torch.arange(input_ids.shape[0], device=input_ids.device)
        residual: torch.Tensor | None = None
        for i, (layer, kv_cache) in enumerate(zip(text.layers, kv_caches, strict=True)):
            hidden, residual = layer(hidden, residual, positions, cos_sin_cache, kv_cache, meta)
            if deepstack is not None and i < deepstack.shape[0]:
                # (the layer's output is hidden + residual: the feature joins the residual stream)
                residual = residual.index_add(0, mm_index, deepstack[i].to(residual.dtype))
        hidden, _ = text.norm(hidden, residual)
        return hidden

    def _mrope_cos_sin(self, cos_sin_cache: torch.Tensor, mrope_positions: torch.Tensor) -> torch.Tensor:
        """float32 [T, rotary_dim]: token i's cos || sin row, each column read at the position row it follows (the
        layers then look row i up at position i)."""
        rows = cos_sin_cache[mrope_positions]  # [3, T, rotary_dim]
        component = torch.tensor(self.mrope_component, device=rows.device)
        return rows.gather(0, component.expand(1, *rows.shape[1:])).squeeze(0)

    def _split_weights(self, weights: Iterable[tuple[str, torch.Tensor]], vision: set[str]
                       ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
        """The language model's tensors under the text model's names; vision tensors are loaded on the way (their
        parameters' names added to `vision`)."""
        for name, tensor in weights:
            if name.startswith("model.visual.") and self.visual is None:
                continue
            if name.startswith("model.visual."):
                vision.add("visual." + self.visual.load_tensor(name.removeprefix("model.visual."), tensor))
            else:
                yield _text_name(name), tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's vision tower into `visual`, its language model through the text class's load_weights."""
        vision: set[str] = set()
        loaded = super().load_weights(self._split_weights(weights, vision))  # type: ignore[misc]
        return loaded | vision

    def checkpoint_filter(self) -> Callable[[str], bool]:
        """Without the tower its tensors are not read (and, under expert parallelism, other ranks' experts)."""
        parent = getattr(super(), "checkpoint_filter", None)
        keep = parent() if parent is not None else (lambda name: True)
        if self.visual is not None:
            return keep
        return lambda name: not name.startswith("model.visual.") and keep(name)


class Qwen3VLVisionTower(torch.nn.Module):
    """A Qwen3-VL checkpoint's vision tower without its language model: what a vision encoder of its own runs
    (image_encoder = remote); the checkpoint's `model.visual.` tensors, no others read."""

    def __init__(self, config: HFModelConfig) -> None:
        super().__init__()
        if config.vision is None:
            raise ValueError("config.json has no vision_config: not a Qwen3-VL checkpoint")
        self.config = config
        self.visual = Qwen3VLVisionModel(config.vision)

    encode_images = Qwen3VLMixin.encode_images

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return {"visual." + self.visual.load_tensor(name.removeprefix("model.visual."), tensor)
                for name, tensor in weights if name.startswith("model.visual.")}

    def checkpoint_filter(self) -> Callable[[str], bool]:
        return lambda name: name.startswith("model.visual.")


def _text_name(name: str) -> str:
    """`model.language_model.X` -> the text model's `model.X` (lm_head and the rest unchanged)."""
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name


class Qwen3VLForConditionalGeneration(Qwen3VLMixin, Qwen3ForCausalLM):
    """Qwen3-VL dense: Qwen3's decoder with DeepStack and interleaved M-RoPE, and the vision tower."""

    def __init__(self, config: HFModelConfig, *, attention_backend: str = "auto", fused_ops: str = "auto",
                 vision_tower: bool = True) -> None:  # fmt: skip
        super().__init__(config, attention_backend=attention_backend, fused_ops=fused_ops)
        self._init_vision(vision_tower)


class Qwen3VLMoeForConditionalGeneration(Qwen3VLMixin, Qwen3MoeForCausalLM):
    """Qwen3-VL MoE: Qwen3-MoE's decoder (its router always renormalises the top-k weights) with DeepStack and
    interleaved M-RoPE, and the vision tower."""

    def __init__(self, config: HFModelConfig, *, attention_backend: str = "auto", fused_ops: str = "auto",
                 moe_backend: str = "auto", vision_tower: bool = True) -> None:  # fmt: skip
        if config.moe is not None:
            config = dataclasses.replace(config, moe=dataclasses.replace(config.moe, norm_topk_prob=True))
        super().__init__(config, attention_backend=attention_backend, fused_ops=fused_ops, moe_backend=moe_backend)
        self._init_vision(vision_tower)

    def _split_weights(self, weights: Iterable[tuple[str, torch.Tensor]], vision: set[str]
                       ) -> Iterator[tuple[str, torch.Tensor]]:  # fmt: skip
        """As the dense model's, with stacked experts in the Hub's [E, H, 2I] / [E, I, H] transposed to the stacked
        layout (a tensor already in that layout is kept: transformers' rule)."""
        moe = self.config.moe
        assert moe is not None
        e, h, i = moe.num_experts, self.config.hidden_size, moe.moe_intermediate_size
        for name, tensor in super()._split_weights(weights, vision):
            match = _STACKED_EXPERTS.match(name)
            if match is not None:
                stacked = (e, 2 * i, h) if match["proj"] == "gate_up_proj" else (e, h, i)
                if tensor.shape != stacked:
                    tensor = tensor.transpose(1, 2)
            yield name, tensor

    def checkpoint_filter(self) -> Callable[[str], bool]:
        keep = super().checkpoint_filter()
        return lambda name: keep(_text_name(name))
