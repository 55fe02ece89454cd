"""DeepSeek-V4 (V4-Flash, V4-Pro): attention over a sliding window plus compressed entries, residual streams mixed by
hyper-connections, hash-routed first MoE layers.

The architecture (transformers' models/deepseek_v4):
- mHC: the residual is `hc_mult` streams. Before attention and before the MLP a hyper-connection (fp32) reads the
  streams (an RMSNorm over them all, one linear map) into sigmoid `pre` weights that collapse them into the block's
  input, sigmoid `post` weights that spread its output back, and a Sinkhorn-normalised `comb` mixing of the streams
  themselves; `hc_head` collapses them before the final norm.
- Attention, every layer: a low-rank query (q_a_proj, RMSNorm, q_b_proj, then an RMSNorm per head without weight),
  ONE key-value head (K = V, head_dim wide) whose trailing rope_dim dims take interleaved RoPE, learned per-head sink
  logits in the softmax's denominator, a window of the last `sliding_window` tokens, the inverse rotation of the
  output's rope dims, and a grouped output projection (o_groups x o_lora_rank, then o_b_proj).
- CSA layers (compressed sparse attention) add compressed entries: a compressor pools each window of `rate` tokens
  (two overlapping series: entry w takes window w's second half and window w-1's first half of the projections,
  softmax-gated with a learned position bias), RMSNorms and ropes the entry at position w * rate, and a lightning
  indexer with its own smaller compressor scores the entries (sum over heads of w_h * ReLU(q_h . k)) and keeps the
  top `index_topk` a query may see (entry w only from position (w + 1) * rate - 1 on). HCA layers (heavily
  compressed) pool non-overlapping windows of `rate` tokens and let a query see every finished entry.
- MoE on every layer: sqrt(softplus) router scores, top-k on scores + a bias (the first layers instead look the
  experts up by token id: hash MoE), weights renormalised x routed_scaling_factor, a shared expert; gate and up
  activations clamped at swiglu_limit.

The paged cache holds one row per token per layer: the token's key-value head, then (CSA / HCA) its compressor
projections and (CSA) its indexer's, then the entry (and indexer entry) of the window the token ends, if it ends one:
the step whose tokens finish a window pools it from the window's rows and writes it there. So a prefix hit, a chunked
prefill, a preemption or a KV migration needs nothing beyond the rows, and a step reads the window's rows and the
entries' rows, O(sliding_window + length / rate) per sequence, not the whole context.

Two paths share the projections, the cache rows and the pooling of finished windows: the torch reference (a loop
over the step's prompt chunks, decodes batched), and the kernels ("triton", auto on a GPU): each token's keys as a
list of cache offsets (its window, then the entries it sees: all of them under HCA, the indexer's top-k under CSA,
scored by kernels/mla/dsa_triton.py over the entries' rows), read by kernels/triton/sink_attention.py.

The attention lives in models/deepseek_v4_attention.py, the checkpoint's names in models/deepseek_v4_checkpoint.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.kernels.attention import AttentionMetadata
from flotilla.kernels.moe import MoEBackend, get_moe_backend
from flotilla.kernels.quant.fp8_ref import dequantize_checkpoint
from flotilla.models.deepseek_v4_attention import DeepseekV4Attention, RMSNorm, Rotary, StepRows, rms
from flotilla.models.deepseek_v4_checkpoint import MTP_COPIES, fp4_dequantize, mtp_tensor, param_name, rank_share
from flotilla.models.hf_config import DeepseekV4Params, HFModelConfig
from flotilla.models.parallel import all_reduce, divide, tp_group

class HyperConnection(nn.Module):
    """mHC: the block input collapsed from the streams, and the weights that spread its output back and mix them."""

    def __init__(self, hidden: int, v4: DeepseekV4Params, eps: float) -> None:
        super().__init__()
        n = v4.hc_mult
        self.n, self.iters, self.hc_eps, self.eps = n, v4.hc_sinkhorn_iters, v4.hc_eps, eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, hidden] -> (post [T, n], comb [T, n, n], the block's input [T, hidden])."""
        n = self.n
        mix = F.linear(rms(streams.flatten(1), self.eps), self.fn)
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block: its output spread by `post`, plus the streams mixed by comb (transposed)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


