"""EncoderActor: a request's images decoded, preprocessed and run through the vision tower as soon as the request
reaches the scheduler, beside the worker's steps instead of inside one (worker.image_encoder = actor).

One encoder runs beside each worker rank, in its process (topology process group "worker"), and fills that
worker's embeddings cache (actors/encoder.py ImageEncoder.prepare) on a thread of its own and, on a GPU, a CUDA
stream of its own; the scheduler starts the request's prefill when every rank's encoder answered
ImagesEncodedEvent. The embeddings stay pinned until the worker lets go of the sequence (or the scheduler sends an
empty EncodeImagesCmd for a request aborted before its prefill).

With worker.image_encoder = remote the tower runs in a vision encoder of its own (actors/vision_encoder.py): the
engine's own, or an engine of role encoder that the router named for the request (EncodeImagesCmd.vision_encoder).
This actor asks it for the request's images (EmbedImagesRequest), reads each image's rows from its staging region
over the KV data plane as ImageEmbeddingsEvent names them, gives the rows back, and puts the embeddings into its
worker's cache (pinned as above) before it answers the scheduler. A vision encoder silent for kv_transfer_timeout_s
(gone) fails the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import torch

from flotilla.actors.base import Actor, ActorContext
from flotilla.actors.encoder import unique_images
from flotilla.actors.vision_encoder import REGION, host_buffer, staging_backend_options, stop_serving
from flotilla.actors.worker import local_runner
from flotilla.config import EngineConfig
from flotilla.transport.kv_transfer import create_kv_transfer_engine
from flotilla.transport.messages import (
    EmbedImagesRequest,
    EncodeImagesCmd,
    ImageEmbeddingsEvent,
    ImageEmbeddingsReleased,
    ImageItem,
    ImagesEncodedEvent,
)

log = logging.getLogger(__name__)

WAIT_FOR_WORKER_S = 0.05
"""How often setup looks for its worker's loaded model, seconds."""
WATCH_S = 1.0
"""How often a remote-mode encoder looks for vision encoders that went silent, seconds."""


@dataclass
class _Wanted:
    """A request's images asked of the vision encoder of its own, and what came back so far."""

    images: list[ImageItem]
    source: str
    """The vision encoder's inbox."""
    heard: float = field(default_factory=time.monotonic)
    """When it was asked, or last answered (time.monotonic())."""
    rows: list[torch.Tensor] = field(default_factory=list)
    answered: int = 0
    error: str | None = None
    cancelled: bool = False
    """The scheduler let go of the request meanwhile: what comes is read no more."""


