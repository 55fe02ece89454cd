"""A chat prompt's images, tokenizer side: each image checked (Pillow decodes it), its patch grid computed from its
size, the template's one placeholder per image expanded to the image's token count, and its content hashed.

Only the geometry is computed here: the pixels are resized, normalised and encoded where the vision tower runs
(actors/encoder.py), so the control plane carries the compressed file, not megabytes of float patches. The
grid comes from the model folder's own image processor (transformers' Qwen2-VL processor, Pillow backend: its
video sibling needs torchvision, which the engine does not), the same object the encoder preprocesses with, so
both agree on every image's token count.
"""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from flotilla.transport.messages import ImageData, ImageItem

MAX_IMAGE_PIXELS = 64 * 2**20
"""Largest image accepted, in pixels before resizing (8192 x 8192): a decompression bomb is refused unread."""


class ImageError(ValueError):
    """An image the engine refuses; names where the request held it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def load_image_processor(path: Path) -> Any:
    """The model folder's image processor, on Pillow (no torchvision)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(path), backend="pil")


def open_image(data: bytes, param: str) -> Image.Image:
    """The decoded RGB image; ImageError for anything that is not a whole image within MAX_IMAGE_PIXELS."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise ImageError(f"Invalid '{param}': the image has {img.width} x {img.height} pixels, more than the "
                                 f"{MAX_IMAGE_PIXELS} taken.", param)
            img.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"Invalid '{param}': the image has more pixels than the {MAX_IMAGE_PIXELS} taken.",
                         param) from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:  # not an image, truncated, corrupt
        raise ImageError(f"Invalid '{param}': the image could not be decoded ({e}).", param) from None
    if img.width < 1 or img.height < 1:
        raise ImageError(f"Invalid '{param}': the image is empty.", param)
    return img if img.mode == "RGB" else img.convert("RGB")


class ImagePrompt:
    """Expands a rendered chat prompt's image placeholders for one model folder."""

    def __init__(self, path: Path) -> None:
        hf = json.loads((path / "config.json").read_text())
        vision = hf.get("vision_config") or {}
        self.image_token_id = int(hf["image_token_id"])
        self.processor = load_image_processor(path)
        p = self.processor
        self.patch_size = int(getattr(p, "patch_size", None) or vision.get("patch_size", 16))
        self.merge_size = int(getattr(p, "merge_size", None) or vision.get("spatial_merge_size", 2))
        size = p.size
        edge = (lambda k: size.get(k)) if isinstance(size, dict) else (lambda k: getattr(size, k, None))
        self.min_pixels = int(edge("shortest_edge") or getattr(p, "min_pixels", None) or 56 * 56)
        self.max_pixels = int(edge("longest_edge") or getattr(p, "max_pixels", None) or 28 * 28 * 1280)

    def grid(self, img: Image.Image, param: str) -> tuple[int, int, int]:
        """(t, h, w) patches of the image as the processor resizes it (a still image is one temporal patch)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        try:
            h, w = smart_resize(img.height, img.width, factor=self.patch_size * self.merge_size,
                                min_pixels=self.min_pixels, max_pixels=self.max_pixels)
        except ValueError as e:  # an aspect ratio beyond 200:1
            raise ImageError(f"Invalid '{param}': {e}.", param) from None
        return 1, h // self.patch_size, w // self.patch_size

    def expand(self, ids: Sequence[int], images: Sequence[ImageData]) -> tuple[np.ndarray, list[ImageItem]]:
        """The prompt with each image's placeholder repeated to its token count, and the images' items."""
        ids = np.asarray(ids, dtype=np.int32)
        at = np.flatnonzero(ids == self.image_token_id)
        if len(at) != len(images):
            raise ImageError(f"the chat template placed {len(at)} image placeholders for {len(images)} images; this "
                             "model's template must render each image part", images[0].param if images else "messages")
        pieces: list[np.ndarray] = []
        items: list[ImageItem] = []
        start = length = 0
        for where, image in zip(at.tolist(), images, strict=True):
            grid = self.grid(open_image(image.data, image.param), image.param)
            n = grid[0] * grid[1] * grid[2] // self.merge_size**2
            pieces.append(ids[start:where])
            length += where - start
            items.append(ImageItem(data=image.data, hash=hashlib.blake2b(image.data, digest_size=16).digest(),
                                   offset=length, length=n, grid=grid))
            pieces.append(np.full(n, self.image_token_id, dtype=np.int32))
            length += n
            start = where + 1
        pieces.append(ids[start:])
        return np.concatenate(pieces), items