class HashGate(nn.Module):
    """A hash-MoE layer's router: its learned scores' weight, and the token id -> experts table that picks."""

    def __init__(self, vocab_size: int, top_k: int, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.int64))

    def dummy_init_(self, generator: torch.Generator) -> None:
        """load_format dummy: small random scores, and k distinct random experts per token (an all-zero table would
        send every token to expert 0, which no benchmark should measure)."""
        with torch.no_grad():
            self.weight.uniform_(-1e-3, 1e-3, generator=generator)
            draws = torch.rand(self.tid2eid.shape[0], self.weight.shape[0], generator=generator,
                               device=self.weight.device)
            self.tid2eid.copy_(draws.argsort(dim=-1)[:, :self.tid2eid.shape[1]])


class DeepseekV4MoE(nn.Module):
    """Routed experts (top-k, or looked up by token id) and a shared expert, activations clamped."""

    def __init__(self, config: HFModelConfig, v4: DeepseekV4Params, layer_idx: int, backend: MoEBackend) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.backend = backend
        tp = tp_group().size
        e, h = moe.num_experts, config.hidden_size
        i = divide(moe.moe_intermediate_size, tp, "moe_intermediate_size")  # (this rank's share of each expert)
        self.top_k, self.scale, self.limit = moe.num_experts_per_tok, moe.routed_scaling_factor, v4.swiglu_limit
        self.hashed = v4.hashed(layer_idx)
        self.gate = HashGate(config.vocab_size, self.top_k, e, h) if self.hashed else nn.Module()
        if not self.hashed:
            self.gate.weight = nn.Parameter(torch.zeros(e, h))
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.experts.down_proj = nn.Parameter(torch.zeros(e, h, i))
        self.shared_experts = nn.Module()
        shared = i * max(moe.num_shared_experts, 1)  # (likewise)
        self.shared_experts.gate_proj = nn.Linear(h, shared, bias=False)
        self.shared_experts.up_proj = nn.Linear(h, shared, bias=False)
        self.shared_experts.down_proj = nn.Linear(shared, h, bias=False)

    def _act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        scores = F.softplus(F.linear(x, self.gate.weight)).sqrt()
        if self.hashed:
            idx = self.gate.tid2eid[input_ids]
        else:
            idx = torch.topk(scores + self.gate.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, idx)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scale
        out = self.backend.fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights.float(),
                                         idx.to(torch.int32), swiglu_limit=self.limit)
        s = self.shared_experts
        return all_reduce(out + s.down_proj(self._act(s.gate_proj(x), s.up_proj(x))))


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config: HFModelConfig, v4: DeepseekV4Params, layer_idx: int, backend: MoEBackend,
                 kernels: str = "torch") -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = DeepseekV4Attention(config, v4, layer_idx, kernels)
        self.mlp = DeepseekV4MoE(config, v4, layer_idx, backend)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.attn_hc = HyperConnection(config.hidden_size, v4, eps)
        self.ffn_hc = HyperConnection(config.hidden_size, v4, eps)


