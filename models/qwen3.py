"""Qwen3 dense decoder: Llama's blocks with per-head RMSNorm on q and k before RoPE (q_norm/k_norm),
an explicit head_dim (128 even where hidden/heads differs) and GQA; everything else is shared."""

from __future__ import annotations

from typing import ClassVar

from flotilla.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense (0.6B ... 32B); weight names match Llama's plus self_attn.{q,k}_norm.weight."""

    qk_norm: ClassVar[bool] = True
