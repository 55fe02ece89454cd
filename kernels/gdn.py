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

    Per token: S = S * exp(g); S += k (x) beta * (v - S^T k); o = S^T q. A prompt's chunk runs chunked_delta_rule;
    decodes and verify steps (`history`) run it token by token."""
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
        if history is None:  # a prompt's chunk: chunk by chunk of CHUNK tokens, not token by token
            out[start:end], state[slot] = chunked_delta_rule(q[start:end], k[start:end], v[start:end],
                                                             g[start:end].float(), beta[start:end], state[slot])
            continue
        s = state[slot].unsqueeze(0)
        for t in range(start, end):
            out[t] = _delta_step(s, q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1], beta[t:t + 1])[0]
            if history is not None and history[t] >= 0:
                state[history[t]] = s[0]
        state[slot] = s[0]
    return out.to(dtype)


CHUNK = 64
"""Tokens the chunked delta rule takes at once (fla's chunk size)."""


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       s: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over one sequence's n tokens from state s [H, Dk, Dv], as matrix products over chunks of
    `chunk` tokens (the WY form of Gated DeltaNet's chunked algorithm) rather than n rank-one updates: q, k [n, H, Dk]
    (normalised, q scaled), v [n, H, Dv], g (log decay) and beta [n, H], all float32. Returns (o [n, H, Dv], the
    state after the last token).

    Within a chunk, with G the cumulative log decay from its start and S its starting state, the state after token t
    is exp(G_t) S + sum_{j<=t} exp(G_t - G_j) k_j u_j^T, where the u solve the unit lower-triangular system
    u_t + beta_t sum_{j<t} exp(G_t - G_j) (k_t . k_j) u_j = beta_t (v_t - exp(G_t) S^T k_t): one batched triangular
    solve for every chunk at once, then a short loop over the chunks carries S."""
    n, h, _ = k.shape
    pad = -n % chunk

    def blocks(x: torch.Tensor) -> torch.Tensor:  # [n, H, ...] -> [H, chunks, chunk, ...], padded with zeros
        x = F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))
        return x.reshape(-1, chunk, *x.shape[1:]).movedim(2, 0)

    # padding tokens: no decay (g 0), no update (beta 0): the state passes them unchanged
    q, k, v, g, beta = blocks(q), blocks(k), blocks(v), blocks(g), blocks(beta)
    cum = g.cumsum(-1)  # [H, C, chunk]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    gaps = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # exp(G_t - G_j), j <= t
    system = (k @ k.transpose(-1, -2) * gaps).tril(-1) * beta[..., None]
    system.diagonal(dim1=-2, dim2=-1).fill_(1.0)
    grow = cum.exp()  # exp(G_t)
    solved = torch.linalg.solve_triangular(system, torch.cat((v * beta[..., None], k * (beta * grow)[..., None]), -1),
                                           upper=False, unitriangular=True)
    u0, w = solved.split([v.shape[-1], k.shape[-1]], dim=-1)  # u = u0 - w S
    scores = q @ k.transpose(-1, -2) * gaps  # [H, C, chunk, chunk]: q_t . k_j exp(G_t - G_j), j <= t
    rest = (cum[..., -1:] - cum).exp()[..., None] * k  # k_j exp(G_last - G_j)
    last = grow[..., -1, None, None]  # [H, C, 1, 1]
    out = torch.empty_like(v)
    for c in range(v.shape[1]):
        u = u0[:, c] - w[:, c] @ s
        out[:, c] = grow[:, c, :, None] * (q[:, c] @ s) + scores[:, c] @ u
        s = last[:, c] * s + rest[:, c].transpose(-1, -2) @ u
    return out.movedim(0, 2).reshape(-1, h, v.shape[-1])[:n], s


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
