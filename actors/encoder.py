"""Images into the prefill, worker side: the vision tower's embeddings for a step's image tokens, and M-RoPE positions.

ImageEncoder decodes and preprocesses a sequence's images with the model folder's image processor, runs the
model's vision tower (``encode_images``) once per image, and keeps the embeddings (with the deepstack features)
by content hash, so that each prefill chunk takes its rows of them and a preempted or repeated image is not
encoded again. ``step_inputs`` turns a step's sequences into the model's multimodal keyword arguments: which rows
of the step are image tokens, their embeddings, and the 3-D rotary positions of the chunks that hold images.

Text after an image continues from the image's largest extent, so every later position of a sequence (the rest of
its prompt, every decode step) is its index plus the sequence's ``rope_delta``.
"""

from __future__ import annotations

import io
import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from flotilla.actors.images import load_image_processor
from flotilla.transport.messages import ImageItem

CACHE_TOKENS = 32768
"""Image tokens whose embeddings the encoder keeps (least recently used beyond)."""


@dataclass
class SeqImages:
    """A sequence's images as the worker holds them."""

    items: list[ImageItem]
    mrope: np.ndarray
    """int64 [3, prompt length]: the prompt's (t, h, w) rotary positions."""
    rope_delta: int
    """Position of every token after the prompt's images minus its index."""

    @property
    def end(self) -> int:
        """Index just past the last image token: tokens from here on are at index + rope_delta."""
        last = self.items[-1]
        return last.offset + last.length

    def positions(self, start: int, n: int) -> np.ndarray:
        """int64 [3, n]: the rotary positions of tokens start .. start + n."""
        p = self.mrope.shape[1]
        if start + n <= p:
            return self.mrope[:, start:start + n]
        tail = np.arange(max(start, p), start + n, dtype=np.int64) + self.rope_delta
        head = self.mrope[:, start:p] if start < p else np.empty((3, 0), dtype=np.int64)
        return np.concatenate((head, np.broadcast_to(tail, (3, len(tail)))), axis=1)


def unique_images(items: Sequence[ImageItem]) -> list[ImageItem]:
    """Each image once (by content hash), in order of first appearance."""
    return list({it.hash: it for it in items}.values())


