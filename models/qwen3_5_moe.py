"""Qwen3.5-MoE (Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B): a hybrid of gated DeltaNet layers and gated attention,
every layer's MLP sparse with a shared expert.

- Layer i is full attention when config.layer_types says so (every 4th), a gated delta net otherwise
  (kernels/gdn.py): in_proj -> depthwise causal conv1d (SiLU) over q/k/v -> L2-normalised q, k; the decay
  g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) -> the delta rule over the sequence's recurrent
  state -> RMSNormGated(o) * SiLU(z) -> out_proj.
- Gated attention: q_proj gives each head's query and an output gate ([q_h, gate_h] per head); zero-centred
  q/k RMSNorms; RoPE on the first partial_rotary_factor of each head's dims (M-RoPE, whose three rows are equal
  for text: plain RoPE); the paged KV cache; output * sigmoid(gate) -> o_proj.
- MoE: softmax top-k, renormalised, plus a shared expert scaled per token by sigmoid(shared_expert_gate).
- Every RMSNorm but the delta net's is zero-centred (x * (1 + w)): 1 is added to those weights at load.

Only the attention layers hold paged KV (`num_layers` counts them); each delta-net layer holds a state pool of
`allocate_state(num_slots)` slots, one per running sequence, addressed by AttentionMetadata.state_slots. Loads the
text model's checkpoints (Qwen3_5MoeForCausalLM) and the released multimodal ones
(Qwen3_5MoeForConditionalGeneration: the language model under `model.language_model.`; the vision tower is
skipped), and with `mtp=True` the MTP layer (`mtp.*`, Qwen35MTP) for speculative decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from flotilla.kernels import gdn
from flotilla.kernels.attention import AttentionBackend, AttentionMetadata, get_attention_backend, kv_cache_shape
from flotilla.kernels.moe import MoEBackend, get_moe_backend, select_experts
from flotilla.kernels.ops import current_ops, get_ops, use_ops
from flotilla.models.hf_config import HFModelConfig, LinearAttentionConfig
from flotilla.models.llama import Linear, LlamaForCausalLM, RMSNorm, RotaryEmbedding
from flotilla.models.parallel import (
    ColumnParallelLinear,
    check_shape,
    divide,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_reduce,
    tp_group,
)
from flotilla.models.qwen3_moe import ExpertTensors, StackedExperts

_ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight",
                 ".pre_fc_norm_embedding.weight", ".pre_fc_norm_hidden.weight")
"""Checkpoint norms stored as w of x * (1 + w) (with model.norm.weight and mtp.norm.weight)."""
_VISION_PREFIXES = ("model.visual.", "visual.")
"""A multimodal checkpoint's vision tower: not part of the text model."""
_MTP_PREFIXES = ("mtp.", "model.mtp.")
"""The multi-token-prediction layer: built and loaded for speculative decoding only."""


