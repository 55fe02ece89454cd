"""SeqState: what a worker remembers about one running sequence between steps (its tokens, its block table, the
tokens still on the device, drafts, grammar, images, recurrent-state slot)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from flotilla.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from flotilla.actors.encoder import SeqImages
    from flotilla.actors.grammar import SequenceGrammar


@dataclass(slots=True)
class SeqState:
    """What the worker remembers about one running sequence."""

    buffer: np.ndarray
    """int32 token storage with spare capacity: prompt, then every generated token (see `tokens`)."""
    length: int
    """Tokens stored in buffer."""
    num_prompt_tokens: int
    """Length of the original prompt, tokens."""
    num_computed: int
    """Tokens whose KV is in the cache, tokens."""
    table: np.ndarray
    """int32 storage of the sequence's KV block table, with spare capacity (see `block_ids`)."""
    num_blocks: int
    """Blocks in the table."""
    sampling: SamplingParams
    needs_history: bool = field(default=False)
    """Penalties need the prompt / output token ids at sampling time."""
    host_length: int = 0
    """Tokens of `buffer` written; the ones after it (up to `length`) are sampled but still on the device."""
    device_tokens: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    """position -> (device tensor, row) for each token sampled by a step not yet finished."""
    drafts: list[int] = field(default_factory=list)
    """Speculative decoding: the draft tokens the next step verifies (actors/spec_decode.py)."""
    state_slot: int = -1
    """A hybrid model's recurrent-state slot (ModelRunner.num_state_slots); -1 without one."""
    grammar: SequenceGrammar | None = None
    """Structured outputs: the matcher that masks its logits (actors/grammar.py); None: unconstrained."""
    prompt_logprobs: int | None = None
    """Score its prompt's tokens with this many alternatives as its prefill runs (actors/prompt_logprobs.py)."""
    images: SeqImages | None = None
    """A prompt with images: their items and the prompt's 3-D rotary positions (actors/encoder.py)."""

    @property
    def rope_delta(self) -> int:
        """What a position after the prompt's images adds to its index (0 without images)."""
        return 0 if self.images is None else self.images.rope_delta

    @classmethod
    def new(cls, token_ids: np.ndarray, block_ids: np.ndarray, **kw: object) -> SeqState:
        buffer = np.empty(max(2 * len(token_ids), 64), dtype=np.int32)
        buffer[:len(token_ids)] = token_ids
        table = np.empty(max(2 * len(block_ids), 16), dtype=np.int32)
        table[:len(block_ids)] = block_ids
        return cls(buffer=buffer, length=len(token_ids), host_length=len(token_ids), table=table,
                   num_blocks=len(block_ids), **kw)

    @property
    def block_ids(self) -> np.ndarray:
        """The KV block table (a view, no copy)."""
        return self.table[:self.num_blocks]

    def add_blocks(self, block_ids: np.ndarray) -> None:
        """Append blocks to the table (amortised O(1) per block)."""
        end = self.num_blocks + len(block_ids)
        if end > len(self.table):
            self.table = np.concatenate((self.table, np.empty(max(end, len(self.table)), dtype=np.int32)))
        self.table[self.num_blocks:end] = block_ids
        self.num_blocks = end

    @property
    def tokens(self) -> np.ndarray:
        """All tokens on the host (a view, no copy)."""
        return self.buffer[:self.host_length]

    def settle(self, token: int) -> None:
        """The next sampled token reached the host: store it (tokens settle in the order they were sampled)."""
        if self.host_length == len(self.buffer):  # amortised O(1): double the storage
            self.buffer = np.concatenate((self.buffer, np.empty_like(self.buffer)))
        self.buffer[self.host_length] = token
        self.device_tokens.pop(self.host_length, None)
        self.host_length += 1
