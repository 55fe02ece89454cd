"""TokenizerActor: chat template + encode + length checks -> TokenizedRequest for the scheduler.

The HF tokenizer (transformers' fast tokenizer over the model folder's tokenizer.json) renders the
model's own chat template, so system prompts, tools and the generation prompt come out exactly as the
model was trained on. A request that cannot run (empty, too long, max_tokens beyond max_model_len,
token ids outside the vocabulary, a template error) is answered with RequestFailedEvent (HTTP 400)
and never reaches the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import jinja2
import msgspec
import numpy as np
from transformers import PreTrainedTokenizerBase

from flotilla.actors.base import Actor, ActorContext
from flotilla.config import EngineConfig
from flotilla.actors.images import ImageError, ImagePrompt
from flotilla.models.model_folder import (
    eos_token_ids,
    load_tokenizer,
    max_model_len_of,
    model_dir,
    takes_images,
    vocab_size_of,
)
from flotilla.transport.messages import (
    AbortCmd,
    GenerateRequest,
    ImageItem,
    Message,
    RequestFailedEvent,
    TokenizedRequest,
)

log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the engine refuses; becomes an HTTP 4xx with an OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def render_prompt(tokenizer: PreTrainedTokenizerBase, *, messages: list[dict[str, Any]] | None = None,
                  tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
                  chat_template_kwargs: dict[str, Any] | None = None, prompt: str | None = None,
                  add_special_tokens: bool | None = None) -> list[int]:
    """The token ids the engine runs for chat messages (the model's chat template, rendered, then encoded without
    adding special tokens again) or a text prompt (with the tokenizer's special tokens); /tokenize shows the same.
    RequestError when the template cannot render the messages."""
    if messages is not None:
        try:
            text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                 tokenize=False, **(chat_template_kwargs or {}))
        except (jinja2.TemplateError, TypeError, KeyError, ValueError) as e:
            raise RequestError(f"the chat template could not render these messages: {e}", "messages") from None
        return tokenizer.encode(text, add_special_tokens=bool(add_special_tokens))
    assert prompt is not None
    return tokenizer.encode(prompt, add_special_tokens=add_special_tokens is not False)


_PROBE_MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
_PROBE_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def template_renders_tools(tokenizer: PreTrainedTokenizerBase) -> bool | None:
    """Whether the chat template shows the model a request's tools: a one-message conversation rendered with and
    without a tool differs. None when it cannot render that conversation (or the tokenizer has no template)."""
    try:
        plain, with_tool = (tokenizer.apply_chat_template(_PROBE_MESSAGES, tools=tools, add_generation_prompt=True,
                                                          tokenize=False) for tools in (None, [_PROBE_TOOL]))
    except (jinja2.TemplateError, TypeError, KeyError, ValueError):
        return None
    return plain != with_tool


def special_tokens_among(tokenizer: PreTrainedTokenizerBase, texts: tuple[str, ...]) -> list[str]:
    """Those of ``texts`` that are special tokens of the tokenizer (skip_special_tokens drops them from outputs)."""
    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    return [t for t in texts if t in special]


class RequestTokenizer:
    """The pure part: GenerateRequest -> TokenizedRequest, or RequestError."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, max_model_len: int, eos_ids: list[int],
                 vocab_size: int | None = None, images: ImagePrompt | None = None, max_images: int = 0) -> None:
        self.tokenizer = tokenizer
        self.images = images
        """Expands image placeholders (a model that takes images); None: a request with images is a 400."""
        self.max_images = max_images
        """None with skip_tokenizer_init: only token-id prompts, no stop strings."""
        self.max_model_len = max_model_len
        self.eos_ids = eos_ids
        self.vocab_size = len(tokenizer) if tokenizer is not None else vocab_size

    def prompt(self, req: GenerateRequest) -> tuple[np.ndarray, list[ImageItem]]:
        """The prompt's token ids, its images' placeholders expanded, and the images."""
        ids = self.prompt_ids(req)
        if not req.images:
            return ids, []
        param = req.images[0].param
        if self.images is None:
            raise RequestError("this model does not take images; send text content only", param)
        if len(req.images) > self.max_images:
            raise RequestError(f"at most {self.max_images} images per prompt are taken (--limit-mm-per-prompt); this "
                               f"one has {len(req.images)}", req.images[self.max_images].param)
        try:
            return self.images.expand(ids, req.images)
        except ImageError as e:
            raise RequestError(str(e), e.param) from None

    def prompt_ids(self, req: GenerateRequest) -> np.ndarray:
        if self.tokenizer is None:
            if req.prompt_token_ids is None:
                raise RequestError("this engine runs without a tokenizer (skip_tokenizer_init): send prompt token "
                                   "ids", "prompt")
            if req.sampling.stop:
                raise RequestError("stop strings need a tokenizer; this engine runs without one", "stop")
        if req.messages is not None:
            ids = render_prompt(self.tokenizer, messages=req.messages, tools=req.tools,
                                add_generation_prompt=req.add_generation_prompt,
                                chat_template_kwargs=req.chat_template_kwargs)
        elif req.prompt is not None:
            ids = render_prompt(self.tokenizer, prompt=req.prompt)
        elif req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
                raise RequestError(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        else:
            raise RequestError("a request needs a prompt, prompt token ids or messages", "prompt")
        return np.asarray(ids, dtype=np.int32)

    def tokenize(self, req: GenerateRequest) -> TokenizedRequest:
        if req.sampling.n != 1:
            raise RequestError("the engine runs one sequence per request; the front end fans out n > 1", "n")
        ids, images = self.prompt(req)
        n, limit = len(ids), self.max_model_len
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        if n >= limit:
            raise RequestError(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                               f"{n} tokens, which leaves no room for output. Please shorten the prompt.",
                               "messages" if req.messages is not None else "prompt", code="context_length_exceeded")
        sampling = req.sampling
        if sampling.logit_bias and self.vocab_size is not None and max(sampling.logit_bias) >= self.vocab_size:
            raise RequestError(f"logit_bias token ids must be in [0, {self.vocab_size})", "logit_bias")
        if sampling.max_tokens is None:
            sampling = msgspec.structs.replace(sampling, max_tokens=limit - n)
        elif n + sampling.max_tokens > limit:
            raise RequestError(f"This model's maximum context length is {limit} tokens. However, you requested "
                               f"{n + sampling.max_tokens} tokens ({n} in the prompt, {sampling.max_tokens} for the "
                               f"completion). Please reduce the prompt or max_tokens.", "max_tokens",
                               code="context_length_exceeded")
        return TokenizedRequest(rid=req.rid, prompt_ids=ids, sampling=sampling, eos_token_ids=self.eos_ids,
                                images=images, arrival_time=req.arrival_time, priority=req.priority,
                                transfer_id=req.transfer_id, peer=req.peer, reply_to=req.reply_to,
                                vision_encoder=req.vision_encoder)


class TokenizerActor(Actor):
    """Turns GenerateRequests into TokenizedRequests; forwards aborts on the same path."""

    kind = "tokenizer"
    inbox = (GenerateRequest, AbortCmd)

    def __init__(self, ctx: ActorContext, zmq_ctx) -> None:
        super().__init__(ctx, zmq_ctx)
        self.config = EngineConfig.from_dict(ctx.config.get("engine", {}))
        self.scheduler = str(ctx.config.get("scheduler", "scheduler"))
        self.frontend = str(ctx.config.get("frontend", "frontend"))
        self.core: RequestTokenizer | None = None
        self.dp_size = self.config.parallel.data_parallel_size
        self._next_rank = 0  # the rank of the next request whose front end left the choice to the engine

    async def setup(self) -> dict[str, str]:
        path = model_dir(self.config)
        tok = None if self.config.model.skip_tokenizer_init else load_tokenizer(path, self.config.model.chat_template)
        images = ImagePrompt(path) if takes_images(path) else None
        self.core = RequestTokenizer(tok, max_model_len_of(self.config, path), eos_token_ids(tok, path),
                                     vocab_size_of(path), images, self.config.model.limit_mm_per_prompt.image)
        return {"max_model_len": str(self.core.max_model_len)}

    async def on_generate_request(self, req: GenerateRequest) -> None:
        assert self.core is not None
        try:  # (images are decoded off the event loop: Pillow lets go of the GIL while it decodes)
            tokenized = await asyncio.to_thread(self.core.tokenize, req) if req.images else self.core.tokenize(req)
        except RequestError as e:
            await self.reply(req.reply_to, RequestFailedEvent(rid=req.rid, message=str(e), status=e.status,
                                                              param=e.param, code=e.code))
            return
        rank = req.dp_rank
        if rank < 0:  # another node's front end: the ranks in turn
            rank, self._next_rank = self._next_rank, (self._next_rank + 1) % self.dp_size
        await self.send(self.scheduler, tokenized, instance=rank)  # the data-parallel rank's scheduler

    async def on_abort_cmd(self, msg: AbortCmd) -> None:
        for rank in range(self.dp_size) if msg.dp_rank < 0 else [msg.dp_rank]:  # (unknown there: a no-op)
            await self.send(self.scheduler, msg, instance=rank)

    async def on_handler_error(self, msg: Message, exc: BaseException) -> None:
        if isinstance(msg, GenerateRequest):
            await self.reply(msg.reply_to, RequestFailedEvent(rid=msg.rid, status=500,
                                                              message=f"tokenizer failed: {type(exc).__name__}: {exc}"))