class HCHead(nn.Module):
    """Collapses the residual streams into one hidden state (sigmoid weights from an RMSNorm over them all)."""

    def __init__(self, hidden: int, v4: DeepseekV4Params, eps: float) -> None:
        super().__init__()
        n = v4.hc_mult
        self.hc_fn = nn.Parameter(torch.zeros(n, n * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.eps, self.hc_eps = eps, v4.hc_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, n, hidden] -> [T, hidden] in their dtype."""
        pre = torch.sigmoid(F.linear(rms(streams.flatten(1), self.eps), self.hc_fn) * self.hc_scale + self.hc_base)
        return ((pre + self.hc_eps).unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


class DeepseekV4MTP(nn.Module):
    """The multi-token-prediction layer (the checkpoint's `mtp.0.*`, which transformers drops; vLLM's
    DeepSeekV4MultiTokenPredictorLayer): each of the main model's residual streams RMSNormed (hnorm) and projected
    (h_proj), plus the projected, RMSNormed embedding of the next token (e_proj, enorm), are the streams of one
    decoder layer (sliding-window attention with its own cache layer, routed experts); its own hc_head and norm
    collapse them before the main model's LM head."""

    def __init__(self, config: HFModelConfig, v4: DeepseekV4Params, backend: MoEBackend, kernels: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(hidden, eps), RMSNorm(hidden, eps)
        self.e_proj = nn.Linear(hidden, hidden, bias=False)
        self.h_proj = nn.Linear(hidden, hidden, bias=False)
        self.block = DeepseekV4DecoderLayer(config, v4, config.num_hidden_layers, backend, kernels)
        self.hc_head = HCHead(hidden, v4, eps)
        self.norm = RMSNorm(hidden, eps)

    def streams(self, embedded: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """The block's input streams [T, n, hidden] from the next tokens' embeddings [T, hidden] and the previous
        streams [T, n, hidden] (the main model's, or this layer's own when drafting further)."""
        return self.h_proj(self.hnorm(prev)) + self.e_proj(self.enorm(embedded)).unsqueeze(1)


class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4's decoder (the step interface of LlamaForCausalLM) over the paged rows of the module docstring."""

    fused_ops_name = "torch"
    reads_fp8_checkpoints = True
    """load_weights dequantizes FP8 and FP4 (int8-packed) weights itself."""
    multi_token_graphs = False
    """Steps of several tokens per sequence (prompt chunks, MTP's verify steps) read the step's rows on the host
    (StepRows): the runner captures no graphs of them; decode steps replay graphs."""

    def __init__(self, config: HFModelConfig, *, attention_backend: str = "auto", moe_backend: str = "auto",
                 mtp: bool = False) -> None:
        """mtp: also build and load the checkpoint's MTP layer (`mtp.0.*`), for speculative decoding."""
        super().__init__()
        v4 = config.deepseek_v4
        if v4 is None:
            raise ValueError("config.json is not a DeepSeek-V4 config (model_type deepseek_v4)")
        if mtp and config.num_nextn_predict_layers < 1:
            raise ValueError("speculative method 'mtp' needs the checkpoint's multi-token-prediction layer, but "
                             "config.json declares none (num_nextn_predict_layers)")
        if config.num_key_value_heads != 1:
            raise ValueError(f"DeepSeek-V4 has one key-value head, config.json says {config.num_key_value_heads}")
        if attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"DeepSeek-V4's attention runs on the triton kernels or the torch reference, not "
                             f"{attention_backend!r}")
        from flotilla.kernels.attention import triton_usable
        from flotilla.kernels.mla import best_mla_backend

        if attention_backend == "auto":  # (triton where the model's device runs it, as for sparse MLA)
            attention_backend = best_mla_backend(torch.get_default_device())
        elif attention_backend == "triton" and not triton_usable():
            raise ValueError("DeepSeek-V4's triton attention needs triton (and a GPU, or TRITON_INTERPRET=1)")
        self.attention_backend_name = "v4_triton" if attention_backend == "triton" else "torch"
        """The attention path (the ready log line). v4_triton is a static-table backend: a step of decodes reads
        nothing back (StepRows), so decode steps replay CUDA graphs (actors/cuda_graphs.py); the torch reference runs
        eager."""
        self.config, self.v4 = config, v4
        self.moe_backend = get_moe_backend(moe_backend, device=torch.get_default_device(),
                                           dtype=torch.get_default_dtype())
        self.moe_backend_name = self.moe_backend.name
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(DeepseekV4DecoderLayer(config, v4, i, self.moe_backend, attention_backend)
                                          for i in range(config.num_hidden_layers))
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.model.hc_head = HCHead(config.hidden_size, v4, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(v4.rope_dim, v4.main_rope_theta, None)
        self.compress_rotary = Rotary(v4.rope_dim, v4.compress_rope_theta, v4.compress_rope_scaling)
        self.mtp = DeepseekV4MTP(config, v4, self.moe_backend, attention_backend) if mtp else None
        self.num_hidden_layers = config.num_hidden_layers
        self.num_mtp_layers = 1 if mtp else 0
        self.num_layers = config.num_hidden_layers + self.num_mtp_layers
        """KV cache layers: the decoder stack's, then the MTP layer's."""
        blocks = [*self.model.layers, *([self.mtp.block] if self.mtp is not None else [])]
        self.row_width = max(layer.self_attn.row_width for layer in blocks)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Every layer's cache: [num_blocks, block_size, row] (one row per token; the widest layer's width)."""
        return (num_blocks, block_size, self.row_width)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """The residual streams after the last layer, flattened [T, hc_mult * hidden]: compute_logits collapses them
        (hc_head, norm, LM head) for the rows that sample, and the MTP layer reads them whole."""
        x = self.model.embed_tokens(input_ids)
        step = StepRows(meta, x.device)  # (once for every layer)
        streams = x.unsqueeze(1).expand(-1, self.v4.hc_mult, -1).contiguous()
        for layer, cache in zip(self.model.layers, kv_caches, strict=False):  # (an MTP layer's cache comes last)
            streams = self._layer(layer, streams, input_ids, positions, cache, meta, step)
        return streams.flatten(1)

    def _layer(self, layer: DeepseekV4DecoderLayer, streams: torch.Tensor, input_ids: torch.Tensor,
               positions: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, step: StepRows) -> torch.Tensor:
        attn = layer.self_attn
        rotary = self.rotary if attn.rate == 0 else self.compress_rotary
        post, comb, collapsed = layer.attn_hc(streams)
        out = attn(layer.input_layernorm(collapsed), positions, rotary, self.compress_rotary, cache, meta, step)
        streams = merge(streams, out, post, comb)
        post, comb, collapsed = layer.ffn_hc(streams)
        return merge(streams, layer.mlp(layer.post_attention_layernorm(collapsed), input_ids), post, comb)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """forward's streams [N, hc_mult * hidden] -> float32 logits [N, vocab]."""
        streams = hidden.view(hidden.shape[0], self.v4.hc_mult, -1)
        return self._logits(self.model.norm(self.model.hc_head(streams)), out)

    def _logits(self, hidden: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if out is not None:
            out.copy_(logits)
            return out
        return logits

    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor,
                    kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        """The MTP layer at `positions`: input_ids int64 [T] are the tokens one position ahead, prev_hidden the
        streams there [T, hc_mult * hidden] (forward's, or this layer's own when drafting further); writes its rows
        into its cache layer (the last of kv_caches); returns its streams, flattened the same way."""
        assert self.mtp is not None
        n = self.v4.hc_mult
        streams = self.mtp.streams(self.model.embed_tokens(input_ids), prev_hidden.view(prev_hidden.shape[0], n, -1))
        step = StepRows(meta, streams.device)
        return self._layer(self.mtp.block, streams, input_ids, positions, kv_caches[self.num_hidden_layers], meta,
                           step).flatten(1)

    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer's streams [N, hc_mult * hidden] -> float32 logits [N, vocab] of the token two positions
        ahead (its own hc_head and norm, the main model's LM head)."""
        assert self.mtp is not None
        streams = hidden.view(hidden.shape[0], self.v4.hc_mult, -1)
        return self._logits(self.mtp.norm(self.mtp.hc_head(streams)), None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """DeepSeek's checkpoint layout (layers.N.attn.wq_a, ffn.experts.E.w1, ...; with or without `model.`) or
        transformers' names; each routed expert's w1 / w3 / w2 goes into its row of the stacked experts. An FP8
        block-scaled checkpoint (V4-Flash-Base) and MXFP4 experts (V4-Flash) are dequantized as they load (`X.weight`
        with `X.weight_scale_inv`).
        The first MTP layer's tensors (`mtp.0.*`) load when it is built (checkpoint_filter skips them otherwise)."""
        params = dict(self.named_parameters())
        targets = {**dict(self.named_buffers()), **params}
        loaded: set[str] = set()
        for name, tensor in self._dequantized(weights):
            target_name, row, part = param_name(name)
            target = targets.get(target_name)
            if target is None:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of DeepSeek-V4")
            tensor = rank_share(target_name, tensor, row is not None)
            if row is not None:  # one routed expert's matrix: its slice of the stacked tensor
                half = target.shape[1] // 2
                target = target[row] if part is None else target[row, part * half:(part + 1) * half]
            if tensor.shape != target.shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                                 f"{tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor)
            if target_name in params:
                loaded.add(target_name)
        return loaded

    def _dequantized(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with each quantized weight (FP8, or FP4 packed in int8) and its block scales
        turned into one float weight; others as they are."""
        quant = self.config.quantization
        if quant is None:
            return iter(weights)
        return dequantize_checkpoint(weights, quant.weight_block_size, self.lm_head.weight.dtype, fp4=fp4_dequantize)

    def checkpoint_filter(self) -> Callable[[str], bool]:
        """The tensors to read: the MTP layers' only when the first one is built, and not its copies of the main
        model's embedding and LM head."""
        def keep(name: str) -> bool:
            if not name.removeprefix("model.").startswith("mtp."):
                return True
            rest = mtp_tensor(name)
            return self.mtp is not None and rest is not None and rest not in MTP_COPIES
        return keep
