"""The offline API, as in vLLM: ``LLM(model).generate(prompts, SamplingParams(...))`` and ``LLM.chat``.

LLM runs the real engine actors (one process each on a GPU, all in this process on CPU; ``placement``
chooses) with an EngineClient on a private event loop in a background thread, so the
calls here are plain synchronous functions.
"""

from __future__ import annotations

import asyncio
import atexit
import io
import logging
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import uvloop
from tqdm.auto import tqdm

from flotilla.config import EngineConfig
from flotilla.sampling_params import SamplingParams
from flotilla.server.engine_client import EngineClient, ready_summary, with_device_batch_defaults
from flotilla.server.media import decode_data_url
from flotilla.transport.messages import GenerateRequest, ImageData

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 60.0
"""Longest wait for the engine's actors to stop in shutdown(), seconds (each has its own grace period first)."""

Prompt = str | dict[str, Any]
"""A text prompt, or {"prompt_token_ids": [...]} / {"prompt": "..."}."""


@dataclass(slots=True)
class Logprob:
    """One generated token's logprob and its top alternatives (token id -> logprob)."""

    logprob: float
    top: dict[int, float] = field(default_factory=dict)


@dataclass(slots=True)
class CompletionOutput:
    """One completion of a prompt (vLLM's field names)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[Logprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    """All completions of one prompt."""

    request_id: str
    prompt: str | None
    outputs: list[CompletionOutput]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    finished: bool = True
    prompt_token_ids: list[int] | None = None
    """Set with prompt_logprobs (the prompt as the engine saw it)."""
    prompt_logprobs: list[Logprob | None] | None = None
    """SamplingParams.prompt_logprobs: each prompt token's logprob (None for the first) and top alternatives."""


def image_data(value: Any, param: str) -> ImageData:
    """One image as the engine takes it: a data URL, the file's bytes, or a PIL image (sent as PNG)."""
    if isinstance(value, str):
        data = decode_data_url(value, param, 2**31)
    elif isinstance(value, bytes):
        data = value
    else:
        buf = io.BytesIO()
        value.save(buf, "PNG")
        data = buf.getvalue()
    return ImageData(data=data, param=param)


