"""Every control-plane message of flotilla, in one file: the wire schema is the single source of truth.

A message is a tagged msgspec Struct (the tag is the class name), encoded as a msgpack array, with
numeric arrays (token ids, block ids, logprobs) carried as numpy arrays that the codec moves as extra
zero-copy frames. Names end in Request / Plan / Result / Delta / Event / Cmd. The KV data plane's endpoint and
region descriptions that ride in some of them live with the data plane (transport/data_plane.py). Read DESIGN.md's
"One streaming chat request" next to this file: the messages below appear in that order.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec
import numpy as np

from flotilla.sampling_params import SamplingParams
from flotilla.transport.data_plane import EndpointInfo, RegionInfo

Array = np.ndarray
"""A numeric array on the wire (1-D unless a field says otherwise); the codec ships it zero-copy."""


class Message(msgspec.Struct, tag=True, kw_only=True, array_like=True, omit_defaults=True, gc=False):
    """Base of every control-plane message (tag = class name)."""


# ---------------------------------------------------------------------------------------------
# Parts of messages (plain structs that ride inside them)


class TransferPeer(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    """The other engine of a disaggregated request: where its scheduler and KV-migration actors listen."""

    engine: str
    """The peer engine's id."""
    scheduler: str
    """Its scheduler's inbox (a ZeroMQ URL): KVReady goes there (prefill -> decode), BlocksReleased back."""
    kv: list[str] = []
    """A prefill peer's KV-migration actors' inboxes, by worker rank (the decode side reads from them)."""


