"""DeepSeek-V3's multi-head latent attention (MLA), the attention of models/deepseek_v3.py (and Kimi-K2's).

MLA. Per token, kv_a_proj_with_mqa makes a latent c_kv (kv_lora_rank, then RMSNorm) and one rotated key
part k_pe (qk_rope_head_dim) shared by all heads; kv_b_proj expands c_kv into each head's no-rope key
(W_UK) and value (W_UV). The cache holds only [c_kv | k_pe] per token (kernels/mla: one "head" of
kv_lora_rank + qk_rope_head_dim), and attention never expands it: W_UK is absorbed into the query
(q_latent = q_nope W_UK, since q_nope . (W_UK c) = (q_nope W_UK) . c), so every head attends to the same
cache rows (MQA with keys [c_kv | k_pe] and values c_kv), and the latent output is projected by W_UV per
head before o_proj. The same path serves prefill chunks and decodes.

Tensor parallelism: each rank keeps num_heads / tp heads; q_b_proj (q_proj without q_lora) and kv_b_proj are
column-parallel by heads, so W_UK / W_UV are absorbed per rank on its heads, and o_proj is row-parallel (one
all-reduce). q_a_proj and kv_a_proj_with_mqa (one fused GEMM, fused_qkv_a_proj, where the FP8 blocks allow) and
their norms are replicated: the latent and k_pe are per token, so every rank writes and reads the whole latent cache.

DeepSeek's checkpoints rotate interleaved pairs of the rope dims; their rows are reordered into halves once at load
(deinterleaved_rope_rows) where the FP8 weight blocks allow, else the rotary parts are de-interleaved at every step.

Sparse attention (DeepSeek-V3.2, GLM-5: config.dsa): a DSAIndexer beside the attention scores the cached positions
for each query and the attention reads only its top-k (kernels/mla/dsa_ref.py). Its key per token is stored after
the latent in the same cache row ([c_kv | k_pe | index key]), so prefix caching, preemption and KV migration carry
it with the latent. GLM-5's "shared" layers run no indexer and reuse the previous layer's choice (it travels in
AttentionMetadata.backend_state from layer to layer).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from flotilla.kernels.attention import AttentionMetadata
from flotilla.kernels.mla import MLABackend, dsa_ref
from flotilla.kernels.ops import current_ops
from flotilla.kernels.quant import FP8_DTYPE
from flotilla.kernels.rope import rope_type, yarn_mscale
from flotilla.models.hf_config import DSAConfig, HFModelConfig, MLAConfig
from flotilla.models.linears import Linears
from flotilla.models.llama import Linear, RMSNorm
from flotilla.models.parallel import divide, tp_group

LATENT_NORM_EPS = 1e-6
"""eps of q_a_layernorm and kv_a_layernorm: DeepSeek's reference code and transformers build them with
the RMSNorm default, not config.rms_norm_eps."""

WHOLE = "whole"
"""The shard id of a column-parallel layer that is one checkpoint tensor (not fused from parts)."""


def softmax_scale(config: HFModelConfig, mla: MLAConfig) -> float:
    """1/sqrt(qk_nope + qk_rope) times YaRN's mscale(factor, mscale_all_dim)^2 when the rope is scaled
    (transformers' yarn_apply_mscale; DeepSeek-V3's 40x YaRN makes it ~1.87)."""
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling
    if rope_type(scaling) != "default" and scaling is not None and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale *= mscale * mscale
    return scale


ROPE_ROWS = re.compile(r"self_attn\.(q_b_proj|q_proj|kv_a_proj_with_mqa)\.(weight|bias)$")
"""The checkpoint tensors whose output rows include rotary parts (each head's last qk_rope_head_dim rows of q; the
last qk_rope_head_dim rows of kv_a, k_pe)."""


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...) along the last dim: deinterleaved_rope_rows at every
    step, for the checkpoints whose weights cannot be reordered at load."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def rope_rows_in_blocks(config: HFModelConfig, mla: MLAConfig, block_rows: int) -> bool:
    """Whether every rotary row range (each q head's last qk_rope_head_dim rows, kv_a's last ones) lies inside one
    FP8 weight block of `block_rows` rows, so that reordering the rows leaves the block scales right."""
    nope, rope = mla.qk_nope_head_dim, mla.qk_rope_head_dim
    starts = [h * (nope + rope) + nope for h in range(config.num_attention_heads)] + [mla.kv_lora_rank]
    return all(start // block_rows == (start + rope - 1) // block_rows for start in starts)


def deinterleaved_rope_rows(tensor: torch.Tensor, kind: str, nope: int, rope: int) -> torch.Tensor:
    """The rows of a q (`kind` q_b_proj / q_proj: heads of nope + rope rows) or kv_a (kv_a_proj_with_mqa: k_pe's rope
    rows last) weight or bias with every rotary part's rows (x0, x1, x2, x3, ...) reordered (x0, x2, ..., x1, x3,
    ...): DeepSeek's interleaved rotary pairs laid out as halves, after which the neox rotation is exactly theirs
    (transformers de-interleaves the projections' outputs the same way, at every step). Done once to the weights
    at load, the GEMMs write the halves directly: the same values, and no copy per layer and step. A row
    permutation inside the rope rows never leaves an FP8 weight block (a head's rope rows lie in one 128-row block
    at DeepSeek-V3's 192-row heads, and so does kv_a's tail), so the block scales stay as they are. A tensor whose
    rows do not have the expected layout is returned as it is (the shape check that follows names it)."""
    rows = tensor.shape[0]
    per_head = nope + rope if kind != "kv_a_proj_with_mqa" else rows
    if rows < rope or rows % per_head:
        return tensor
    halves = torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2)))
    order = torch.arange(rows).view(rows // per_head, per_head)
    order[:, per_head - rope :] = order[:, per_head - rope :][:, halves]
    raw = tensor.view(torch.uint8) if tensor.dtype == FP8_DTYPE else tensor  # index_select has no e4m3 kernels
    return raw.index_select(0, order.flatten().to(raw.device)).view(tensor.dtype)


DSA_SELECTION = "dsa_selection"
"""AttentionMetadata.backend_state's key for the positions the last indexer chose this step (GLM-5's shared layers
reuse them)."""


class DSAIndexer(nn.Module):
    """The lightning indexer: per token one key (wk -> LayerNorm -> RoPE on its first qk_rope_head_dim dims) and
    index_n_heads queries from the q low-rank residual (wq_b -> RoPE), weighted per head from the hidden state
    (weights_proj); every rank runs it whole (it is per token, like the latent)."""

    def __init__(self, config: HFModelConfig, mla: MLAConfig, dsa: DSAConfig, linears: Linears,
                 kernels: str = "torch") -> None:
        """kernels: "triton" scores, stores and picks with kernels/mla/dsa_triton.py, "torch" with dsa_ref."""
        super().__init__()
        if mla.q_lora_rank is None:
            raise ValueError("sparse attention's indexer reads the low-rank query: config.json lacks q_lora_rank")
        self.num_heads, self.head_dim, self.topk = dsa.index_n_heads, dsa.index_head_dim, dsa.index_topk
        self.rope_dim = mla.qk_rope_head_dim
        self.deinterleave = dsa.rope_interleave  # (q and k alike: their dot products are those of interleaved RoPE)
        self.wq_b = linears.replicated(mla.q_lora_rank, self.num_heads * self.head_dim)
        self.wk = linears.replicated(config.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=LATENT_NORM_EPS)
        self.weights_proj = Linear(config.hidden_size, self.num_heads)  # (float in DeepSeek's FP8 checkpoints)
        self.scale = self.head_dim**-0.5
        self.ops = current_ops()
        if kernels == "triton":
            from flotilla.kernels.mla import dsa_triton  # optional dependency: imported only when chosen

            self._store, self._select = dsa_triton.store_index_keys, dsa_triton.select_topk
        else:
            self._store, self._select = dsa_ref.store_index_keys, dsa_ref.select_positions

    def forward(self, hidden: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, index_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Store the new tokens' keys into index_cache (the rows' indexer columns); the positions each attends to,
        int32 [T, K] (-1 = none)."""
        t, r = hidden.shape[0], self.rope_dim
        q = self.wq_b(q_resid).view(t, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(hidden))
        q_rot, k_rot = q[..., :r], k[:, :r]
        if self.deinterleave:
            q_rot, k_rot = _deinterleave(q_rot), _deinterleave(k_rot)
        q_rot, k_rot = self.ops.apply_rope(positions, q_rot.contiguous(), k_rot.reshape(t, 1, r).contiguous(),
                                           cos_sin_cache)
        q = torch.cat((q_rot, q[..., r:]), dim=-1)
        k = torch.cat((k_rot.view(t, r), k[:, r:]), dim=-1)
        self._store(k, index_cache, meta.slot_mapping)
        weights = self.weights_proj(hidden).float() * self.num_heads**-0.5
        return self._select(q, weights, index_cache, meta, self.topk, self.scale)