def chat_images(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """A conversation's messages with each image part (an OpenAI image_url with a data URL, or {"type": "image",
    "image": PIL image or file bytes}) as the template's {"type": "image"}, and the images' bytes in order."""
    out, images = [], []
    for i, msg in enumerate(messages):
        content = msg.get("content")
        if not isinstance(content, list) or not any(p.get("type") in ("image_url", "image") for p in content):
            out.append(msg)
            continue
        parts = []
        for j, part in enumerate(content):
            if part.get("type") not in ("image_url", "image"):
                parts.append(part)
                continue
            value = part.get("image_url") or part.get("image")
            images.append(image_data(value.get("url") if isinstance(value, dict) else value,
                                     f"messages[{i}].content[{j}]"))
            parts.append({"type": "image"})
        out.append({**msg, "content": parts})
    return {"messages": out, "images": images}


class LLM:
    """An engine for offline batch generation."""

    def __init__(self, model: str | None = None, *, placement: str | None = None, config: EngineConfig | None = None,
                 **engine_options: Any) -> None:
        """model: HF folder (None = the embedded default model); engine_options: vLLM-named options
        (block_size, kv_cache_blocks, max_num_seqs, ...; see config.py), or a whole EngineConfig.
        placement: inline (every actor in this process) or process (one each); default process on a GPU (and with
        tensor_parallel_size or data_parallel_size > 1: one process per rank), inline on CPU; with
        distributed_executor_backend="ray" one Ray actor each, placed on the Ray cluster. On a GPU the host work
        of a step (scheduling, launching, detokenizing) is what limits a small model, and one process per actor
        spreads it over cores instead of sharing one interpreter lock."""
        if config is not None and (model is not None or engine_options):
            raise TypeError("pass either config or model/engine options, not both")
        _show_info_logs()
        self.config = config or with_device_batch_defaults(EngineConfig.from_options(model=model, **engine_options),
                                                           engine_options, offline=True)
        if placement is None and self.config.parallel.distributed_executor_backend == "ray":
            placement = "ray"
        if placement is None:
            parallel = self.config.parallel
            from flotilla.actors.model_runner import resolve_device  # what the worker will run on

            on_gpu = resolve_device(self.config.worker.device).type == "cuda"
            placement = "process" if on_gpu or parallel.tensor_parallel_size * parallel.data_parallel_size > 1 \
                else "inline"
        self._loop = uvloop.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flotilla-llm", daemon=True)
        self._thread.start()
        try:
            self.placement = placement
            self.client = EngineClient(self.config, placement=placement)
            self._run(self.client.start())
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise
        self._closed = False
        detail = self.client.ready_detail
        name = self.config.model.served_model_name or detail.get("worker/0", {}).get("model", "?")
        log.info("flotilla ready: offline LLM %s placement=%s",
                 ready_summary(detail, name, detail.get("tokenizer/0", {}).get("max_model_len", "?"),
                               self.config.scheduler), placement)
        # A script that never calls shutdown() stops the engine when the interpreter exits, before concurrent.futures
        # refuses new work (its exit hook runs first among threading's, before atexit's: the worker's steps would
        # fail and the stop would hang). threading._register_atexit is how concurrent.futures registers that hook.
        getattr(threading, "_register_atexit", atexit.register)(_shutdown_at_exit, weakref.ref(self))

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Complete every prompt (text, {"prompt": text} or {"prompt_token_ids": ids}, the latter with vLLM's
        "multi_modal_data": {"image": images} for a model that takes images); results in prompt order. priority (with
        policy="priority"): lower runs first."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        reqs = [self._request(p, self._params(sampling_params, i), priority[i] if priority else 0)
                for i, p in enumerate(prompts)]
        return self._run_all(reqs, [p if isinstance(p, str) else p.get("prompt") for p in prompts], use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Chat completions: one conversation (a list of messages) or a list of conversations; chat_template_kwargs
        are more variables for the model's chat template (e.g. Qwen3's enable_thinking)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        reqs = [GenerateRequest(rid=self.client.new_rid("chat"), sampling=self._params(sampling_params, i),
                                tools=tools, add_generation_prompt=add_generation_prompt,
                                chat_template_kwargs=chat_template_kwargs, arrival_time=time.time(),
                                **chat_images(conv))
                for i, conv in enumerate(convs)]
        return self._run_all(reqs, [None] * len(reqs), use_tqdm)

    def shutdown(self) -> None:
        """Stop every engine actor; also done when the LLM is collected or the interpreter exits."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            self._run(self.client.stop(), timeout=STOP_TIMEOUT_S)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if sys.is_finalizing():  # too late to stop cleanly; the exit hook above already has
            return
        try:
            self.shutdown()
        except Exception:  # collected while failing: nothing left to report to
            pass

    # ---- internals --------------------------------------------------------------------------------

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @staticmethod
    def _params(params: SamplingParams | Sequence[SamplingParams] | None, i: int) -> SamplingParams:
        if params is None:
            return SamplingParams()
        return params if isinstance(params, SamplingParams) else params[i]

    def _request(self, prompt: Prompt, params: SamplingParams, priority: int) -> GenerateRequest:
        common = dict(rid=self.client.new_rid("cmpl"), sampling=params, arrival_time=time.time(), priority=priority)
        if isinstance(prompt, str):
            return GenerateRequest(prompt=prompt, **common)
        if "prompt_token_ids" in prompt:  # (vLLM's multi_modal_data: the ids hold one image placeholder per image)
            images = (prompt.get("multi_modal_data") or {}).get("image", [])
            images = [image_data(im, f"multi_modal_data.image[{i}]")
                      for i, im in enumerate(images if isinstance(images, list) else [images])]
            return GenerateRequest(prompt_token_ids=np.asarray(prompt["prompt_token_ids"], dtype=np.int32),
                                   images=images, **common)
        return GenerateRequest(prompt=prompt["prompt"], **common)

    def _run_all(self, reqs: list[GenerateRequest], prompts: list[str | None], use_tqdm: bool) -> list[RequestOutput]:
        bar = tqdm(total=len(reqs), desc="generating", unit="req", disable=not use_tqdm or len(reqs) < 2)

        async def one(req: GenerateRequest, prompt: str | None) -> RequestOutput:
            subs = self.client.fan_out(req)
            outs = await asyncio.gather(*(self._collect(sub, i) for i, sub in enumerate(subs)))
            bar.update(1)
            first = outs[0][1]
            out = RequestOutput(request_id=req.rid, prompt=prompt, outputs=[o for o, _ in outs],
                                num_prompt_tokens=first[0], num_cached_tokens=first[1])
            scored = first[2]
            if scored is not None:
                tops = scored.top_ids or [[] for _ in scored.logprobs]
                top_lps = scored.top_logprobs or [[] for _ in scored.logprobs]
                out.prompt_token_ids = scored.token_ids
                out.prompt_logprobs = [None] + [Logprob(lp, dict(zip(ti, tl)))
                                                for lp, ti, tl in zip(scored.logprobs, tops, top_lps)]
            return out

        async def all_of() -> list[RequestOutput]:
            return list(await asyncio.gather(*(one(r, p) for r, p in zip(reqs, prompts))))

        try:
            return self._run(all_of())
        finally:
            bar.close()

    async def _collect(self, req: GenerateRequest, index: int) -> tuple[CompletionOutput, tuple[int, int, Any]]:
        out = CompletionOutput(index=index, logprobs=[] if req.sampling.logprobs is not None else None)
        text: list[str] = []
        usage = (0, 0)
        scored = None
        for delta in await self.client.collect(req):  # offline: the whole output at once, no wake-up per token
            text.append(delta.text)
            out.token_ids.extend(delta.token_ids)
            if out.logprobs is not None and delta.logprobs is not None:
                tops = delta.top_ids or [[] for _ in delta.logprobs]
                toplps = delta.top_logprobs or [[] for _ in delta.logprobs]
                out.logprobs.extend(Logprob(lp, dict(zip(ti, tl))) for lp, ti, tl in zip(delta.logprobs, tops, toplps))
            usage = (delta.num_prompt_tokens, delta.num_cached_tokens)
            scored = scored or delta.prompt_logprobs
            if delta.finish_reason is not None:
                out.finish_reason, out.stop_reason = delta.finish_reason, delta.stop_reason
        out.text = "".join(text)
        return out, (*usage, scored)


def _show_info_logs() -> None:
    """Print flotilla's INFO lines (the ready line among them) on stderr, as vLLM's offline LLM does, when the
    application configured no logging; an application that did keeps its own handlers and levels."""
    logger = logging.getLogger("flotilla")
    if logger.hasHandlers():
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def _shutdown_at_exit(ref: weakref.ref[LLM]) -> None:
    llm = ref()
    if llm is not None:
        llm.shutdown()
