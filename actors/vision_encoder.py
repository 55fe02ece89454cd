"""VisionEncoderActor: a model's vision tower in a process of its own (worker.image_encoder = remote), the E of
encoder-prefill-decode disaggregation.

It loads only the checkpoint's vision tower (on image_encoder_device: a GPU of its own, or the worker's) and serves
the workers' encoder actors (actors/encoder_actor.py): each EmbedImagesRequest's images are decoded, preprocessed
and encoded (cached by content hash, so the tensor-parallel ranks asking for the same request's images cost one
run), and each image's rows are copied into a staging region registered with the KV data plane
(kv_transfer_backend: dlslime_tcp between processes or hosts, host memory; local within one process). The answer,
ImageEmbeddingsEvent per image, says where its rows lie; the asking encoder reads them with a one-sided read and
gives the rows back (ImageEmbeddingsReleased). Embeddings never cross the ZeroMQ control plane.

Images go one at a time through the staging region, so it need only hold the largest image the processor makes
(or STAGING_TOKENS rows, if more); an image waits for room while earlier ones are being read. Rows a reader never
gave back (it died) are taken back after twice the data plane's timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time

import torch

from flotilla.actors.base import Actor, ActorContext
from flotilla.actors.encoder import ImageEncoder, unique_images
from flotilla.actors.model_runner import resolve_device
from flotilla.config import EngineConfig
from flotilla.models.loader import load_model
from flotilla.transport.kv_transfer import create_kv_transfer_engine
from flotilla.transport.messages import EmbedImagesRequest, ImageEmbeddingsEvent, ImageEmbeddingsReleased

log = logging.getLogger(__name__)

STAGING_TOKENS = 4096
"""Image tokens the staging region holds at least (more when the processor's largest image has more)."""
REGION = "image_embeddings"


def staging_backend_options(config: EngineConfig) -> dict:
    """The transfer engine's constructor options for the configured backend (both ends of the embeddings' path)."""
    disagg = config.disagg
    options: dict = {"timeout_s": disagg.kv_transfer_timeout_s}
    if disagg.kv_transfer_backend == "dlslime_tcp":
        options["host"] = disagg.kv_host
    return options


def host_buffer(n: int, device: torch.device) -> torch.Tensor:
    """n bytes of host memory a network backend reads, pinned when a GPU copies to or from it."""
    return torch.empty(n, dtype=torch.uint8, pin_memory=device.type == "cuda")


async def stop_serving(task: asyncio.Task | None, transfer) -> None:
    """An encoder's teardown: its serving task cancelled, its data plane closed."""
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    if transfer is not None:
        transfer.close()


class RowSpace:
    """First-fit allocation of runs of rows in the staging region."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._taken: dict[int, int] = {}  # start -> length

    def take(self, n: int) -> int | None:
        """The start of n free consecutive rows, now taken; None when no run is long enough."""
        at = 0
        for start, length in sorted(self._taken.items()):
            if start - at >= n:
                break
            at = start + length
        if at + n > self.rows:
            return None
        self._taken[at] = n
        return at

    def give(self, start: int) -> None:
        self._taken.pop(start, None)

    @property
    def used(self) -> int:
        return sum(self._taken.values())


class VisionEncoderActor(Actor):
    """The vision tower alone, serving the workers' encoder actors over the data plane."""

    kind = "vision_encoder"
    inbox = (EmbedImagesRequest, ImageEmbeddingsReleased)

    def __init__(self, ctx: ActorContext, zmq_ctx) -> None:
        super().__init__(ctx, zmq_ctx)
        self.config = EngineConfig.from_dict(ctx.config["engine"])
        self.encoder: ImageEncoder | None = None
        self.transfer = None
        self._queue: asyncio.Queue[EmbedImagesRequest] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._leases: dict[int, tuple[int, float]] = {}  # lease -> (first row, when given out)
        self._lease_ids = itertools.count(1)
        self._room = asyncio.Event()
        self.images_served = 0
        """Images whose rows were staged for a reader."""

    async def setup(self) -> dict[str, str]:
        worker = self.config.worker
        device = resolve_device(worker.image_encoder_device or worker.device)
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        options = staging_backend_options(self.config)
        loaded = await asyncio.to_thread(load_model, self.config.model.model, dtype=self.config.model.dtype,
                                         device=device, load_format=self.config.model.load_format, vision_only=True)
        self.encoder = ImageEncoder(loaded.module, loaded.model_dir, device, loaded.dtype)
        vision = loaded.config.vision
        self.layers, self.hidden = len(vision.deepstack_visual_indexes), vision.out_hidden_size
        self.dtype = loaded.dtype
        processor = self.encoder.processor
        factor = processor.patch_size * processor.merge_size
        size = processor.size
        longest = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
        largest = math.ceil(int(longest or 0) / factor**2)
        row_bytes = (1 + self.layers) * self.hidden * self.dtype.itemsize
        self.space = RowSpace(max(STAGING_TOKENS, largest))
        self.transfer = create_kv_transfer_engine(self.config.disagg.kv_transfer_backend, **options)
        on_host = self.transfer.backend != "local"
        staging = (host_buffer(self.space.rows * row_bytes, device) if on_host else
                   torch.empty(self.space.rows * row_bytes, dtype=torch.uint8, device=device))
        self.staging = staging.view(self.dtype).view(self.space.rows, 1 + self.layers, self.hidden)
        self.region = self.transfer.register(REGION, staging)
        self._task = asyncio.create_task(self._serve())
        return {"model": loaded.model_dir.name, "device": str(device), "staging": f"{self.space.rows} tokens",
                "data plane": self.transfer.backend}

    async def teardown(self) -> None:
        await stop_serving(self._task, self.transfer)

    async def on_embed_images_request(self, req: EmbedImagesRequest) -> None:
        self._queue.put_nowait(req)

    async def on_image_embeddings_released(self, msg: ImageEmbeddingsReleased) -> None:
        held = self._leases.pop(msg.lease, None)
        if held is not None:
            self.space.give(held[0])
            self._room.set()

    async def _serve(self) -> None:
        while True:
            req = await self._queue.get()
            images = unique_images(req.images)
            try:
                rows = await asyncio.to_thread(self.encoder.rows, images)
            except Exception as e:  # noqa: BLE001 (the request fails with the reason; the encoder serves on)
                log.exception("%s: encoding the images of %s failed", self.label, req.rid)
                await self.send_to(req.reply_to, ImageEmbeddingsEvent(
                    rid=req.rid, sender=self.address, error=f"encoding its images failed: {type(e).__name__}: {e}"))
                continue
            at = 0
            for image in images:
                await self._stage(req, rows[at:at + image.length])
                at += image.length

    async def _stage(self, req: EmbedImagesRequest, rows: torch.Tensor) -> None:
        """Copy one image's rows into the staging region (waiting for room) and tell the reader where they are."""
        n = rows.shape[0]
        while (start := self.space.take(n)) is None:
            self._reclaim()
            if (start := self.space.take(n)) is not None:
                break
            self._room.clear()
            try:  # (woken by a release; or, none coming, in time to take back what a dead reader held)
                await asyncio.wait_for(self._room.wait(), self.config.disagg.kv_transfer_timeout_s)
            except TimeoutError:
                pass
        await asyncio.to_thread(self.staging[start:start + n].copy_, rows)
        lease = next(self._lease_ids)
        self._leases[lease] = (start, time.monotonic())
        self.images_served += 1
        await self.send_to(req.reply_to, ImageEmbeddingsEvent(
            rid=req.rid, sender=self.address, lease=lease, endpoint=self.transfer.endpoint_info(), region=self.region,
            offset=start * self.staging[0].numel() * self.dtype.itemsize, tokens=n, layers=self.layers,
            hidden=self.hidden, dtype=str(self.dtype).removeprefix("torch.")))

    def _reclaim(self) -> None:
        """Take back rows whose reader has not given them back in twice the data plane's timeout (it died)."""
        stale = time.monotonic() - 2 * self.config.disagg.kv_transfer_timeout_s
        for lease, (start, given) in list(self._leases.items()):
            if given < stale:
                log.warning("%s: staged rows of lease %d were never given back; reusing them", self.label, lease)
                del self._leases[lease]
                self.space.give(start)