class PromptLogprobs(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    """A prompt's tokens scored by the model (echo with logprobs, vLLM's prompt_logprobs): entry i is prompt token
    i + 1's, the first token having none; logprobs of the raw model distribution, as for sampled tokens."""

    token_ids: list[int]
    """The whole prompt."""
    logprobs: list[float]
    """Logprob of each prompt token after the first."""
    ranks: list[int]
    """Its rank in the model's distribution (1: the most likely token)."""
    top_ids: list[list[int]] = []
    """The k most likely tokens at each of those positions (k = the request's prompt_logprobs; empty for 0)."""
    top_logprobs: list[list[float]] = []
    """Their logprobs."""


class FirstTokenLogprobs(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    """The logprobs of the token a prefill engine sampled, for the decode engine that reports it."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class ImageData(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    """An image of a chat request as the client sent it: the encoded file (PNG, JPEG, ...), not yet decoded."""

    data: bytes
    """The image file's bytes (a data URL's payload, or what an allowed http(s) URL served)."""
    param: str = ""
    """Where the request held it (e.g. "messages[0].content[1]"), named by the error when it is bad."""


class ImageItem(msgspec.Struct, frozen=True, kw_only=True, array_like=True, omit_defaults=True):
    """An image of a tokenized prompt: its file, its content hash and the run of placeholder tokens it fills."""

    data: bytes
    """The image file's bytes; the encoder decodes and preprocesses them."""
    hash: bytes
    """Content hash of the file: keys the prefix cache (another image never hits) and the encoder's cache."""
    offset: int
    """Index of its first placeholder token in the prompt."""
    length: int
    """How many placeholder tokens it fills (its merged patches)."""
    grid: tuple[int, int, int]
    """(t, h, w) of its patch grid before merging, as the image processor cuts it."""


# ---------------------------------------------------------------------------------------------
# 1. front end -> tokenizer


class GenerateRequest(Message):
    """A new request from the front end: a prompt (text, token ids or chat messages) to complete."""

    rid: str
    """Request id minted by the front end; unique while the request lives."""
    sampling: SamplingParams
    """How to sample and when to stop."""
    prompt: str | None = None
    """Raw text prompt (completions API)."""
    prompt_token_ids: Array | None = None
    """Pre-tokenized prompt, int32 token ids (used as given)."""
    messages: list[dict[str, Any]] | None = None
    """Chat messages (OpenAI shape); the tokenizer applies the model's chat template."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI tool definitions handed to the chat template."""
    add_generation_prompt: bool = True
    """Append the assistant turn opener after the chat messages."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the chat template (e.g. Qwen3's enable_thinking)."""
    images: list[ImageData] = []
    """The chat messages' images, in the order their parts appear (each is an {"type": "image"} part there)."""
    arrival_time: float = 0.0
    """time.time() when the front end received the request, seconds."""
    priority: int = 0
    """Lower runs first when the scheduler uses priority order; FIFO among equals."""
    transfer_id: str | None = None
    """Disaggregated request: the router sends it to a prefill and a decode engine with this one id."""
    peer: TransferPeer | None = None
    """Disaggregated request: the other engine of the pair."""
    dp_rank: int = 0
    """The engine's data-parallel rank whose scheduler runs it (the front end's coordinator picks it); -1: the
    engine's tokenizer picks, in turn (a front end of another node, which does not hear the ranks' loads)."""
    reply_to: str | None = None
    """Where the request's text and failures go when that is not the engine's own front end: the inbox of a front
    end on another node that routed it here through the shared registry. None: the engine's front end."""
    vision_encoder: str | None = None
    """The inbox of the vision encoder (an engine of role encoder, picked by the router) that encodes its images for
    an engine with image_encoder = remote; None: the engine's own."""


class AbortCmd(Message):
    """Drop a request wherever it is; travels the request's own path so it cannot overtake it."""

    rid: str
    """The request to abort."""
    dp_rank: int = 0
    """The data-parallel rank the request was given to; -1: every rank (where the engine picked it)."""


# ---------------------------------------------------------------------------------------------
# 2. tokenizer -> scheduler


class TokenizedRequest(Message):
    """A validated, tokenized request ready for scheduling."""

    rid: str
    """Request id."""
    prompt_ids: Array
    """Prompt token ids, int32."""
    sampling: SamplingParams
    """How to sample and when to stop (max_tokens already resolved against max_model_len)."""
    eos_token_ids: list[int] = []
    """Token ids that end generation unless sampling.ignore_eos."""
    images: list[ImageItem] = []
    """The prompt's images, in prompt order; their placeholder runs do not overlap."""
    arrival_time: float = 0.0
    """time.time() when the front end received the request, seconds."""
    priority: int = 0
    """Lower runs first under priority scheduling."""
    transfer_id: str | None = None
    """Set for a disaggregated request: the prefill and decode engines both get it with this id."""
    peer: TransferPeer | None = None
    """Set for a disaggregated request: the other engine of the pair."""
    reply_to: str | None = None
    """GenerateRequest.reply_to: the inbox of the front end that routed it here, when not the engine's own."""
    vision_encoder: str | None = None
    """GenerateRequest.vision_encoder."""


# ---------------------------------------------------------------------------------------------
# scheduler <-> encoder (a model that takes images, with image_encoder = actor)


class EncodeImagesCmd(Message):
    """Encode a request's images into the worker's embeddings cache and hold them there until released."""

    rid: str
    """The request whose images these are."""
    images: list[ImageItem] = []
    """Its images; empty: release what was held for it (aborted before its prefill)."""
    vision_encoder: str | None = None
    """TokenizedRequest.vision_encoder: the vision encoder to ask (image_encoder = remote)."""


class ImagesEncodedEvent(Message):
    """An encoder's answer to EncodeImagesCmd: the embeddings are in its worker's cache, or why not."""

    rid: str
    """The request."""
    rank: int
    """The encoder's (its worker's) rank."""
    error: str | None = None
    """Why the images could not be encoded (the request then fails)."""
    status: int = 500
    """The failed request's HTTP status: 503 when no vision encoder could be reached."""


# ---------------------------------------------------------------------------------------------
# encoder <-> vision encoder of its own (image_encoder = remote): the embeddings move on the data plane


class EmbedImagesRequest(Message):
    """A worker rank's encoder asks the vision encoder for a request's images' embeddings."""

    rid: str
    """The request."""
    images: list[ImageItem]
    """Its images, in prompt order."""
    reply_to: str
    """The asking encoder's inbox (a ZeroMQ URL)."""


class ImageEmbeddingsEvent(Message):
    """The vision encoder's answer: where the images' embedding rows lie in its data plane's staging region, until
    ImageEmbeddingsReleased. Row i holds token i's embedding then its DeepStack features, [1 + layers, hidden]."""

    rid: str
    """The request."""
    sender: str = ""
    """The vision encoder's inbox: ImageEmbeddingsReleased goes there."""
    lease: int = 0
    """Names the rows' hold on the staging region (ImageEmbeddingsReleased gives it back)."""
    endpoint: EndpointInfo | None = None
    """How to reach the vision encoder's data plane."""
    region: RegionInfo | None = None
    """Its staging region."""
    offset: int = 0
    """Byte offset of the first row in the region."""
    tokens: int = 0
    """Rows: the images' tokens, in prompt order."""
    layers: int = 0
    """DeepStack features per token."""
    hidden: int = 0
    """Width of each embedding."""
    dtype: str = ""
    """Their dtype (`bfloat16`, ...)."""
    error: str | None = None
    """Why the images could not be encoded (the request then fails; nothing is held)."""


class ImageEmbeddingsReleased(Message):
    """The asking encoder has read (or given up on) a lease's rows: the vision encoder may reuse them."""

    lease: int
    """ImageEmbeddingsEvent.lease."""


# ---------------------------------------------------------------------------------------------
# 3./4. scheduler <-> GPU worker


class NewSequence(Message):
    """A sequence the worker has not seen: everything it needs to keep per-request state."""

    rid: str
    """Sequence id (a request with n > 1 has one sequence per completion)."""
    token_ids: Array
    """All known tokens, int32: the prompt, plus earlier output when resumed after preemption."""
    num_computed_tokens: int
    """Tokens whose KV is already in the cache (prefix-cache hit), tokens."""
    block_ids: Array
    """KV block ids, int32, covering at least the tokens computed after this step."""
    sampling: SamplingParams
    """Sampling options (seed, penalties, logprobs)."""
    num_output_tokens: int = 0
    """How many of token_ids are earlier output (a resumed sequence), tokens."""
    state_snapshot: int = -1
    """Hybrid models: the snapshot slot holding the recurrent state after the cached tokens (a prefix hit);
    -1: the state starts from zeros."""
    images: list[ImageItem] = []
    """Multimodal models: the prompt's images, whose embeddings the prefill puts at their placeholders."""


class StepPlan(Message):
    """One step of the engine: which sequences run how many tokens. Carries only what changed."""

    step: int
    """Monotonic step number; StepResult echoes it."""
    new_seqs: list[NewSequence] = []
    """Sequences the worker sees for the first time (new requests and resumed ones)."""
    rids: list[str] = []
    """Every sequence computed this step, in batch order (new and running)."""
    num_new_tokens: Array | None = None
    """Per rid, tokens to compute this step, int32 (1 for a decode, a chunk length for prefill)."""
    new_block_counts: Array | None = None
    """Per rid, how many block ids were appended to its table, int32."""
    new_block_ids: Array | None = None
    """The appended block ids of all rids, concatenated in rid order, int32."""
    finished_rids: list[str] = []
    """Sequences the worker forgets before running this step (finished, aborted, preempted)."""
    state_save_rows: Array | None = None
    """Hybrid models: rows of `rids` whose recurrent state the worker saves after this step, int32."""
    state_save_slots: Array | None = None
    """The snapshot slot each of those rows saves into, int32 (BlockManager.reserve_snapshot)."""
    every_row_samples: bool = True
    """Every row reaches the end of its sequence's tokens and samples (False: some row is a prompt chunk short of its
    end; a one-token chunk of that kind must not run as a decode)."""


class StepResult(Message):
    """What a step produced: one sampled token per sequence that reached the end of its tokens."""

    step: int
    """The StepPlan's step number."""
    rids: list[str] = []
    """Sequences that sampled a token this step (prefill chunks that did not finish sample nothing)."""
    token_ids: Array | None = None
    """Sampled token per rid, int32; under speculative decoding every accepted token, rid after rid."""
    logprobs: Array | None = None
    """Logprob of each sampled token, float32 (only when some sequence asked for logprobs)."""
    top_ids: Array | None = None
    """Top-n alternatives per token, int32 [len(token_ids), n]."""
    top_logprobs: Array | None = None
    """Their logprobs, float32 [len(token_ids), n]."""
    error: str | None = None
    """Set when the step failed; the scheduler fails the step's requests."""
    num_tokens: Array | None = None
    """Speculative decoding: tokens per rid, int32 (accepted drafts + 1); None = one each."""
    prompt_rids: list[str] = []
    """Sequences whose prompt logprobs this step computed (SamplingParams.prompt_logprobs), in step order."""
    prompt_counts: Array | None = None
    """Prompt tokens scored per prompt rid, int32 (a chunk's, in prompt order: a sequence's chunks append)."""
    prompt_logprobs: Array | None = None
    """Logprob of each scored prompt token, float32, rid after rid."""
    prompt_ranks: Array | None = None
    """Its rank in the model's distribution, int32."""
    prompt_top_ids: Array | None = None
    """The most likely tokens at its position, int32 [rows, k] (k: the largest prompt_logprobs; None for 0)."""
    prompt_top_logprobs: Array | None = None
    """Their logprobs, float32 [rows, k]."""


class DPStepsEvent(Message):
    """Scheduler of one data-parallel rank -> the other ranks' schedulers, under expert parallelism: how many
    steps it has sent its workers. Every step runs the MoE layers' all-to-alls across the ranks, so each
    rank sends as many (an idle one empty steps, which its worker runs as an empty forward)."""

    dp_rank: int
    """The sender's data-parallel rank."""
    num_steps: int
    """Steps it has sent to its workers since start."""


class ExpertLoadEvent(Message):
    """A worker's per-expert token counts under expert parallelism, to the front end (for EPLB and /metrics);
    sent every half second (EXPERT_LOAD_INTERVAL_S, actors/worker.py) while it runs steps."""

    dp_rank: int
    """The worker's data-parallel (= expert-parallel) rank."""
    expert_tokens: Array
    """int64 [num_moe_layers, num_experts]: (token, expert) slots this rank routed to each expert since start,
    per MoE layer (in layer order); summed over the ranks it is each expert's whole load."""


class KVCacheInfoEvent(Message):
    """A worker's KV cache, sent to the scheduler once at start: the scheduler admits nothing before it."""

    rank: int
    """The worker's rank."""
    num_blocks: int
    """KV blocks the worker allocated, blocks."""
    block_size: int
    """Tokens per block."""
    max_model_len: int
    """Longest sequence the worker accepts, tokens."""
    num_state_slots: int = 0
    """Sequences whose recurrent state the worker holds (a hybrid model's linear-attention layers): the scheduler
    runs no more at once; 0: no such state."""
    num_state_snapshots: int = 0
    """Snapshots of such states the worker keeps for prefix caching (a state is valid at one position only, so a
    cached prefix resumes from a snapshot taken where it ends); 0: none, and no prefix cache for a hybrid model."""
    plans_ahead: bool = False
    """Speculating: the worker takes a step planned before the last one's result is in (the same decodes again,
    their positions corrected on the device; actors/batching.py _plan_ahead)."""


# ---------------------------------------------------------------------------------------------
# Disaggregated prefill -> decode: KV blocks move on the data plane, these messages only coordinate


class KVReadyEvent(Message):
    """Prefill scheduler -> decode scheduler: the prompt's KV is computed and pinned; here is where."""

    transfer_id: str
    """The request's transfer id."""
    block_ids: Array
    """Prefill-side KV blocks holding the prompt, in order, int32."""
    num_tokens: int
    """Prompt tokens whose KV those blocks hold, tokens."""
    first_token: int
    """The token the prefill engine sampled after the prompt."""
    src_engine: str = ""
    """Name of the prefill engine whose KV memory the migration reads."""
    block_size: int = 0
    """Tokens per block on the prefill side (the decode side must use the same)."""
    error: str | None = None
    """Set when the prefill failed; the decode side fails the request and releases."""
    state_slot: int = -1
    """Hybrid models: the prefill side's state snapshot slot holding the prompt's recurrent state; -1: none."""
    first_logprobs: FirstTokenLogprobs | None = None
    """The first token's logprobs, when the request asked for logprobs."""
    prompt_logprobs: PromptLogprobs | None = None
    """The prompt's logprobs, when the request asked for them."""


class MigrateKVCmd(Message):
    """Decode scheduler -> its KV-migration actor: copy these prefill blocks into these decode blocks."""

    transfer_id: str
    """The request's transfer id."""
    src_engine: str
    """Prefill engine to read from."""
    src_block_ids: Array
    """Prefill-side blocks, int32."""
    dst_block_ids: Array
    """Decode-side blocks, int32, pairwise with src_block_ids."""
    src_kv: list[str] = []
    """The prefill engine's KV-migration actors' inboxes, by rank (the scheduler shell fills them in)."""
    src_state_slot: int = -1
    """Hybrid models: the prefill side's state snapshot slot to read (KVReadyEvent.state_slot); -1: none."""
    dst_state_slot: int = -1
    """The decode side's state snapshot slot it lands in."""


class MigrationDoneEvent(Message):
    """KV-migration actor -> decode scheduler: the copy finished (or failed). One per worker rank."""

    transfer_id: str
    """The request's transfer id."""
    error: str | None = None
    """Why it failed, if it did."""
    rank: int = 0
    """The migration actor's worker rank."""
    num_bytes: int = 0
    """KV bytes this rank pulled for the transfer, bytes."""


class KVEndpointRequest(Message):
    """Decode-side KV-migration actor -> prefill-side one of the same rank: describe your KV memory."""

    rank: int
    """Worker rank whose memory is wanted."""
    reply_to: str
    """Inbox address to answer to (a ZeroMQ URL)."""
    key: str = ""
    """Echoed in the answer, so the asker knows which of its requests it answers."""


class KVEndpointEvent(Message):
    """The answer to KVEndpointRequest: how to reach the rank's KV memory on the data plane."""

    rank: int
    """Worker rank."""
    endpoint: EndpointInfo
    """The transfer engine to connect to."""
    key: str = ""
    """The request's key."""
    regions: list[RegionInfo] = []
    """One region per layer, in layer order, block b of a layer at b * block_bytes; or one region of all layers
    (`layer_blocks`, `staging_blocks`)."""
    block_bytes: int = 0
    """Bytes of one block of one layer, bytes."""
    staging_blocks: int = 0
    """0: `regions` are the KV layers. Otherwise one staging region of layers x staging_blocks blocks (layer l's
    slot i at (l * staging_blocks + i) * block_bytes), filled on KVStageRequest: the KV is not in host memory."""
    layer_blocks: int = 0
    """Unstaged, 0: one region per layer. Otherwise one region holds every layer, layer l's block b at
    (l * layer_blocks + b) * block_bytes."""
    error: str | None = None
    """Set when the rank cannot serve its KV (then the other fields are empty)."""
    kv_dtype: str = ""
    """Element type of the KV cache ("bfloat16", "float8_e4m3fn", ...); a reader of another type refuses it."""
    state_regions: list[RegionInfo] = []
    """Hybrid models: the recurrent-state pools (each delta-net layer's conv, then recurrent state), one region each;
    snapshot slot s's row r = state_row_base + s starts at r * state_row_bytes[i]."""
    state_row_bytes: list[int] = []
    """Bytes of one row of each state region."""
    state_row_base: int = 0
    """The pools' row of snapshot slot 0 (the running slots come first)."""


class KVStageRequest(Message):
    """Decode-side KV-migration actor -> prefill-side one: copy these blocks into my staging region's slots
    0..n-1 (every layer), then answer KVStagedEvent. One at a time per requester: the region is its own
    (the one KVEndpointEvent described to the same reply_to)."""

    key: str
    """Echoed in the answer (the requester's name for this peer)."""
    transfer_id: str
    """The transfer the blocks belong to."""
    block_ids: Array
    """Prefill-side KV blocks, int32, at most staging_blocks."""
    reply_to: str
    """The requester's inbox: answers go there, and it names the requester's staging region."""


class KVStagedEvent(Message):
    """The staging region holds the requested blocks (or why it does not)."""

    key: str
    """The request's key."""
    transfer_id: str
    """The request's transfer id."""
    error: str | None = None
    """Set when the blocks could not be staged."""


class KVSendRequest(Message):
    """Decode-side KV-migration actor -> prefill-side one (torch_dist backend): send these blocks of every
    layer over our pair's process group, in rounds of `round_blocks`; answer KVSendEvent first. The requester
    receives right after that answer; it sends the next request only once this one has landed."""

    key: str
    """Echoed in the answer (the requester's name for this peer)."""
    transfer_id: str
    """The transfer the blocks belong to."""
    block_ids: Array
    """Prefill-side KV blocks, int32, in the order the requester places them."""
    reply_to: str
    """The requester's inbox: answers go there, and it names the pair (the one KVEndpointEvent announced)."""
    round_blocks: int
    """Most blocks per send; both ends cut the list the same way."""


class KVSendEvent(Message):
    """The prefill rank's answer to KVSendRequest: it sends now (or says why it will not, and sends nothing)."""

    key: str
    """The request's key."""
    transfer_id: str
    """The request's transfer id."""
    error: str | None = None
    """Set when nothing will be sent (unknown requester, a block outside the cache)."""


class BlocksReleasedEvent(Message):
    """Decode scheduler -> prefill scheduler: nothing will read the transfer's blocks any more."""

    transfer_id: str
    """The request's transfer id."""


# ---------------------------------------------------------------------------------------------
# 5. scheduler -> detokenizer -> front end


class SeqTokens(Message):
    """New tokens of one sequence in one step."""

    rid: str
    """Sequence id."""
    token_ids: list[int]
    """Tokens generated since the last delta."""
    finish_reason: str | None = None
    """"stop", "length" or "abort" on the sequence's last delta."""
    stop_token: int | None = None
    """The EOS / stop token id that ended it, if any."""
    logprobs: list[float] | None = None
    """Logprob per token in token_ids."""
    top_ids: list[list[int]] | None = None
    """Top-n alternatives per token."""
    top_logprobs: list[list[float]] | None = None
    """Their logprobs."""
    num_prompt_tokens: int = 0
    """Prompt length, tokens (for usage)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache, tokens."""
    sampling: SamplingParams | None = None
    """Set on a sequence's first delta only: stop strings and detokenization options."""
    prompt_tail: list[int] | None = None
    """Set on the first delta only: the last prompt tokens, so the first output token decodes in context."""
    reply_to: str | None = None
    """Set on the first delta only, of a request another node's front end routed here: where its text goes."""
    queue_time_s: float | None = None
    """Set on the first delta only: from the request's arrival to its first scheduled step, seconds."""
    prompt_logprobs: PromptLogprobs | None = None
    """Set on the first delta only, when the request asked for its prompt's logprobs."""


class TokenDelta(Message):
    """All sequences' new tokens of one step, batched into one message."""

    items: list[SeqTokens]
    """One entry per sequence that changed."""
    dp_rank: int = 0
    """The data-parallel rank whose scheduler runs them (where a stop string's AbortCmd goes)."""


class SeqText(Message):
    """New text of one sequence, ready for the client."""

    rid: str
    """Sequence id."""
    text: str
    """Text since the last delta (never ends inside a multi-byte character)."""
    token_ids: list[int]
    """Tokens since the last delta."""
    finish_reason: str | None = None
    """"stop", "length" or "abort" on the last delta."""
    stop_reason: str | int | None = None
    """The stop string or stop token id that matched."""
    logprobs: list[float] | None = None
    """Logprob per token in token_ids."""
    top_ids: list[list[int]] | None = None
    """Top-n alternatives per token."""
    top_logprobs: list[list[float]] | None = None
    """Their logprobs."""
    num_prompt_tokens: int = 0
    """Prompt length, tokens."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache, tokens."""
    num_output_tokens: int = 0
    """Tokens generated so far, tokens."""
    queue_time_s: float | None = None
    """On the first delta: from the request's arrival to its first scheduled step, seconds (SeqTokens')."""
    prompt_logprobs: PromptLogprobs | None = None
    """On the first delta, when the request asked for its prompt's logprobs (SeqTokens')."""


class TextDelta(Message):
    """All sequences' new text of one step."""

    items: list[SeqText]
    """One entry per sequence that changed."""


class SchedulerStatsEvent(Message):
    """The scheduler's state for /metrics, sent to the front end after steps (throttled) and when it idles."""

    num_running: int
    """Sequences in the running batch."""
    num_waiting: int
    """Sequences queued for admission."""
    kv_usage: float
    """Fraction of KV blocks in use [0, 1]."""
    prefix_cache_hit_rate: float
    """Prompt tokens served from the prefix cache / prompt tokens queried [0, 1]."""
    num_preemptions: int
    """Sequences preempted since start."""
    kv_capacity_tokens: int
    """KV cache capacity, tokens."""
    num_transfers: int = 0
    """Disaggregated transfers this engine still holds KV blocks for (prefill: pinned until BlocksReleased)."""
    kv_migrated_bytes: int = 0
    """KV bytes pulled into this engine by migrations since start (decode role), bytes."""
    dp_rank: int = 0
    """The data-parallel rank of the scheduler that sent it (each rank's scheduler reports its own state)."""
    spec_draft_tokens: int = 0
    """Speculative decoding: draft tokens verified since start, tokens."""
    spec_accepted_tokens: int = 0
    """Speculative decoding: draft tokens accepted since start, tokens."""
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache since start, tokens."""
    prefix_cache_hits: int = 0
    """Of those, tokens found there, tokens."""


class RequestFailedEvent(Message):
    """A request was refused or failed; the front end answers the client with this error."""

    rid: str
    """Request id."""
    message: str
    """Human-readable reason."""
    status: int = 400
    """HTTP status the front end should answer with."""
    param: str | None = None
    """The request field at fault, OpenAI style."""
    code: str | None = None
    """Machine-readable error code."""


# ---------------------------------------------------------------------------------------------
# Actor lifecycle: actors -> supervisor, supervisor -> actors


class ReadyEvent(Message):
    """An actor finished setup and listens on its address."""

    actor: str
    """Actor name in the topology."""
    instance: int
    """Replica index, 0-based."""
    pid: int
    """OS process id."""
    host: str
    """Host name of the process."""
    address: str
    """Where its inbox listens (a ZeroMQ URL)."""
    detail: dict[str, str] = {}
    """Actor-specific facts for the ready log (model, KV capacity, kernels)."""


class HeartbeatEvent(Message):
    """I am alive; sent every heartbeat interval."""

    actor: str
    """Actor name."""
    instance: int
    """Replica index."""
    seq: int
    """Heartbeat counter."""


class StopCmd(Message):
    """Stop gracefully: finish the current message, close sockets, exit."""

    reason: str = ""
    """Why (logged)."""


class ActorFailedEvent(Message):
    """The supervisor saw an actor die or go silent; the topology is being torn down."""

    actor: str
    """Actor name."""
    instance: int
    """Replica index."""
    reason: str
    """Exit code or missed heartbeats, readable."""


# ---------------------------------------------------------------------------------------------
# Diagnostics: a ping-pong pair to check a topology and measure the transport


class PingRequest(Message):
    """Echo me back: measures round trips and checks wiring."""

    seq: int
    """Sequence number chosen by the sender."""
    sent_ns: int = 0
    """Sender's time.perf_counter_ns() at send, nanoseconds."""
    payload: Array | None = None
    """Any numeric array, returned unchanged."""
    reply_to: str = ""
    """Inbox address (ZeroMQ URL) to answer to; lets a tool or test outside the topology be the client."""


class PongResult(Message):
    """The echo of a PingRequest."""

    seq: int
    """The ping's sequence number."""
    sent_ns: int = 0
    """The ping's sent_ns, nanoseconds."""
    payload: Array | None = None
    """The ping's payload."""
    echoed_by: str = ""
    """Name of the actor that answered."""


ALL_MESSAGES: tuple[type[Message], ...] = tuple(
    cls for cls in list(globals().values()) if isinstance(cls, type) and issubclass(cls, Message) and cls is not Message
)
"""Every concrete message type (for the codec's catch-all decoder and the round-trip tests)."""

LIFECYCLE = (ReadyEvent, HeartbeatEvent, StopCmd, ActorFailedEvent)
"""Messages every actor and the supervisor understand."""

AnyMessage = Union[ALL_MESSAGES]  # type: ignore[valid-type]
"""Union of every message: decoding against it accepts anything the schema knows."""
