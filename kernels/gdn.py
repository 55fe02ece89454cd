"""Gated DeltaNet (Qwen3.5's linear attention) over per-sequence state slots: the torch reference.

A step's flat batch mixes prefill chunks and decodes (AttentionMetadata's query_start_loc); each sequence owns one
slot of a layer's two state pools, which carry it from one step (or chunk) to the next:

- conv state [S, C, K-1]: the last K-1 inputs of the depthwise causal conv1d over the q/k/v channels;
- recurrent state [S, Hv, Dk, Dv] float32: the delta rule's memory, per value head.

A slot is zeroed when a sequence gets it (its first token then sees zero history, as a fresh prompt does). These
are the semantics of transformers' torch_recurrent_gated_delta_rule and causal_conv1d_update; GPU kernels are
checked against them.

`history` (speculative decoding's verify steps): int64 [T], for each token a pool row that receives the state as
it is after that token (-1: none), so that the state after the last accepted draft can be put back in the slot.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                  query_start_loc: np.ndarray, history: np.ndarray | None = None) -> torch.Tensor:
    """SiLU(depthwise causal conv1d) of x [T, C] with weight [C, K], each sequence continuing from its slot's
    history in conv_state [S, C, K-1] (updated in place to the last K-1 inputs); returns [T, C] in x's dtype."""
    k = weight.shape[1]
    w = weight.float()
    if len(query_start_loc) - 1 == x.shape[0] and history is None:  # one token per sequence: a decode step
        window = torch.cat((conv_state[slots].float(), x.float().unsqueeze(-1)), dim=-1)  # [B, C, K]
        conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
        return F.silu((window * w).sum(-1)).to(x.dtype)
    out = torch.empty_like(x)
    for b, slot in enumerate(slots.tolist()):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        window = torch.cat((conv_state[slot].float(), x[start:end].float().t()), dim=-1)  # [C, K-1+n]
        conv_state[slot] = window[:, window.shape[1] - (k - 1):].to(conv_state.dtype)
        for t in range(start, end) if history is not None else ():
            if history[t] >= 0:  # the last K-1 inputs up to token t
                conv_state[history[t]] = window[:, t - start + 1:t - start + k].to(conv_state.dtype)
        y = F.conv1d(window.unsqueeze(0), w.unsqueeze(1), groups=w.shape[0])[0]  # [C, n]
        out[start:end] = F.silu(y).t().to(x.dtype)
    return out


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32 (FLA's and transformers' form)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, slots: torch.Tensor, query_start_loc: np.ndarray,
                     history: np.ndarray | None = None) -> torch.Tensor:
    """The gated delta rule over a flat batch: q, k [T, Hk, Dk], v [T, Hv, Dv], g (log decay, <= 0) and beta
    [T, Hv]; state [S, Hv, Dk, Dv] float32 (each sequence's slot read, then updated in place). q and k are
    L2-normalised here, q scaled by Dk^-0.5; each q/k head serves Hv / Hk consecutive value heads. Returns the
    output [T, Hv, Dv] in v's dtype.

    Per token: S = S * exp(g); S += k (x) beta * (v - S^T k); o = S^T q."""
    dtype, rep = v.dtype, v.shape[1] // q.shape[1]
    q = l2norm(q).repeat_interleave(rep, dim=1) * q.shape[-1] ** -0.5
    k = l2norm(k).repeat_interleave(rep, dim=1)
    v, decay, beta = v.float(), g.float().exp(), beta.float()
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    num_seqs = len(query_start_loc) - 1
    if num_seqs == v.shape[0] and history is None:  # a decode step: every sequence's one token at once
        s = state[slots]
        out[:] = _delta_step(s, q, k, v, decay, beta)
        state[slots] = s
        return out.to(dtype)
    for b, slot in enumerate(slots.tolist()):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        s = state[slot].unsqueeze(0)
        for t in range(start, end):
            out[t] = _delta_step(s, q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1])[0]
            if history is not None and history[t] >= 0:
                state[history[t]] = s[0]
        state[slot] = s[0]
    return out.to(dtype)


def _delta_step(s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
    """One token of B sequences: s [B, Hv, Dk, Dv] updated in place; q, k [B, Hv, Dk], v [B, Hv, Dv], decay and beta
    [B, Hv]; returns o [B, Hv, Dv]."""
    s.mul_(decay[..., None, None])
    recalled = torch.einsum("bhkv,bhk->bhv", s, k)
    s.add_(k.unsqueeze(-1) * ((v - recalled) * beta.unsqueeze(-1)).unsqueeze(-2))
    return torch.einsum("bhkv,bhk->bhv", s, q)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight * SiLU(z) over the last dim (x [N, D], z like x); in x's dtype, as transformers'
    RMSNormGated (the norm in float32, the weight applied in x's dtype, the gate in float32)."""
    dtype = x.dtype
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return ((weight * normed).float() * F.silu(z.float())).to(dtype)