class ImageEncoder:
    """The vision tower of a model that takes images, with its embeddings cached by image content hash.

    The worker's step thread reads the cache (embeddings); an encoder actor's thread may fill it beforehand
    (prepare), on a CUDA stream of its own, and pins what it made for a request until release(rid): a lock keeps the
    two apart, and a reader waits on the event of the stream that wrote an entry.
    """

    def __init__(self, model: Any, path: Path, device: torch.device, dtype: torch.dtype,
                 cache_tokens: int = CACHE_TOKENS) -> None:
        self.model = model
        self.processor = load_image_processor(path)
        self.device, self.dtype = device, dtype
        self.cache_tokens = cache_tokens
        self._cache: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = OrderedDict()
        self._cached_tokens = 0
        self._pins: dict[str, list[bytes]] = {}  # request -> the images prepare() holds for it
        self._pinned: Counter[bytes] = Counter()
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        vision = model.config.vision
        self.spatial_merge_size = vision.spatial_merge_size
        self.image_token_id = vision.image_token_id
        self.vision_start_token_id = vision.vision_start_token_id

    def sequence(self, token_ids: np.ndarray, num_prompt_tokens: int, items: list[ImageItem]) -> SeqImages:
        """A new sequence's image state: its prompt's rotary positions and rope delta."""
        from flotilla.models.qwen3_vl import mrope_positions

        pos, delta = mrope_positions(token_ids[:num_prompt_tokens].tolist(), [it.grid for it in items],
                                     self.spatial_merge_size, self.image_token_id, self.vision_start_token_id)
        return SeqImages(items, np.asarray(pos, dtype=np.int64), int(delta))

    def embeddings(self, items: Sequence[ImageItem]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each image's (embeddings [n, hidden], deepstack [layers, n, hidden]), encoding those not cached; on the
        caller's stream, after whatever stream wrote them."""
        with self._lock:
            missing = unique_images([it for it in items if it.hash not in self._cache])
            if missing:
                self._insert(missing, *self._encode(missing))
            out = []
            for it in items:
                self._cache.move_to_end(it.hash)
                embeds, deepstack, written = self._cache[it.hash]
                if written is not None:  # (made on the encoder's stream: read on this one, freed after it)
                    here = torch.cuda.current_stream(self.device)
                    here.wait_event(written)
                    embeds.record_stream(here)
                    deepstack.record_stream(here)
                out.append((embeds, deepstack))
            return out

    def prepare(self, rid: str, items: Sequence[ImageItem]) -> None:
        """Encode a request's images ahead of its prefill (the encoder actor's thread, while steps run) and pin them
        for it until release(rid)."""
        with self._lock:
            self._pins.setdefault(rid, []).extend(it.hash for it in items)
            self._pinned.update(it.hash for it in items)
            missing = unique_images([it for it in items if it.hash not in self._cache])
        if not missing:
            return
        if self._stream is None:
            made = self._encode(missing)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                made = self._encode(missing, self._stream)
        with self._lock:
            self._insert(missing, *made)

    def rows(self, items: Sequence[ImageItem]) -> torch.Tensor:
        """The images' embeddings as one tensor, a row per token: [tokens, 1 + DeepStack layers, hidden], each row the
        token's embedding then its DeepStack features (what a vision encoder of its own stages for the workers)."""
        return torch.cat([torch.cat((e.unsqueeze(1), d.transpose(0, 1)), dim=1) for e, d in self.embeddings(items)])

    def put(self, rid: str, items: Sequence[ImageItem], rows: Sequence[torch.Tensor]) -> None:
        """Keep embeddings made elsewhere, rows [tokens, 1 + layers, hidden] per image (`rows` for the same items),
        and pin them for a request until release(rid), as prepare() does."""
        with self._lock:
            self._pins.setdefault(rid, []).extend(it.hash for it in items)
            self._pinned.update(it.hash for it in items)
            for it, r in zip(items, rows, strict=True):
                if it.hash not in self._cache:
                    self._insert([it], r[:, 0].contiguous(), r[:, 1:].transpose(0, 1).contiguous(), None)

    def release(self, rid: str) -> None:
        """Unpin what prepare() held for a request (its sequence left the worker, or it was aborted first)."""
        with self._lock:
            for h in self._pins.pop(rid, ()):
                self._pinned[h] -= 1
                if self._pinned[h] <= 0:
                    del self._pinned[h]
            self._evict()

    @property
    def num_pinned(self) -> int:
        """Requests whose images prepare() holds."""
        return len(self._pins)

    @torch.inference_mode()
    def profile(self) -> int:
        """Run the tower on the largest image the processor makes (random pixels), for the KV budget's profiling
        run to see its peak; returns the bytes the embeddings cache may come to hold (all a model built without its
        tower, whose embeddings a vision encoder of its own makes, needs)."""
        vision = self.model.config.vision
        per_token = (1 + len(vision.deepstack_visual_indexes)) * vision.out_hidden_size * self.dtype.itemsize
        if getattr(self.model, "visual", True) is None:
            return per_token * self.cache_tokens
        p = self.processor
        factor = p.patch_size * p.merge_size
        size = p.size
        longest = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
        side = max(factor, int(math.isqrt(int(longest or factor * factor)) // factor * factor))
        grid = torch.tensor([[1, side // p.patch_size, side // p.patch_size]], dtype=torch.int64, device=self.device)
        width = 3 * p.temporal_patch_size * p.patch_size**2
        pixels = torch.randn(int(grid.prod()), width, device=self.device, dtype=self.dtype)
        self.model.encode_images(pixels, grid)
        return per_token * self.cache_tokens

    @torch.inference_mode()
    def _encode(self, items: list[ImageItem], stream: torch.cuda.Stream | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:
        """Decode, preprocess and encode images: (embeddings, deepstack, the event after them on `stream`)."""
        images = [Image.open(io.BytesIO(it.data)).convert("RGB") for it in items]
        batch = self.processor(images=images, return_tensors="np")
        grid = torch.as_tensor(np.asarray(batch["image_grid_thw"]), dtype=torch.int64)
        if [tuple(g) for g in grid.tolist()] != [tuple(it.grid) for it in items]:
            raise RuntimeError("the image processor cut an image into another grid than the tokenizer counted")
        pixels = torch.from_numpy(np.asarray(batch["pixel_values"])).to(self.device, self.dtype)
        embeds, deepstack = self.model.encode_images(pixels, grid.to(self.device))
        written = None
        if stream is not None:
            written = torch.cuda.Event()
            written.record(stream)
        return embeds, deepstack, written

    def _insert(self, items: list[ImageItem], embeds: torch.Tensor, deepstack: torch.Tensor,
                written: torch.cuda.Event | None) -> None:
        at = 0
        for it in items:
            if it.hash not in self._cache:
                self._cache[it.hash] = (embeds[at:at + it.length], deepstack[:, at:at + it.length], written)
                self._cached_tokens += it.length
            at += it.length
        self._evict(keep=len(items))

    def _evict(self, keep: int = 0) -> None:
        """Drop the least recently used unpinned entries while over the cache's size (the newest `keep` stay)."""
        for h in list(self._cache)[:max(len(self._cache) - keep, 0)]:
            if self._cached_tokens <= self.cache_tokens:
                break
            if h not in self._pinned:
                self._cached_tokens -= self._cache.pop(h)[0].shape[0]

    def step_inputs(self, images: Sequence[SeqImages | None], cached: Sequence[int],
                    num_new: Sequence[int]) -> dict[str, torch.Tensor] | None:
        """The model's multimodal keyword arguments for a step; None when every chunk of it lies past its
        sequence's images (1-D positions shifted by rope_delta then hold). mrope_positions [3, T] covers every row
        (1-D positions, repeated, for the sequences without images); mm_index [M] (rows of the step), mm_embeds
        [M, hidden] and deepstack [layers, M, hidden] come when some chunk holds image tokens."""
        if not any(seq is not None and c < seq.end for seq, c in zip(images, cached)):
            return None
        rows: list[np.ndarray] = []
        embeds: list[torch.Tensor] = []
        stacks: list[torch.Tensor] = []
        at = 0
        for seq, c, n in zip(images, cached, num_new):
            if seq is not None:
                hit = [it for it in seq.items if it.offset < c + n and c < it.offset + it.length]
                for it, (e, d) in zip(hit, self.embeddings(hit)):
                    lo, hi = max(c, it.offset), min(c + n, it.offset + it.length)
                    rows.append(np.arange(at + lo - c, at + hi - c, dtype=np.int64))
                    embeds.append(e[lo - it.offset:hi - it.offset])
                    stacks.append(d[:, lo - it.offset:hi - it.offset])
            at += n
        positions = np.concatenate([
            np.broadcast_to(np.arange(c, c + n, dtype=np.int64), (3, n)) if seq is None else seq.positions(c, n)
            for seq, c, n in zip(images, cached, num_new)], axis=1)
        out = {"mrope_positions": torch.from_numpy(np.ascontiguousarray(positions)).to(self.device)}
        if rows:
            out.update(mm_index=torch.from_numpy(np.concatenate(rows)).to(self.device),
                       mm_embeds=torch.cat(embeds), deepstack=torch.cat(stacks, dim=1))
        return out
