"""DeepSeek-V4's checkpoints: DeepSeek's tensor names (and transformers') mapped to models/deepseek_v4.py's
parameters, each tensor-parallel rank's share of them, and MXFP4 expert weights dequantized."""

from __future__ import annotations

import re

import torch

from flotilla.models.parallel import tp_group

_FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an e2m1 nibble."""


def fp4_dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 [N, K / 2] int8 (two e2m1 values a byte, the low nibble first) times its scales [N / bn, K / bk] (E8M0
    exponents as uint8 or float8_e8m0fnu, or float32), each over a block the grid's shape gives (1 x 32 for
    V4-Flash's experts) -> float32 [N, K]."""
    u8 = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(_FP4_E2M1, dtype=torch.float32, device=packed.device)
    w = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1).reshape(packed.shape[0], -1)
    s = (scales.float() - 127.0).exp2() if scales.dtype == torch.uint8 else scales.float()
    (rows, cols), (srows, scols) = w.shape, s.shape
    if rows % srows or cols % scols:
        raise ValueError(f"an FP4 weight of {rows} x {cols} does not divide into its {srows} x {scols} scale blocks")
    return w * s.repeat_interleave(rows // srows, dim=0).repeat_interleave(cols // scols, dim=1)


_ROOT = {"embed.weight": "model.embed_tokens.weight", "embed_tokens.weight": "model.embed_tokens.weight",
         "head.weight": "lm_head.weight", "lm_head.weight": "lm_head.weight", "norm.weight": "model.norm.weight",
         "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
         "hc_head_scale": "model.hc_head.hc_scale", "hc_head.hc_fn": "model.hc_head.hc_fn",
         "hc_head.hc_base": "model.hc_head.hc_base", "hc_head.hc_scale": "model.hc_head.hc_scale"}
_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
          "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
          "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
          "attn.attn_sink": "self_attn.sinks", "attn.wq_a.weight": "self_attn.q_a_proj.weight",
          "attn.q_norm.weight": "self_attn.q_a_norm.weight", "attn.wq_b.weight": "self_attn.q_b_proj.weight",
          "attn.wkv.weight": "self_attn.kv_proj.weight", "attn.norm.weight": "self_attn.kv_norm.weight",
          "attn.wo_a.weight": "self_attn.o_a_proj.weight", "attn.wo_b.weight": "self_attn.o_b_proj.weight",
          "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
          "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
          "ffn.gate.weight": "mlp.gate.weight", "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
          "ffn.gate.tid2eid": "mlp.gate.tid2eid", "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
          "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
          "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight"}
_COMPRESSOR = {"wkv.weight": "kv_proj.weight", "wgate.weight": "gate_proj.weight", "ape": "position_bias",
               "norm.weight": "kv_norm.weight"}
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


_SPLIT_ROWS = ("self_attn.q_b_proj.weight", "self_attn.sinks", "self_attn.o_a_proj.weight",
               "mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight")
_SPLIT_COLS = ("self_attn.o_b_proj.weight", "mlp.shared_experts.down_proj.weight")


def rank_share(name: str, tensor: torch.Tensor, one_expert: bool) -> torch.Tensor:
    """This tensor-parallel rank's part of a checkpoint tensor: its heads (queries, sinks, output groups), its share
    of every expert's intermediate dims; the rest (the key-value head, compressors, indexer, mHC, router, embeddings)
    whole on every rank."""
    tp = tp_group()
    if tp.size == 1:
        return tensor
    share = lambda t, dim: t.chunk(tp.size, dim=dim)[tp.rank]  # noqa: E731
    if name.endswith(_SPLIT_ROWS):
        return share(tensor, 0)
    if name.endswith(_SPLIT_COLS):
        return share(tensor, 1)
    if name.endswith("mlp.experts.down_proj"):
        return share(tensor, 1 if one_expert else 2)  # ([H, I] of one expert, or [E, H, I] stacked)
    if name.endswith("mlp.experts.gate_up_proj"):
        if one_expert:  # (w1 or w3 [I, H])
            return share(tensor, 0)
        gate, up = tensor.chunk(2, dim=1)
        return torch.cat([share(gate, 1), share(up, 1)], dim=1)
    return tensor


_MTP = {"enorm.weight": "mtp.enorm.weight", "hnorm.weight": "mtp.hnorm.weight", "e_proj.weight": "mtp.e_proj.weight",
        "h_proj.weight": "mtp.h_proj.weight", "hc_head_fn": "mtp.hc_head.hc_fn", "hc_head_base": "mtp.hc_head.hc_base",
        "hc_head_scale": "mtp.hc_head.hc_scale", "norm.weight": "mtp.norm.weight"}
"""The MTP layer's own tensors (`mtp.0.<name>`); its other tensors are a decoder layer's."""
MTP_COPIES = ("emb.tok_emb.weight", "embed_tokens.weight", "head.weight", "shared_head.head.weight")
"""The MTP layer's copies of the main model's embedding and LM head (not loaded: the main model's serve)."""


def mtp_tensor(name: str) -> str | None:
    """What follows `mtp.0.` in a checkpoint name of the first MTP layer; None for other names and other MTP layers."""
    bare = name.removeprefix("model.")
    return bare.removeprefix("mtp.0.") if bare.startswith("mtp.0.") else None


def param_name(name: str) -> tuple[str, int | None, int | None]:
    """A checkpoint tensor's parameter (or buffer) here; for one routed expert's matrix also its expert (row) and,
    for w1 / w3, which half of gate_up_proj (0 / 1). The first MTP layer's tensors map to `mtp.*` (its decoder
    layer's to `mtp.block.*`)."""
    bare = name.removeprefix("model.")
    if (rest := mtp_tensor(name)) is not None:
        return (_MTP[rest], None, None) if rest in _MTP else _layer_param("mtp.block.", rest)
    if not bare.startswith("layers."):
        return _ROOT.get(bare, name), None, None
    _, index, rest = bare.split(".", 2)
    return _layer_param(f"model.layers.{index}.", rest)


def _layer_param(prefix: str, rest: str) -> tuple[str, int | None, int | None]:
    """param_name of a decoder layer's tensor `rest`, the layer's parameters under `prefix`."""
    if rest in _LAYER:
        return prefix + _LAYER[rest], None, None
    if (m := _EXPERT.match(rest)) is not None:
        kind = m[2]
        return prefix + ("mlp.experts.down_proj" if kind == "w2" else "mlp.experts.gate_up_proj"), int(m[1]), \
            {"w1": 0, "w3": 1, "w2": None}[kind]
    for owner, here in (("attn.indexer.compressor.", "self_attn.compressor.indexer."),
                        ("attn.compressor.", "self_attn.compressor.")):
        if rest.startswith(owner) and rest[len(owner):] in _COMPRESSOR:
            return prefix + here + _COMPRESSOR[rest[len(owner):]], None, None
    return prefix + rest, None, None  # (transformers' own names)