class GDNInProj(ColumnParallelLinear):
    """in_proj_qkv, in_proj_z, in_proj_b and in_proj_a as one GEMM, split by heads under tensor parallelism: each
    rank keeps its key heads' q and k and its value heads' v, z, b and a (value heads are grouped: value head i
    reads key head i // (value heads / key heads), so a rank's value heads read its own key heads)."""

    def __init__(self, hidden_size: int, la: LinearAttentionConfig) -> None:
        tp = tp_group()
        kd = divide(la.num_key_heads, tp.size, "linear_num_key_heads") * la.key_head_dim
        hv = divide(la.num_value_heads, tp.size, "linear_num_value_heads")
        vd = hv * la.value_head_dim
        self.full = {"q": la.num_key_heads * la.key_head_dim, "k": la.num_key_heads * la.key_head_dim,
                     "v": la.num_value_heads * la.value_head_dim}
        super().__init__(hidden_size, {
            "q": (self.full["q"], kd, tp.rank * kd), "k": (self.full["k"], kd, tp.rank * kd),
            "v": (self.full["v"], vd, tp.rank * vd), "z": (self.full["v"], vd, tp.rank * vd),
            "b": (la.num_value_heads, hv, tp.rank * hv), "a": (la.num_value_heads, hv, tp.rank * hv)}, bias=False)

    def load(self, param: nn.Parameter, src: torch.Tensor, names: tuple[str, str], shard: str) -> None:
        if shard != "qkv":
            return super().load(param, src, names, shard)
        for part, rows in zip("qkv", src.split([self.full["q"], self.full["k"], self.full["v"]])):
            super().load(param, rows, names, part)

    def split_qkv(self, src: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's q, k and v rows (along `dim`) of a tensor laid out as the checkpoint's qkv channels."""
        parts = src.split([self.full["q"], self.full["k"], self.full["v"]], dim=dim)
        return torch.cat([p.narrow(dim, self.parts[c][2], self.parts[c][1]) for c, p in zip("qkv", parts)], dim)


class _Conv1dWeight(nn.Module):
    """The depthwise conv's weight [channels, 1, kernel], cut to this rank's qkv channels at load."""

    def __init__(self, in_proj: GDNInProj, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel), requires_grad=False)
        self.split_qkv = in_proj.split_qkv

    def load(self, param: nn.Parameter, src: torch.Tensor, names: tuple[str, str], shard: str | None = None) -> None:
        src = self.split_qkv(src)
        check_shape(src, tuple(param.shape), *names)
        param.data.copy_(src)


class GatedDeltaNet(nn.Module):
    """One linear-attention layer; its conv and recurrent state live in slots (allocate_state). Under tensor
    parallelism each rank runs its share of the heads (GDNInProj), with their state."""

    def __init__(self, config: HFModelConfig, la: LinearAttentionConfig, kernels: str = "torch") -> None:
        """kernels: gdn_kernels' choice."""
        super().__init__()
        self.in_proj = GDNInProj(config.hidden_size, la)
        tp = tp_group()
        self.num_k_heads = la.num_key_heads // tp.size
        self.num_v_heads = la.num_value_heads // tp.size
        self.head_k_dim, self.head_v_dim = la.key_head_dim, la.value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = la.conv_kernel
        hv = self.num_v_heads
        self.first_v_head = tp.rank * hv
        self.conv1d = _Conv1dWeight(self.in_proj, self.conv_dim, self.conv_kernel)
        self.A_log = nn.Parameter(torch.empty(hv), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(hv), requires_grad=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.head_v_dim), requires_grad=False)
        self.eps = config.rms_norm_eps
        self.out_proj = RowParallelLinear(la.num_value_heads * self.head_v_dim, config.hidden_size, bias=False)
        self.kernels = kernels
        self.conv_state: torch.Tensor | None = None
        """[slots, conv_dim, conv_kernel - 1], the model's dtype."""
        self.recurrent_state: torch.Tensor | None = None
        """[slots, Hv, Dk, Dv] float32."""

    def load(self, param: nn.Parameter, src: torch.Tensor, names: tuple[str, str], shard: str | None = None) -> None:
        """This rank's value heads of A_log and dt_bias."""
        src = src.narrow(0, self.first_v_head, self.num_v_heads)
        check_shape(src, tuple(param.shape), *names)
        param.data.copy_(src)

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.empty(0, dtype=dtype).element_size()
        return conv + self.num_v_heads * self.head_k_dim * self.head_v_dim * 4

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        self.conv_state = torch.zeros(num_slots, self.conv_dim, self.conv_kernel - 1, dtype=dtype, device=device)
        self.recurrent_state = torch.zeros(num_slots, self.num_v_heads, self.head_k_dim, self.head_v_dim,
                                           dtype=torch.float32, device=device)

    def reset_state(self, slots: torch.Tensor) -> None:
        """Zero the slots a new sequence starts in."""
        self.conv_state.index_fill_(0, slots, 0)
        self.recurrent_state.index_fill_(0, slots, 0)

    def copy_state(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots src -> dst (int64 [n] each, disjoint)."""
        self.conv_state.index_copy_(0, dst, self.conv_state.index_select(0, src))
        self.recurrent_state.index_copy_(0, dst, self.recurrent_state.index_select(0, src))

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if meta.state_slots is None or self.conv_state is None:
            raise RuntimeError("a gated delta net layer needs state slots: allocate_state, and meta.state_slots")
        t, slots = hidden.shape[0], meta.state_slots
        qkv, z, b, a = self.in_proj(hidden).split([self.conv_dim, self.value_dim, self.num_v_heads,
                                                   self.num_v_heads], dim=-1)
        weight = self.conv1d.weight[:, 0]
        history = meta.state_history
        if self.kernels != "torch" and meta.verify_history is not None:  # a verify step of q tokens per sequence
            o = self._verify(qkv, a, b, weight, slots, meta.verify_history)
        elif self.kernels != "torch" and meta.max_query_len == 1 and history is None:  # a decode step: two launches
            from flotilla.kernels.triton import gdn as triton_gdn

            qkv = triton_gdn.causal_conv1d_update(qkv, weight, self.conv_state, slots)
            q, k, v = self._heads(qkv, t)
            o = triton_gdn.gated_delta_rule_update(q, k, v, a, b, self.A_log, self.dt_bias, self.recurrent_state,
                                                   slots)
        else:
            qsl = meta.host.query_start_loc if meta.host is not None else meta.query_start_loc.cpu().numpy()
            if self.kernels != "torch" and history is None:  # every sequence in two launches
                from flotilla.kernels.triton import gdn as triton_gdn

                qkv = triton_gdn.causal_conv1d_varlen(qkv, weight, self.conv_state, slots, meta.query_start_loc)
            else:
                qkv = gdn.causal_conv1d(qkv, weight, self.conv_state, slots, qsl, history)
            q, k, v = self._heads(qkv, t)
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
            if self.kernels == "triton+fla" and history is None:
                from flotilla.kernels.triton import gdn as triton_gdn

                o = triton_gdn.chunk_gated_delta_rule(q, k, v, g, b.sigmoid(), self.recurrent_state, slots,
                                                      meta.query_start_loc, qsl)
            else:
                o = gdn.gated_delta_rule(q, k, v, g, b.sigmoid(), self.recurrent_state, slots, qsl, history)
        if self.kernels != "torch":  # one launch, z read where the projection wrote it
            from flotilla.kernels.triton import gdn as triton_gdn

            return self.out_proj(triton_gdn.gated_rms_norm(o.reshape(t, self.num_v_heads, self.head_v_dim), z,
                                                           self.norm.weight, self.eps))
        o = gdn.gated_rms_norm(o.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim), self.norm.weight,
                               self.eps)
        return self.out_proj(o.reshape(t, self.value_dim))

    def _verify(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor,
                history: torch.Tensor) -> torch.Tensor:
        """B sequences of q tokens each (rows i * q + j), through the decode kernels token by token with no host loop
        or sync: token j reads the state token j - 1 left (the slot's for j = 0) and writes its own to its history
        row, the last token's into the slot (history [B, q]: each token's row). As the reference's verify path."""
        from flotilla.kernels.triton import gdn as triton_gdn

        t, q_len = qkv.shape[0], history.shape[1]
        rows = history.t().contiguous()  # (the kernels read each token's rows as one contiguous [B])
        src, dst = [slots, *rows[:-1]], [*rows[:-1], slots]
        conv = torch.empty(t // q_len, q_len, qkv.shape[1], dtype=qkv.dtype, device=qkv.device)
        for j in range(q_len):
            triton_gdn.causal_conv1d_update(qkv[j::q_len], weight, self.conv_state, src[j], dst[j], out=conv[:, j])
        q, k, v = self._heads(conv.view(t, -1), t)
        out = torch.empty(t // q_len, q_len, self.num_v_heads, self.head_v_dim, dtype=v.dtype, device=v.device)
        for j in range(q_len):
            triton_gdn.gated_delta_rule_update(q[j::q_len], k[j::q_len], v[j::q_len], a[j::q_len], b[j::q_len],
                                               self.A_log, self.dt_bias, self.recurrent_state, src[j], dst[j],
                                               out=out[:, j])
        return out.view(t, self.num_v_heads, self.head_v_dim)

    def _heads(self, qkv: torch.Tensor, t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(t, self.num_k_heads, self.head_k_dim), k.reshape(t, self.num_k_heads, self.head_k_dim),
                v.reshape(t, self.num_v_heads, self.head_v_dim))


def gdn_kernels(device: torch.device) -> str:
    """The delta nets' kernels for `device`: "torch" (kernels/gdn.py) on the CPU; on CUDA triton's decode kernels
    (kernels/triton/gdn.py) with flash-linear-attention's chunked prefill ("triton+fla", when fla-core is
    installed) or the torch reference's prefill ("triton")."""
    if device.type != "cuda":
        return "torch"
    from flotilla.kernels.triton import gdn as triton_gdn  # (triton: on CUDA only)

    return "triton+fla" if triton_gdn.fla_available() else "triton"


class GatedAttention(nn.Module):
    """q (and its output gate) / k / v in one GEMM -> zero-centred q/k RMSNorm -> partial RoPE -> paged attention
    -> * sigmoid(gate) -> o_proj."""

    def __init__(self, config: HFModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        # q_proj's rows are [q_h, gate_h] per head: as 2 * heads "heads" of head_dim they split over ranks in pairs
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, 2 * config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias)
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.rotary_dim = int(self.head_dim * config.partial_rotary_factor)
        self.scale = self.head_dim**-0.5
        self.k_scale = self.v_scale = 1.0
        self.backend = backend
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.ops = current_ops()

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = hidden.shape[0]
        qg, k, v = self.qkv_proj(hidden).split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        r = self.rotary_dim
        q_rot, k_rot = self.ops.apply_rope(positions, q[..., :r].contiguous(), k[..., :r].contiguous(), cos_sin_cache)
        q = torch.cat((q_rot, q[..., r:]), dim=-1)
        k = torch.cat((k_rot, k[..., r:]), dim=-1)
        self.backend.store_kv(k, v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        out = self.backend.forward(q, kv_cache, meta, self.scale, self.k_scale, self.v_scale)
        out = out.reshape(t, self.q_size) * torch.sigmoid(gate.reshape(t, self.q_size))
        return self.o_proj(out)


class SharedExpertMoE(nn.Module):
    """Routed experts (softmax top-k, renormalised) plus a shared SwiGLU expert gated per token by
    sigmoid(shared_expert_gate(x)); one all-reduce of the sum under tensor parallelism."""

    def __init__(self, config: HFModelConfig, backend: MoEBackend) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.top_k = moe.num_experts_per_tok
        self.gate = Linear(config.hidden_size, moe.num_experts)
        self.experts = StackedExperts(moe.num_experts, config.hidden_size, moe.moe_intermediate_size, backend,
                                      expert_parallel=True, top_k=moe.num_experts_per_tok)
        self.shared_expert = nn.Module()
        inter = moe.shared_expert_intermediate_size
        self.shared_expert.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, inter, ("gate", "up"),
                                                                     bias=False)
        self.shared_expert.down_proj = RowParallelLinear(inter, config.hidden_size, bias=False, reduce_results=False)
        self.shared_expert_gate = Linear(config.hidden_size, 1)
        self.ops = current_ops()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(hidden), self.top_k, True)
        routed = self.experts(hidden, topk_weights, topk_ids)
        shared = self.shared_expert.down_proj(self.ops.silu_and_mul(self.shared_expert.gate_up_proj(hidden)))
        # (each rank's partial shared sum is scaled alike: the gate's input is the whole hidden state)
        return all_reduce(routed + torch.sigmoid(self.shared_expert_gate(hidden)) * shared)


class HybridDecoderLayer(nn.Module):
    """Pre-norm block around a gated delta net (`linear_attn`) or gated attention (`self_attn`) and the MoE."""

    def __init__(self, config: HFModelConfig, mixer: nn.Module, mlp: nn.Module, linear: bool) -> None:
        super().__init__()
        self.is_linear = linear
        if linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.is_linear:
            hidden = self.linear_attn(hidden, meta)
        else:
            hidden = self.self_attn(hidden, positions, cos_sin_cache, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class Qwen35MoeModel(nn.Module):
    def __init__(self, config: HFModelConfig, backend: AttentionBackend, moe_backend: MoEBackend,
                 gdn: str = "torch") -> None:
        super().__init__()
        la = config.linear_attention
        assert la is not None
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, GatedDeltaNet(config, la, gdn) if la.is_linear(i)
                               else GatedAttention(config, backend),
                               SharedExpertMoE(config, moe_backend), la.is_linear(i))
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, int(config.head_dim * config.partial_rotary_factor))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        cos_sin_cache = self.rotary_emb.cos_sin_cache
        caches = iter(kv_caches)
        for layer in self.layers:
            kv = None if layer.is_linear else next(caches)
            hidden, residual = layer(hidden, residual, positions, cos_sin_cache, kv, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen35MTP(nn.Module):
    """The multi-token-prediction layer (`mtp.*`; vLLM's qwen3_5_mtp): fc(cat[norm(embed(token)), norm(h)]) -> one
    full-attention MoE decoder layer with its own paged KV -> norm; the LM head is the main model's."""

    def __init__(self, config: HFModelConfig, backend: AttentionBackend, moe_backend: MoEBackend) -> None:
        super().__init__()
        self.fc = Linear(2 * config.hidden_size, config.hidden_size)
        self.pre_fc_norm_embedding = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList([HybridDecoderLayer(config, GatedAttention(config, backend),
                                                        SharedExpertMoE(config, moe_backend), linear=False)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, embedded: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.fc(torch.cat((self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(prev_hidden)), dim=-1))
        hidden, residual = self.layers[0](h, None, positions, cos_sin_cache, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Qwen3_5MoeForCausalLM(LlamaForCausalLM):
    """Qwen3.5-MoE's text model over the paged KV cache (attention layers) and state slots (delta-net layers)."""

    stacked_params: ClassVar[tuple[tuple[str, str, str], ...]] = LlamaForCausalLM.stacked_params + (
        ("in_proj", "in_proj_qkv", "qkv"),  # (GDNInProj loads it as its q, k and v parts)
        ("in_proj", "in_proj_z", "z"),
        ("in_proj", "in_proj_b", "b"),
        ("in_proj", "in_proj_a", "a"),
    )

    def __init__(self, config: HFModelConfig, *, attention_backend: str = "auto", fused_ops: str = "auto",
                 moe_backend: str = "auto", mtp: bool = False) -> None:  # fmt: skip
        """mtp: also build and load the checkpoint's MTP layer (`mtp.*`), for speculative decoding."""
        nn.Module.__init__(self)
        if mtp and config.num_nextn_predict_layers < 1:
            raise ValueError("speculative method 'mtp' needs the checkpoint's multi-token-prediction layer, but "
                             "config.json declares none (mtp_num_hidden_layers)")
        if config.linear_attention is None or config.moe is None:
            raise ValueError("config.json has no linear_attention layers or no experts: not a Qwen3.5-MoE checkpoint")
        if config.moe.shared_expert_intermediate_size <= 0:
            raise ValueError("config.json lacks shared_expert_intermediate_size (Qwen3.5-MoE has a shared expert)")
        self.config = config
        self.linear_attention = config.linear_attention
        self.head_dim = config.head_dim
        device = torch.get_default_device()
        backend = get_attention_backend(attention_backend, device=device, head_dim=config.head_dim,
                                        dtype=torch.get_default_dtype())
        self.attention_backend_name = backend.name
        ops = get_ops(fused_ops, device=device)
        self.fused_ops_name = ops.name
        self.moe_backend = get_moe_backend(moe_backend, device=device, dtype=torch.get_default_dtype())
        self.moe_backend_name = self.moe_backend.name
        self.gdn_backend_name = gdn_kernels(device)
        """The delta nets' kernels (gdn_kernels)."""
        with use_ops(ops):
            self.model = Qwen35MoeModel(config, backend, self.moe_backend, self.gdn_backend_name)
            self.mtp = Qwen35MTP(config, backend, self.moe_backend) if mtp else None
        attention = [layer.self_attn for layer in self.model.layers if not layer.is_linear]
        self.num_layers = len(attention) + (self.mtp is not None)
        """Layers that hold paged KV (the full-attention ones, then the MTP layer's)."""
        self.num_kv_heads = attention[0].num_kv_heads
        self.lm_head = (None if config.tie_word_embeddings
                        else VocabParallelEmbedding(config.vocab_size, config.hidden_size))

    # ---- recurrent state ------------------------------------------------------------------------------

    def _delta_nets(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.is_linear]

    def state_bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes of every delta-net layer's conv and recurrent state for one sequence."""
        return sum(layer.state_bytes_per_slot(dtype) for layer in self._delta_nets())

    def allocate_state(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        """Every delta-net layer's state pools: `num_slots` sequences' worth, zeroed."""
        for layer in self._delta_nets():
            layer.allocate_state(num_slots, dtype, device)

    def state_tensors(self) -> list[torch.Tensor]:
        """Every delta-net layer's conv then recurrent state pool ([rows, ...] each)."""
        return [t for layer in self._delta_nets() for t in (layer.conv_state, layer.recurrent_state)]

    def reset_state(self, slots: torch.Tensor) -> None:
        """Zero slots (int64 [n], on the state's device) for the sequences that start in them."""
        for layer in self._delta_nets():
            layer.reset_state(slots)

    def copy_state(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every delta-net layer's state slots src -> dst (a prefix snapshot saved or resumed, a verify step's state
        after its last accepted token)."""
        for layer in self._delta_nets():
            layer.copy_state(src, dst)

    # ---- speculative decoding -------------------------------------------------------------------------

    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, prev_hidden: torch.Tensor,
                    kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:  # fmt: skip
        """The MTP layer at `positions`: input_ids int64 [T] are the tokens one position ahead, prev_hidden [T, H]
        the main model's final hidden states there (or this layer's own output when drafting further); writes its
        KV into its cache layer (the last of kv_caches); returns its normed output [T, H]."""
        assert self.mtp is not None
        return self.mtp(self.model.embed_tokens(input_ids), prev_hidden, positions, self.model.rotary_emb.cos_sin_cache,
                        kv_caches[-1], meta)

    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP layer's output rows [N, H] -> float32 logits [N, vocab] of the token two positions ahead."""
        return self.compute_logits(hidden)

    # ---- weights --------------------------------------------------------------------------------------

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return kv_cache_shape(num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """HF names (text-only or the multimodal checkpoint's language model), zero-centred norms made plain
        (1 + w), routed experts stacked (ExpertTensors)."""
        experts = ExpertTensors(self)
        loaded = super().load_weights((name, tensor) for name, tensor in _text_weights(weights, self.mtp is not None)
                                      if not experts.load(name, tensor))
        return loaded | experts.loaded

    def checkpoint_filter(self) -> Callable[[str], bool]:
        keep = ExpertTensors(self).keep
        skipped = _VISION_PREFIXES + (() if self.mtp is not None else _MTP_PREFIXES)
        return lambda name: not name.startswith(skipped) and keep(name)


def _text_weights(weights: Iterable[tuple[str, torch.Tensor]], mtp: bool) -> Iterator[tuple[str, torch.Tensor]]:
    skipped = _VISION_PREFIXES + (() if mtp else _MTP_PREFIXES)
    for name, tensor in weights:
        if name.startswith(skipped):
            continue
        if name.startswith("model.language_model."):
            name = "model." + name.removeprefix("model.language_model.")
        name = name.removeprefix("model.") if name.startswith("model.mtp.") else name
        if name.endswith(_ZERO_CENTRED) or name in ("model.norm.weight", "norm.weight", "mtp.norm.weight"):
            tensor = tensor.float() + 1.0
        yield name, tensor
