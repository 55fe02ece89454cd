"""EncoderActor: a request's images decoded, preprocessed and run through the vision tower as soon as the request
reaches the scheduler, beside the worker's steps instead of inside one (worker.image_encoder = actor).

One encoder runs beside each worker rank, in its process (topology process group "worker"), and fills that
worker's embeddings cache (actors/encoder.py ImageEncoder.prepare) on a thread of its own and, on a GPU, a CUDA
stream of its own; the scheduler starts the request's prefill when every rank's encoder answered
ImagesEncodedEvent. The embeddings stay pinned until the worker lets go of the sequence (or the scheduler sends an
empty EncodeImagesCmd for a request aborted before its prefill).
"""

from __future__ import annotations

import asyncio
import logging

from flotilla.actors.base import Actor, ActorContext
from flotilla.actors.worker import local_runner
from flotilla.transport.messages import EncodeImagesCmd, ImagesEncodedEvent

log = logging.getLogger(__name__)

WAIT_FOR_WORKER_S = 0.05
"""How often setup looks for its worker's loaded model, seconds."""


class EncoderActor(Actor):
    """The vision tower of one worker rank, run ahead of its steps."""

    kind = "encoder"
    inbox = (EncodeImagesCmd,)

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
        self._task = asyncio.create_task(self._serve())
        return {"encoder": "vision tower"}

    async def teardown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def on_encode_images_cmd(self, cmd: EncodeImagesCmd) -> None:
        self._queue.put_nowait(cmd)  # (one at a time, in arrival order: a release never overtakes its request)

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
            await self.send(self.scheduler, ImagesEncodedEvent(rid=cmd.rid, rank=self.rank, error=error),
                            instance=self.rank // self.tp)