class DeepseekV3Attention(nn.Module):
    """MLA: q (low-rank or not) and the latent -> RoPE on the rope parts -> store [c_kv | k_pe] in the
    paged cache -> absorbed MQA over the latents -> W_UV per head -> o_proj."""

    def __init__(self, config: HFModelConfig, mla: MLAConfig, backend: MLABackend, linears: Linears,
                 layer_idx: int = 0) -> None:  # fmt: skip
        """layer_idx: which indexer a sparse-attention model's layer has (DSAConfig.runs_indexer)."""
        super().__init__()
        total_heads = config.num_attention_heads
        self.num_heads = divide(total_heads, tp_group().size, "num_attention_heads")
        """This rank's heads (all of them with one rank)."""
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        self.backend = backend
        self.scale = softmax_scale(config, mla)
        self.deinterleave = mla.rope_interleave
        """De-interleave the rotary parts at every step (the model turns it off where it reorders the weights'
        rows at load instead)."""
        self.kv_scale = 1.0
        """An FP8 latent cache holds [c_kv | k_pe] / kv_scale (kernels/mla); 1.0 without a calibrated scale."""
        hidden, bias = config.hidden_size, config.attention_bias
        # split by heads: q's and kv_b's rows, o_proj's input columns; the latent projections are replicated
        q_width = {WHOLE: total_heads * (self.nope_dim + self.rope_dim)}
        self.q_lora_rank = mla.q_lora_rank
        # q_a_proj and kv_a_proj_with_mqa read the same hidden: one GEMM of [q_a | kv_a] rows (vLLM's
        # fused_qkv_a_proj: one activation quantization and one GEMM fewer per layer), unless FP8 weight blocks
        # would straddle the two parts (Linears.can_fuse); the checkpoint's two tensors load into its parts
        latent_parts = {"q_a": mla.q_lora_rank or 0, "kv_a": self.kv_lora_rank + self.rope_dim}
        fuse = mla.q_lora_rank is not None and linears.can_fuse(latent_parts)
        self.fused_qkv_a_proj = (linears.replicated_fused(hidden, latent_parts, "fused_qkv_a_proj", bias=bias)
                                 if fuse else None)  # fmt: skip
        self.q_a_proj = (linears.replicated(hidden, mla.q_lora_rank, bias=bias)
                         if mla.q_lora_rank is not None and not fuse else None)  # fmt: skip
        self.kv_a_proj_with_mqa = None if fuse else linears.replicated(hidden, latent_parts["kv_a"], bias=bias)
        if mla.q_lora_rank is None:
            self.q_proj: nn.Module | None = linears.column(hidden, q_width, "q_proj")
            self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = linears.column(mla.q_lora_rank, q_width, "q_b_proj")
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = linears.column(self.kv_lora_rank, {WHOLE: total_heads * (self.nope_dim + self.v_dim)},
                                        "kv_b_proj", quantized=False)  # dequantized at load if FP8
        self.o_proj = linears.row(total_heads * self.v_dim, hidden, "o_proj", bias=bias)
        self.ops = current_ops()
        dsa = config.dsa
        self.sparse = dsa is not None
        """Sparse attention: each query reads only the positions an indexer chose (its own, or the previous
        layer's)."""
        self.indexer = (DSAIndexer(config, mla, dsa, linears, kernels=backend.name)
                        if dsa is not None and dsa.runs_indexer(layer_idx) else None)  # fmt: skip

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora_rank], W_UV [H, v, kv_lora_rank]): views of kv_b_proj's weight, so no copy
        (an FP8 checkpoint's kv_b_proj is dequantized into that weight at load)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.fused_qkv_a_proj is not None:  # views of one GEMM's [q_a | c_kv | k_pe] columns
            assert self.q_lora_rank is not None
            widths = [self.q_lora_rank, self.kv_lora_rank, self.rope_dim]
            q_a, c_kv, k_pe = self.fused_qkv_a_proj(hidden).split(widths, dim=-1)
        else:
            assert self.kv_a_proj_with_mqa is not None
            c_kv, k_pe = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
            q_a = self.q_a_proj(hidden) if self.q_a_proj is not None else None
        q_resid = None
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            assert q_a is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q_resid = self.q_a_layernorm(q_a)
            q = self.q_b_proj(q_resid)
        q_nope, q_pe = q.view(num_tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        if self.deinterleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe, k_pe = self.ops.apply_rope(positions, q_pe.contiguous(), k_pe.reshape(num_tokens, 1, self.rope_dim),
                                         cos_sin_cache)  # fmt: skip
        select = None
        if self.sparse:  # the cache rows end with the indexer's key: the latent is their first part
            latent_width = self.kv_lora_rank + self.rope_dim
            if self.indexer is not None:
                assert q_resid is not None
                select = meta.backend_state[DSA_SELECTION] = self.indexer(
                    hidden, q_resid, positions, cos_sin_cache, kv_cache[..., latent_width:], meta)
            else:
                select = meta.backend_state[DSA_SELECTION]
            kv_cache = kv_cache[..., :latent_width]
        self.backend.store_latent(c_kv, k_pe.view(num_tokens, self.rope_dim), kv_cache, meta.slot_mapping,
                                  self.kv_scale)

        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, kv_lora_rank]
        if select is None:
            out_latent = self.backend.forward(q_latent, q_pe, kv_cache, meta, self.scale, self.kv_scale)  # [T, H, r]
        else:
            out_latent = self.backend.forward(q_latent, q_pe, kv_cache, meta, self.scale, self.kv_scale, select=select)
        out = torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim))