class EncoderActor(Actor):
    """The vision tower of one worker rank, run ahead of its steps (or read from a vision encoder of its own)."""

    kind = "encoder"
    inbox = (EncodeImagesCmd, ImageEmbeddingsEvent)

    def __init__(self, ctx: ActorContext, zmq_ctx) -> None:
        super().__init__(ctx, zmq_ctx)
        self.worker = str(ctx.config.get("workers", "worker"))
        self.scheduler = str(ctx.config.get("scheduler", "scheduler"))
        self.tp = int(ctx.config.get("tensor_parallel_size", 1))
        self.rank = ctx.instance
        self.encoder = None
        self._queue: asyncio.Queue[EncodeImagesCmd] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.requests_encoded = 0
        """Requests whose images this encoder made ready."""
        self.remote = False
        """image_encoder = remote: a vision encoder of its own runs the tower, this actor reads its embeddings."""
        own = str(ctx.config.get("vision_encoder", ""))
        self.own = ctx.endpoints.of(own) if own else None
        """The engine's own vision encoder's inbox; None: each request names one (an engine of role encoder)."""
        self.transfer = None
        self._wanted: dict[str, _Wanted] = {}
        self._peers: set[str] = set()
        self._landing: torch.Tensor | None = None

    async def setup(self) -> dict[str, str]:
        deadline = asyncio.get_running_loop().time() + self.ctx.options.ready_timeout_s
        while (runner := local_runner(self.worker, self.rank)) is None:  # its worker loads the model meanwhile
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"no worker {self.worker}/{self.rank} in this process: the encoder must share its "
                                   "worker's process group")
            await asyncio.sleep(WAIT_FOR_WORKER_S)
        if runner.encoder is None:
            raise RuntimeError(f"{runner.loaded.model_dir.name} takes no images: an encoder actor has nothing to run")
        self.encoder = runner.encoder
        config = EngineConfig.from_dict(self.ctx.config["engine"])
        self.remote = config.worker.image_encoder == "remote"
        if self.remote:
            self.timeout_s = config.disagg.kv_transfer_timeout_s
            self.transfer = create_kv_transfer_engine(config.disagg.kv_transfer_backend,
                                                      **staging_backend_options(config))
            vision = runner.loaded.config.vision
            self.device, self.dtype = runner.device, runner.dtype
            self.row_shape = (1 + len(vision.deepstack_visual_indexes), vision.out_hidden_size)
            self._task = asyncio.create_task(self._watch())
            return {"encoder": f"reads the embeddings of {self.own or 'encoder engines'} ({self.transfer.backend})"}
        self._task = asyncio.create_task(self._serve())
        return {"encoder": "vision tower"}

    async def teardown(self) -> None:
        await stop_serving(self._task, self.transfer)

    async def on_encode_images_cmd(self, cmd: EncodeImagesCmd) -> None:
        if not self.remote:
            self._queue.put_nowait(cmd)  # (one at a time, in arrival order: a release never overtakes its request)
        elif cmd.images:
            source = cmd.vision_encoder or self.own
            if source is None:
                await self._answer(cmd.rid, "no vision encoder: this engine runs none of its own (image_encoder "
                                            "remote, beside engines of role encoder) and none was live to route to",
                                   unavailable=True)
                return
            images = unique_images(cmd.images)
            self._wanted[cmd.rid] = _Wanted(images, source)
            await self.send_to(source, EmbedImagesRequest(rid=cmd.rid, images=images, reply_to=self.address))
        elif (wanted := self._wanted.get(cmd.rid)) is not None:
            wanted.cancelled = True
        else:
            self.encoder.release(cmd.rid)

    async def on_image_embeddings_event(self, ev: ImageEmbeddingsEvent) -> None:
        wanted = self._wanted.get(ev.rid)
        if ev.error is None:
            try:
                if wanted is not None and not wanted.cancelled and wanted.error is None:
                    wanted.rows.append(await self._read(ev))
            except Exception as e:  # noqa: BLE001 (the request fails with the reason; the encoder serves on)
                log.warning("%s: reading the image embeddings of %s failed: %s", self.label, ev.rid, e)
                wanted.error = f"reading its image embeddings from {ev.sender} failed: {type(e).__name__}: {e}"
            finally:
                await self.send_to(ev.sender, ImageEmbeddingsReleased(lease=ev.lease))
        if wanted is None:
            return
        wanted.heard = time.monotonic()
        wanted.answered += 1
        wanted.error = wanted.error or ev.error
        if wanted.error is None and wanted.answered < len(wanted.images):
            return
        del self._wanted[ev.rid]
        if wanted.cancelled:
            return
        if wanted.error is None:
            self.encoder.put(ev.rid, wanted.images, wanted.rows)
            self.requests_encoded += 1
        await self._answer(ev.rid, wanted.error)

    async def _answer(self, rid: str, error: str | None, unavailable: bool = False) -> None:
        await self.send(self.scheduler, ImagesEncodedEvent(rid=rid, rank=self.rank, error=error,
                                                           status=503 if unavailable else 500),
                        instance=self.rank // self.tp)

    async def _watch(self) -> None:
        """Fail the requests whose vision encoder has said nothing for timeout_s (it died, or lost them)."""
        while True:
            await asyncio.sleep(WATCH_S)
            silent = time.monotonic() - self.timeout_s
            for rid, wanted in list(self._wanted.items()):
                if wanted.heard < silent:
                    del self._wanted[rid]
                    if not wanted.cancelled:
                        await self._answer(rid, f"the vision encoder at {wanted.source} did not answer in "
                                                f"{self.timeout_s:g} s", unavailable=True)

    async def _read(self, ev: ImageEmbeddingsEvent) -> torch.Tensor:
        """One image's rows [tokens, 1 + layers, hidden] from the vision encoder's staging region, on this device."""
        if (1 + ev.layers, ev.hidden) != self.row_shape or ev.dtype != str(self.dtype).removeprefix("torch."):
            raise ValueError(f"its rows are [{1 + ev.layers}, {ev.hidden}] {ev.dtype}, the worker's model takes "
                             f"{list(self.row_shape)} {str(self.dtype).removeprefix('torch.')}")
        if ev.endpoint.engine_id not in self._peers:
            await asyncio.to_thread(self.transfer.connect, ev.endpoint)
            self._peers.add(ev.endpoint.engine_id)
        if self._landing is None:  # as large as the staging region: any image fits
            n = ev.region.length
            self._landing = (host_buffer(n, self.device) if self.transfer.backend != "local" else
                             torch.empty(n, dtype=torch.uint8, device=self.device))
            self.transfer.register(REGION, self._landing)
        nbytes = ev.tokens * self.row_shape[0] * self.row_shape[1] * self.dtype.itemsize
        await self.transfer.read(ev.region, [(0, ev.offset, nbytes)], REGION)
        rows = self._landing[:nbytes].view(self.dtype).view(ev.tokens, *self.row_shape)
        return rows.to(self.device, copy=True)

    async def _serve(self) -> None:
        while True:
            cmd = await self._queue.get()
            if not cmd.images:
                self.encoder.release(cmd.rid)
                continue
            error = None
            try:
                await asyncio.to_thread(self.encoder.prepare, cmd.rid, cmd.images)
                self.requests_encoded += 1
            except Exception as e:  # noqa: BLE001 (the request fails with the reason; the encoder serves on)
                log.exception("%s: encoding the images of %s failed", self.label, cmd.rid)
                self.encoder.release(cmd.rid)
                error = f"encoding its images failed: {type(e).__name__}: {e}"
            await self._answer(cmd.rid, error)
