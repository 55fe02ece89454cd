"""Qwen3.5-MoE (gated delta net + gated attention + MoE with a shared expert) against transformers on a tiny random
checkpoint with identical weights (fp32): the delta-net kernels against transformers' own, prefill and paged decode
logits, greedy tokens, mixed batches and chunked prefill over state slots, the multimodal checkpoint's layout; and
the engine end to end (greedy equal to transformers' generate, concurrent, chunked, preempted, no prefix cache)."""

from __future__ import annotations

import inspect
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_engine import write_tiny_tokenizer
from helpers_optional import needs
from helpers_spec import VOCAB, add_qwen35_mtp_layer, check_speculation_follows_plain, make_runner, plain_decoding
from helpers_tiny_models import (
    PagedRunner,
    check_greedy_matches_generate,
    check_mixed_batch_equals_each_alone,
    check_prefill_then_paged_decode,
    hf_logits,
    load_flotilla_model,
    load_hf_model,
    random_tokens,
    write_tiny_qwen35_model,
)
from safetensors.torch import load_file, save_file
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf_q35

from flotilla import LLM, SamplingParams
from flotilla.kernels import gdn
from flotilla.models.hf_config import parse_hf_config
from flotilla.models.qwen3_5_moe import GatedAttention, GatedDeltaNet, Qwen3_5MoeForCausalLM

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    d = write_tiny_qwen35_model(tmp_path_factory.mktemp("q35") / "m")
    write_tiny_tokenizer(d, vocab_size=320)
    return d


@pytest.fixture(scope="module")
def models(model_dir):
    return load_flotilla_model(model_dir), load_hf_model(model_dir)


# ---- kernels ----------------------------------------------------------------------------------------------------


def test_the_delta_rule_over_slots_equals_transformers_chunked_one_from_each_initial_state():
    g = torch.Generator().manual_seed(0)
    hk, hv, dk, dv, lens = 2, 4, 16, 8, [5, 1, 70]
    t = sum(lens)
    q, k = torch.randn(t, hk, dk, generator=g), torch.randn(t, hk, dk, generator=g)
    v = torch.randn(t, hv, dv, generator=g)
    decay = -torch.rand(t, hv, generator=g) * 2
    beta = torch.rand(t, hv, generator=g)
    state = torch.randn(6, hv, dk, dv, generator=g)
    slots = torch.tensor([4, 0, 2])
    before = state.clone()
    qsl = np.concatenate(([0], np.cumsum(lens)))
    out = gdn.gated_delta_rule(q, k, v, decay, beta, state, slots, qsl)
    for b, slot in enumerate(slots.tolist()):
        s, e = qsl[b], qsl[b + 1]
        ref, final = hf_q35.torch_chunk_gated_delta_rule(
            q[None, s:e], k[None, s:e], v[None, s:e], decay[None, s:e], beta[None, s:e],
            initial_state=before[slot:slot + 1], output_final_state=True, use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[s:e], ref[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(state[slot], final[0], atol=1e-4, rtol=1e-4)
    untouched = [1, 3, 5]
    assert torch.equal(state[untouched], before[untouched])
    # a decode step (one token each) takes the batched path: the same as one token through the loop
    state2, one = before.clone(), torch.tensor([0, 3, 5, 1, 2])
    got = gdn.gated_delta_rule(q[:5], k[:5], v[:5], decay[:5], beta[:5], state2, slots := one, np.arange(6))
    for i, slot in enumerate(slots.tolist()):
        s1 = before[slot:slot + 1].clone()
        ref = gdn.gated_delta_rule(q[i:i + 1], k[i:i + 1], v[i:i + 1], decay[i:i + 1], beta[i:i + 1], s1,
                                   torch.tensor([0]), np.array([0, 1]))
        torch.testing.assert_close(got[i:i + 1], ref)


@pytest.mark.parametrize(("n", "chunk"), [(1, 64), (37, 16), (64, 64), (150, 64)])
def test_the_chunked_delta_rule_equals_it_token_by_token(n, chunk):
    """A prompt's chunk runs the delta rule as matrix products over chunks of tokens (padded at the end): the same
    outputs and final state as the token-by-token update, steep decays (and none) included."""
    g = torch.Generator().manual_seed(n)
    h, dk, dv = 3, 16, 24
    q = gdn.l2norm(torch.randn(n, h, dk, generator=g)) * dk ** -0.5
    k = gdn.l2norm(torch.randn(n, h, dk, generator=g))
    v, beta = torch.randn(n, h, dv, generator=g), torch.rand(n, h, generator=g)
    decay = -torch.rand(n, h, generator=g) * 8
    decay[::5] = 0.0
    s0 = torch.randn(h, dk, dv, generator=g)
    s, want = s0.clone().unsqueeze(0), torch.empty(n, h, dv)
    for t in range(n):
        want[t] = gdn._delta_step(s, q[t:t + 1], k[t:t + 1], v[t:t + 1], decay[t:t + 1].exp(), beta[t:t + 1])[0]
    got, final = gdn.chunked_delta_rule(q, k, v, decay, beta, s0, chunk=chunk)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, s[0], atol=2e-5, rtol=1e-5)


def test_the_causal_conv_over_slots_equals_one_conv_over_the_whole_sequence():
    g = torch.Generator().manual_seed(1)
    c, kernel = 12, 4
    weight = torch.randn(c, kernel, generator=g)
    x = torch.randn(20, c, generator=g)
    whole = hf_q35.causal_conv1d_fn(x.t()[None], weight, activation="silu")[0].t()
    # the same sequence in three pieces (a prefill chunk, a second chunk, then decodes), its history in slot 3
    state = torch.zeros(5, c, kernel - 1)
    got = [gdn.causal_conv1d(x[:7], weight, state, torch.tensor([3]), np.array([0, 7])),
           gdn.causal_conv1d(x[7:9], weight, state, torch.tensor([3]), np.array([0, 2]))]
    for i in range(9, 20):  # a decode batch of two sequences: ours and one in slot 1
        got.append(gdn.causal_conv1d(torch.stack((x[i], x[i])), weight, state, torch.tensor([3, 1]),
                                     np.array([0, 1, 2]))[:1])
    torch.testing.assert_close(torch.cat(got), whole, atol=1e-5, rtol=1e-5)
    assert torch.equal(state[[0, 2, 4]], torch.zeros(3, c, kernel - 1))


def _decode_kernel_inputs(seed: int, rows: int, slots: int) -> list[torch.Tensor]:
    """Random inputs of the triton decode kernels' tests: x, weight, conv state, q, k, v, a, b (raw), A_log, dt_bias,
    recurrent state (40 conv channels of kernel 4, 2 key and 4 value heads, Dk 16, Dv 24: not a power of two)."""
    g = torch.Generator().manual_seed(seed)
    c, kernel, hk, hv, dk, dv = 40, 4, 2, 4, 16, 24
    shapes = [(rows, c), (c, kernel), (slots, c, kernel - 1), (rows, hk, dk), (rows, hk, dk), (rows, hv, dv),
              (rows, hv), (rows, hv), (hv,), (hv,), (slots, hv, dk, dv)]
    return [torch.randn(*shape, generator=g) for shape in shapes]


@pytest.mark.parametrize("block_v", [None, 16, 64])  # (16: a last tile half masked; 64: one tile wider than Dv)
def test_the_triton_decode_kernels_equal_the_reference_in_place_over_slots_and_zero_padded_rows(block_v):
    """(under TRITON_INTERPRET on a CPU; compiled on a GPU)"""
    tg = pytest.importorskip("flotilla.kernels.triton.gdn", reason="triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, weight, conv, q, k, v, a, beta_raw, a_log, dt_bias, state = _decode_kernel_inputs(2, rows=4, slots=7)
    slots, real = torch.tensor([5, -1, 0, 3]), [0, 2, 3]
    want_conv, want_state = conv.clone(), state.clone()
    used = torch.tensor([5, 0, 3])
    want_x = gdn.causal_conv1d(x[real], weight, want_conv, used, np.arange(4))
    decay = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    want_o = gdn.gated_delta_rule(q[real], k[real], v[real], decay[real], beta_raw[real].sigmoid(), want_state, used,
                                  np.arange(4))
    on = [t.to(device) for t in (x, weight, conv, q, k, v, a, beta_raw, a_log, dt_bias, state, slots)]
    x_d, w_d, conv_d, q_d, k_d, v_d, a_d, b_d, alog_d, dtb_d, state_d, slots_d = on
    got_x = tg.causal_conv1d_update(x_d, w_d, conv_d, slots_d)
    got_o = tg.gated_delta_rule_update(q_d, k_d, v_d, a_d, b_d, alog_d, dtb_d, state_d, slots_d, block_v=block_v)
    torch.testing.assert_close(got_x.cpu()[real], want_x, atol=1e-5, rtol=1e-5)
    assert not got_x[1].any() and not got_o[1].any()  # the padded row's outputs: zeros
    torch.testing.assert_close(conv_d.cpu(), want_conv, atol=1e-6, rtol=0)  # slots 1, 2, 4, 6 untouched
    torch.testing.assert_close(got_o.cpu()[real], want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state_d.cpu(), want_state, atol=1e-5, rtol=1e-5)


def test_the_triton_decode_kernels_write_each_rows_new_state_where_told_and_leave_its_slot_as_it_was():
    """A verify step's token by token chain: read from one row, write to another (strided token rows in, as a
    verify step's every (k + 1)-th row); the source rows stay as they were."""
    tg = pytest.importorskip("flotilla.kernels.triton.gdn", reason="triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    b = 3  # every other row of x / q / k / v / a / b is this token's (a strided view, as in a verify step)
    x, weight, conv, q, k, v, a, beta_raw, a_log, dt_bias, state = _decode_kernel_inputs(4, rows=2 * b, slots=8)
    src, dst = torch.tensor([1, 4, 6]), torch.tensor([2, 5, 0])
    want_conv, want_state = conv.clone(), state.clone()
    ref_conv, ref_state = conv.clone(), state.clone()  # the reference in place on the source rows, then moved
    want_x = gdn.causal_conv1d(x[1::2], weight, ref_conv, src, np.arange(b + 1))
    decay = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    want_o = gdn.gated_delta_rule(q[1::2], k[1::2], v[1::2], decay[1::2], beta_raw[1::2].sigmoid(), ref_state, src,
                                  np.arange(b + 1))
    want_conv[dst], want_state[dst] = ref_conv[src], ref_state[src]
    on = [t.to(device) for t in (x, weight, conv, q, k, v, a, beta_raw, a_log, dt_bias, state, src, dst)]
    x_d, w_d, conv_d, q_d, k_d, v_d, a_d, b_d, alog_d, dtb_d, state_d, src_d, dst_d = on
    got_x = tg.causal_conv1d_update(x_d[1::2], w_d, conv_d, src_d, dst_d)
    got_o = tg.gated_delta_rule_update(q_d[1::2], k_d[1::2], v_d[1::2], a_d[1::2], b_d[1::2], alog_d, dtb_d, state_d,
                                       src_d, dst_d)
    torch.testing.assert_close(got_x.cpu(), want_x, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_o.cpu(), want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(conv_d.cpu(), want_conv, atol=1e-6, rtol=0)  # sources and the other rows unchanged
    torch.testing.assert_close(state_d.cpu(), want_state, atol=1e-5, rtol=1e-5)


def test_the_triton_varlen_conv_equals_the_reference_over_sequences_of_any_length():
    """Prefill chunks of 1 to 70 tokens (shorter and longer than the history) and a padded sequence in one flat batch,
    strided rows in; the slots' histories replaced, the other rows untouched."""
    from helpers_triton import kernel_test_module

    _, _, device = kernel_test_module()  # (the interpreter repaired for runtime loop bounds)
    from flotilla.kernels.triton import gdn as tg
    g = torch.Generator().manual_seed(5)
    lens, slots = [5, 1, 70, 2, 3], torch.tensor([4, 0, 6, -1, 2])
    qsl = np.concatenate(([0], np.cumsum(lens)))
    x = torch.randn(qsl[-1], 2 * 40, generator=g)[:, :40]  # (in_proj's split: rows strided)
    weight, conv = torch.randn(40, 4, generator=g), torch.randn(7, 40, 3, generator=g)
    real = [i for i, s in enumerate(slots.tolist()) if s >= 0]
    rows = np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in real])
    want_conv = conv.clone()
    want_x = gdn.causal_conv1d(x[rows], weight, want_conv, slots[real],
                               np.concatenate(([0], np.cumsum([lens[i] for i in real]))))
    conv_d = conv.to(device)
    got = tg.causal_conv1d_varlen(x.to(device), weight.to(device), conv_d, slots.to(device),
                                  torch.from_numpy(qsl).to(device=device, dtype=torch.int32)).cpu()
    torch.testing.assert_close(got[rows], want_x, atol=1e-5, rtol=1e-5)
    assert not got[qsl[3]:qsl[4]].any()  # the padded sequence's outputs: zeros
    torch.testing.assert_close(conv_d.cpu(), want_conv, atol=1e-6, rtol=0)  # rows 1, 3, 5 untouched


@pytest.mark.slow
def test_the_decode_kernels_compile_for_sm90_at_qwen35_shapes(tmp_path):
    pytest.importorskip("triton", reason="triton is not installed")
    from helpers_triton import compile_for_sm90

    mod = "flotilla.kernels.triton.gdn"
    conv = {"x_ptr": "*bf16", "w_ptr": "*bf16", "state_ptr": "*bf16", "slot_ptr": "*i64", "dst_ptr": "*i64",
            "out_ptr": "*bf16"}
    delta = {**{n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr", "out_ptr")},
             "alog_ptr": "*fp32", "dtb_ptr": "*fp32", "state_ptr": "*fp32", "slot_ptr": "*i64", "dst_ptr": "*i64"}
    norm = {n: "*bf16" for n in ("x_ptr", "z_ptr", "w_ptr", "out_ptr")}
    varlen = {**conv, "qsl_ptr": "*i32"}
    del varlen["dst_ptr"]
    history = {n: t for n, t in varlen.items() if n not in ("w_ptr", "out_ptr")}
    compile_for_sm90([(mod, "_conv_update_kernel", conv, [], dict(K=4, BLOCK_C=256), 4),
                      (mod, "_conv_varlen_kernel", varlen, [], dict(K=4, BLOCK_T=32, BLOCK_C=128), 4),
                      (mod, "_conv_state_kernel", history, [], dict(K=4, BLOCK_K=4, BLOCK_C=256), 4),
                      (mod, "_delta_update_kernel", delta, ["scale"], dict(HV_PER_HK=2, DK=128, DV=128, BLOCK_V=32),
                       4),
                      (mod, "_gated_rms_norm_kernel", norm, ["eps"], dict(D=128, BLOCK_D=128), 4)], tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_gated_norm_equals_the_reference_reading_z_in_place(dtype):
    """RMSNorm(o) * weight * SiLU(z) per value head in one launch, z a strided slice of the projection's output (as
    the layer passes it): the reference's numbers (float32 to rounding; bf16 within one step of it)."""
    from helpers_triton import kernel_test_module

    _, _, device = kernel_test_module()  # (the interpreter rounding bf16 as the GPU does)
    from flotilla.kernels.triton import gdn as tg

    g = torch.Generator().manual_seed(7)
    t, heads, d = 5, 3, 24
    o = torch.randn(t, heads, d, generator=g).to(dtype)
    projected = torch.randn(t, 10 + heads * d + 6, generator=g).to(dtype)
    z = projected[:, 10:10 + heads * d]  # rows strided
    weight = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype)
    want = gdn.gated_rms_norm(o.reshape(-1, d), z.reshape(-1, d), weight, 1e-6).reshape(t, heads * d)
    got = tg.gated_rms_norm(o.to(device), z.to(device), weight.to(device), 1e-6).cpu()
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


# ---- the model --------------------------------------------------------------------------------------------------


def test_layers_follow_layer_types_and_only_attention_holds_paged_kv(models):
    model, _ = models
    kinds = [type(layer.linear_attn if layer.is_linear else layer.self_attn) for layer in model.model.layers]
    assert kinds == [GatedDeltaNet, GatedDeltaNet, GatedDeltaNet, GatedAttention]
    assert model.num_layers == 1
    # conv state: (2 * 32 + 64) channels x 3 steps (fp32); recurrent state: 4 value heads x 16 x 16 fp32
    assert model.state_bytes_per_slot(torch.float32) == 3 * (128 * 3 * 4 + 4 * 16 * 16 * 4)


def test_prefill_then_paged_decode_match_transformers(models):
    check_prefill_then_paged_decode(*models)


def test_greedy_tokens_match_transformers_generate(models):
    check_greedy_matches_generate(*models, num_tokens=32)


def test_mixed_batches_and_prefill_chunks_equal_each_sequence_alone(models):
    # (each sequence's own slot: batched and chunked runs differ from one-shot ones by float rounding only)
    check_mixed_batch_equals_each_alone(*models, alone_atol=5e-5)


def test_a_prompt_in_chunks_equals_it_in_one_piece(models):
    model, hf = models
    tokens = random_tokens(23, seed=5)
    whole = PagedRunner(model, block_size=4).step([(0, tokens)])[0]
    runner = PagedRunner(model, block_size=4, seed=7)
    parts = [runner.step([(0, tokens[a:b])])[0] for a, b in ((0, 8), (8, 9), (9, 23))]
    torch.testing.assert_close(torch.cat(parts), whole, atol=5e-5, rtol=0)
    torch.testing.assert_close(whole, hf_logits(hf, tokens), atol=2e-4, rtol=0)


def test_the_multimodal_checkpoint_loads_its_language_model(model_dir, models, tmp_path):
    """Qwen3_5MoeForConditionalGeneration's folder: text_config, weights under model.language_model., a vision
    tower and an MTP layer beside them (skipped)."""
    config = json.loads((model_dir / "config.json").read_text())
    outer = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
             "text_config": {**config, "architectures": None}, "vision_config": {"depth": 1}}
    (tmp_path / "config.json").write_text(json.dumps(outer))
    weights = {(f"model.language_model.{k.removeprefix('model.')}" if k.startswith("model.") else k): v
               for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    weights["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    weights["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(weights, str(tmp_path / "model.safetensors"))
    assert parse_hf_config(outer).linear_attention is not None
    multimodal = load_flotilla_model(tmp_path)
    assert isinstance(multimodal, Qwen3_5MoeForCausalLM)
    tokens = random_tokens(9, seed=6)
    got = PagedRunner(multimodal, block_size=4).step([(0, tokens)])[0]
    torch.testing.assert_close(got, PagedRunner(models[0], block_size=4).step([(0, tokens)])[0])


def test_layer_types_default_to_every_fourth_layer_full_attention():
    raw = {"architectures": ["Qwen3_5MoeForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 8,
           "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 4,
           "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 4,
           "linear_value_head_dim": 4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                                                           "partial_rotary_factor": 0.25,
                                                           "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
    config = parse_hf_config(raw)
    assert config.linear_attention.layer_types == ("linear_attention",) * 3 + ("full_attention",) + (
        "linear_attention",) * 3 + ("full_attention",)
    assert config.partial_rotary_factor == 0.25 and config.rope_scaling is None and config.rope_theta == 1e7
    with pytest.raises(ValueError, match="not a multiple of linear_num_key_heads"):
        parse_hf_config({**raw, "linear_num_key_heads": 3})


def _check_kernels_give_transformers_logits(model, models, device: str, kernels: str, max_err: float,
                                           mean_err: float, monkeypatch, decodes: int = 8) -> None:
    """A prefill, a second chunk (from the slot's state), then `decodes` decode steps of two sequences with the delta
    nets on `kernels`, against transformers' own torch functions in float32."""
    # transformers swaps in fla's (or causal-conv1d's) kernels where installed, CPU inputs or not: its own torch
    # functions are the reference
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "causal_conv1d_update"):
        if hasattr(hf_q35, name):
            monkeypatch.setattr(hf_q35, name, inspect.unwrap(getattr(hf_q35, name)))
    for layer in model._delta_nets():
        layer.kernels = kernels
    runner = PagedRunner(model, block_size=4, device=device)
    a, b = random_tokens(30, seed=8), random_tokens(7, seed=9)
    got = {0: [], 1: []}
    for step in ([(0, a[:20]), (1, b)], [(0, a[20:])]):
        for (i, _), logits in zip(step, runner.step(step)):
            got[i].append(logits)
    for _ in range(decodes):  # decodes of both at once: the triton path
        step = [(i, [int(got[i][-1][-1].argmax())]) for i in (0, 1)]
        a, b = a + step[0][1], b + step[1][1]
        for (i, _), logits in zip(step, runner.step(step)):
            got[i].append(logits)
    for i, tokens in ((0, a), (1, b)):
        err = (torch.cat(got[i]).cpu() - hf_logits(models[1], tokens)).abs()
        assert err.max() < max_err and err.mean() < mean_err, (
            f"sequence {i}: max |error| {err.max():.2e}, mean {err.mean():.2e}, worst row {int(err.amax(-1).argmax())}")


def test_the_triton_kernels_give_transformers_logits_under_the_interpreter(model_dir, models, monkeypatch):
    """The model's triton path (the varlen conv of prefill chunks, the decode kernels, the fused norm) on the CPU:
    exact float32, so the bound is tight."""
    from helpers_triton import kernel_test_module

    _, on_cuda, _ = kernel_test_module()
    if on_cuda:
        pytest.skip("the CUDA test below runs these kernels compiled")
    _check_kernels_give_transformers_logits(load_flotilla_model(model_dir), models, "cpu", "triton", 1e-4, 1e-5,
                                            monkeypatch, decodes=4)  # (the interpreter is slow per launch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_kernels_give_transformers_logits(model_dir, models, monkeypatch):
    """On CUDA the delta nets run triton's kernels and (with fla-core) flash-linear-attention's chunked prefill.
    fla's chunked kernel runs its dots and triangular solve in TF32 (10-bit mantissa) whatever the input dtype, so its
    rows differ from exact float32 by up to ~1e-2 on these logits (max |logit| ~3.3, RMS ~0.8); a wrong gate, state
    or slot moves them by tenths. Hence a bound on the largest error (~1% of the logits' range) and a tighter one on
    the mean."""
    from flotilla.models.qwen3_5_moe import gdn_kernels

    _check_kernels_give_transformers_logits(load_flotilla_model(model_dir).to("cuda"), models, "cuda",
                                            gdn_kernels(torch.device("cuda")), 3e-2, 3e-3, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
def test_decode_cuda_graphs_give_the_eager_tokens(tmp_path, backend):
    """Decode steps replayed from CUDA graphs, each row's state slot a graph input and padding rows on slot -1, give
    the eager engine's greedy tokens: batches shrinking through the captured sizes, state slots reused by later
    requests, prompts in chunks of a small budget (one-token chunks beside decodes stay eager)."""
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    model = write_tiny_qwen35_model(tmp_path / "m", "qwen3_5_moe_hd64")
    prompts = [random_tokens(n, seed=40 + n) for n in (3, 9, 17, 30, 41, 6, 12, 25, 2, 8)]
    params = [SamplingParams(max_tokens=4 + 2 * i, **GREEDY) for i in range(len(prompts))]  # batches shrink
    outs = {}
    for eager in (True, False):
        with LLM(str(model), device="cuda", dtype="bfloat16", block_size=16, kv_cache_blocks=256, max_num_seqs=6,
                 max_num_batched_tokens=24, enforce_eager=eager, attention_backend=backend, placement="inline",
                 skip_tokenizer_init=True) as llm:  # fmt: skip
            graphs = llm.client.runtime.actors["worker/0"].runner.graphs
            assert (graphs is None) == eager
            assert eager or graphs.inputs.state_slots is not None
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            outs[eager] = [o.outputs[0].token_ids for o in got]
    assert outs[False] == outs[True]


# ---- the engine -------------------------------------------------------------------------------------------------


def _run(engine: LLM, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _reference(hf, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    out = []
    for p in prompts:
        with torch.inference_mode():
            ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                              max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def prompts():
    return [random_tokens(n, seed=20 + n) for n in (3, 9, 17, 30, 41, 6)]


def test_the_engine_gives_transformers_greedy_tokens_with_chunks_and_concurrency(model_dir, models, prompts,
                                                                               caplog):
    want = _reference(models[1], prompts)
    with caplog.at_level(logging.INFO), LLM(str(model_dir), block_size=4, max_num_batched_tokens=16,
                                            kv_cache_blocks=128, max_num_seqs=4, num_state_snapshots=0) as llm:
        assert _run(llm, prompts) == want  # 6 requests over 4 state slots, prompts cut into 16-token chunks
        core = llm.client.runtime.actors["scheduler/0"].core
        assert not core.blocks.enable_prefix_caching  # no snapshot to resume a state from: no prefix cache
        again = llm.generate([{"prompt_token_ids": prompts[4]}], SamplingParams(max_tokens=12, **GREEDY),
                             use_tqdm=False)[0]
        assert again.outputs[0].token_ids == want[4] and again.num_cached_tokens == 0
        runner = llm.client.runtime.actors["worker/0"].runner
        assert runner.num_state_slots == 4
        _wait_for_free_state_slots(runner)
    assert any("prefix caching is off" in r.getMessage() for r in caplog.records)


def _wait_for_free_state_slots(runner) -> None:
    deadline = time.monotonic() + 10  # (the worker hears of the last finished sequence in the next plan)
    while len(runner._free_state_slots) < runner.num_state_slots:
        assert time.monotonic() < deadline, f"state slots still held: {runner._free_state_slots}"
        time.sleep(0.01)


def test_a_prefix_hit_resumes_the_state_snapshot_where_the_cached_prefix_ends(model_dir, models):
    """The first turn's state is saved where its prompt's last full block ends (its chunks cut there); later
    requests sharing that head resume it, concurrently and turn after turn, with transformers' greedy tokens."""
    first = random_tokens(22, seed=70)  # block_size 4: its state is saved after token 20
    with LLM(str(model_dir), block_size=4, max_num_batched_tokens=8, kv_cache_blocks=128, max_num_seqs=4,
             num_state_snapshots=6) as llm:
        reply = _run(llm, [first])[0]
        assert reply == _reference(models[1], [first])[0]
        branches = [first[:20] + random_tokens(5 + i, seed=80 + i) for i in range(3)]
        turn2 = first + reply + random_tokens(7, seed=90)  # a second turn of the same conversation
        prompts = [*branches, turn2]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=12, **GREEDY),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == _reference(models[1], prompts)
        assert [o.num_cached_tokens for o in outs] == [20, 20, 20, 20]
        core = llm.client.runtime.actors["scheduler/0"].core
        assert core.blocks.prefix_cache_hit_rate > 0
        # turn2's own snapshot (after token 40) is there now: its third turn resumes from it
        turn3 = turn2 + outs[3].outputs[0].token_ids + random_tokens(3, seed=91)
        out3 = llm.generate([{"prompt_token_ids": turn3}], SamplingParams(max_tokens=12, **GREEDY),
                            use_tqdm=False)[0]
        assert out3.num_cached_tokens == (len(turn2) - 1) // 4 * 4
        assert out3.outputs[0].token_ids == _reference(models[1], [turn3])[0]
        # a shared system prompt (12 tokens) with other users' tails: the second request finds its blocks cached
        # but no state there, and saves one; from the third on, requests resume it
        system = random_tokens(12, seed=95)
        users = [system + random_tokens(6 + i, seed=96 + i) for i in range(4)]
        got = [llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=12, **GREEDY),
                            use_tqdm=False)[0] for p in users]
        assert [o.num_cached_tokens for o in got] == [0, 0, 12, 12]
        assert [o.outputs[0].token_ids for o in got] == _reference(models[1], users)
        runner = llm.client.runtime.actors["worker/0"].runner
        assert runner.num_state_snapshots == 6
        _wait_for_free_state_slots(runner)
        core.blocks.check_invariants()


def test_preempted_sequences_recompute_their_state_and_keep_greedy_outputs(model_dir, models, prompts, caplog):
    """(Its ready line also says how many sequences have recurrent-state slots, and the delta nets' kernels.)"""
    long = [random_tokens(20, seed=40 + i) for i in range(6)]
    want = _reference(models[1], long, max_tokens=16)
    with caplog.at_level(logging.INFO, logger="flotilla.llm"), \
            LLM(str(model_dir), block_size=4, kv_cache_blocks=24, max_num_seqs=6) as small:
        ready = next(r.getMessage() for r in caplog.records if "flotilla ready" in r.getMessage())
        assert "(24 blocks of 4) state_slots=6 sequences max_model_len" in ready, ready
        assert "kernels=attention:torch,gdn:torch,sampler:torch" in ready, ready
        assert _run(small, long, max_tokens=16) == want
        core = small.client.runtime.actors["scheduler/0"].core
        assert core.num_preemptions > 0 and core.blocks.num_free_blocks == 24


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("q35mtp") / "m"
    shutil.copytree(write_tiny_qwen35_model(tmp_path_factory.mktemp("q35base") / "m"), d)
    write_tiny_tokenizer(d, vocab_size=VOCAB)
    return add_qwen35_mtp_layer(d)


@pytest.fixture(scope="module")
def plain_q35(mtp_dir):
    return plain_decoding(mtp_dir)


@pytest.mark.parametrize("num_spec", [1, 2])
def test_mtp_speculation_rolls_the_delta_nets_back_and_gives_the_tokens_of_plain_decoding(mtp_dir, plain_q35,
                                                                                         num_spec):
    """The MTP layer drafts (the oracle hook replaces its random drafts with plain decoding's tokens, some wrong),
    the verify pass keeps each token's state, and a rejected draft's state is never kept: greedy tokens, seeded
    samples and logprobs equal plain decoding's, prefix hits (resuming state snapshots) included."""
    runner = make_runner(mtp_dir, num_spec)
    assert runner.model.num_layers == 2 and len(runner.kv_caches) == 2  # one attention layer, then the MTP layer's
    check_speculation_follows_plain(runner, plain_q35, num_spec)


@pytest.mark.parametrize("num_spec", [2])  # (two drafts under the interpreter; on CUDA also one)
def test_verify_steps_through_the_decode_kernels_token_by_token_give_the_tokens_of_plain_decoding(
        mtp_dir, plain_q35, num_spec, monkeypatch):
    """With the delta nets on triton's kernels (the interpreter on a CPU), a step where every sequence verifies its
    drafts runs the decode kernels token by token, each token's state into its history row: the same tokens,
    samples and logprobs as plain decoding on the reference, drafts accepted or not (then rolled back from those
    rows), in the helpers' mixed batches (five of their requests: greedy, seeded, with logprobs and penalised, so
    without drafts; the interpreter is slow per token) and in a batch of three sequences that verify together."""
    pytest.importorskip("flotilla.kernels.triton.gdn", reason="triton is not installed")
    from flotilla.actors.spec_decode import MTPSpeculator
    from flotilla.transport.messages import TokenizedRequest
    from helpers_spec import oracle, requests, run

    def triton_runner(spec: int | None):
        runner = make_runner(mtp_dir, spec)
        for layer in runner.model._delta_nets():
            layer.kernels = "triton"
        return runner

    ran, rolled = [], []
    verify, roll_back = GatedDeltaNet._verify, MTPSpeculator._roll_back
    monkeypatch.setattr(GatedDeltaNet, "_verify", lambda self, *a: ran.append(a[-1].shape) or verify(self, *a))

    def counted_roll_back(self, seqs, samplers, accepted, num_drafts, *rest):
        if ran and ran[-1] is not None:  # a step that verified token by token: did it reject a draft?
            rolled.append(any(a < num_drafts[i] for i, a in zip(samplers, accepted.tolist())))
            ran.append(None)
        return roll_back(self, seqs, samplers, accepted, num_drafts, *rest)

    monkeypatch.setattr(MTPSpeculator, "_roll_back", counted_roll_back)
    mixed = [r for r in requests() if r.rid in ("r2", "r3", "r4", "r8", "r13")]  # (a verify step among them)
    check_speculation_follows_plain(triton_runner(num_spec), plain_q35, num_spec, mixed)
    reqs = [TokenizedRequest(rid=f"u{i}", prompt_ids=np.asarray(random_tokens(5 + i, seed=60 + i), dtype=np.int32),
                             eos_token_ids=[2], sampling=SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            for i in range(3)]
    want = run(make_runner(mtp_dir, None), reqs=reqs)[0]
    runner = triton_runner(num_spec)
    runner.spec.draft_hook = oracle(want, corrupt=True, reqs=reqs)
    assert run(runner, reqs=reqs)[0] == want
    assert {shape[1] for shape in ran if shape is not None} == {num_spec + 1}
    assert any(rolled) and not all(rolled), rolled  # steps that rejected a draft and steps that accepted them all


def on_triton_kernels(runner) -> None:
    """The delta nets on triton's decode kernels and the float32 torch prefill (not fla's chunked kernel, whose TF32
    products move logits by ~1e-3 with where a prompt's chunks end, which differs between plain and speculating
    runs), so that a speculating run's greedy tokens can be held equal to plain decoding's."""
    for layer in runner.model._delta_nets():
        layer.kernels = "triton"


@pytest.mark.parametrize("num_spec", [2])  # (two drafts under the interpreter; on CUDA also one)
def test_speculating_step_graphs_of_the_hybrid_model_give_the_tokens_of_plain_decoding(mtp_dir, plain_q35, num_spec):
    """Uniform steps through SpecGraphs with the delta nets on triton's kernels (the interpreter; on a CPU the
    "graphs" rerun their passes over the static buffers): each sequence's state slot and each token's history row
    come from static buffers, padded rows skip the kernels, and a rejected draft's state is rolled back from those
    rows. Plain decoding's tokens and logprobs, the eager steps' drafts, KV cache and state pools (over five of the
    helpers' requests, greedy, seeded and with logprobs: a uniform step of five, padded to six, and one of one)."""
    pytest.importorskip("flotilla.kernels.triton.gdn", reason="triton is not installed")
    from helpers_spec import check_step_graphs, requests

    reqs = [r for r in requests() if r.rid in ("r0", "r1", "r2", "r3", "r8")]
    check_step_graphs(mtp_dir, num_spec, "cpu", plain_q35, prepare=on_triton_kernels, reqs=reqs)


def test_steps_planned_ahead_roll_the_hybrid_models_states_back_on_the_device(mtp_dir, plain_q35):
    """Steps planned ahead (graphs rerun eagerly, the delta nets on the interpreter): before a chained verify the
    states the step before left are rolled back on the device from its history rows; plain decoding's tokens and
    logprobs with none, some and all drafts accepted (the longest two of the helpers' greedy requests)."""
    pytest.importorskip("flotilla.kernels.triton.gdn", reason="triton is not installed")
    from helpers_spec import check_steps_planned_ahead, requests

    reqs = [r for r in requests() if r.rid in ("r0", "r5")]
    check_steps_planned_ahead(mtp_dir, 1, "cpu", reqs, plain_q35, prepare=on_triton_kernels)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_steps_planned_ahead_on_cuda_roll_the_hybrid_models_states_back_on_the_device(mtp_dir):
    from helpers_spec import check_steps_planned_ahead

    check_steps_planned_ahead(mtp_dir, 2, "cuda", prepare=on_triton_kernels)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_spec", [1, 2])
def test_speculating_step_cuda_graphs_of_the_hybrid_model_give_the_tokens_of_plain_decoding(mtp_dir, num_spec):
    """The same on CUDA, where the runner captures the verify / MTP / draft graphs itself (the delta nets' decode
    kernels token by token in the verify graph)."""
    from helpers_spec import check_step_graphs, run

    plain = make_runner(mtp_dir, None, device="cuda")
    on_triton_kernels(plain)
    plain_cuda = run(plain)[:2]
    check_step_graphs(mtp_dir, num_spec, "cuda", plain_cuda, prepare=on_triton_kernels)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_spec", [1, 3])
def test_verify_steps_on_cuda_give_the_greedy_tokens_of_plain_decoding(mtp_dir, num_spec, monkeypatch):
    """On CUDA a step where every sequence verifies its drafts runs the delta nets' decode kernels token by token:
    three sequences with the oracle's drafts (some wrong) give plain decoding's greedy tokens on the same device."""
    from flotilla.transport.messages import TokenizedRequest
    from helpers_spec import oracle, run

    ran = []
    verify = GatedDeltaNet._verify
    monkeypatch.setattr(GatedDeltaNet, "_verify", lambda self, *a: ran.append(1) or verify(self, *a))
    reqs = [TokenizedRequest(rid=f"u{i}", prompt_ids=np.asarray(random_tokens(5 + i, seed=60 + i), dtype=np.int32),
                             eos_token_ids=[2], sampling=SamplingParams(max_tokens=18, temperature=0, ignore_eos=True))
            for i in range(3)]
    want = run(make_runner(mtp_dir, None, device="cuda"), reqs=reqs)[0]
    runner = make_runner(mtp_dir, num_spec, device="cuda")
    runner.spec.draft_hook = oracle(want, corrupt=True, reqs=reqs)
    assert run(runner, reqs=reqs)[0] == want
    assert ran


def test_mtp_through_the_engine_gives_transformers_greedy_tokens(mtp_dir, prompts):
    hf = load_hf_model(mtp_dir)  # (transformers drops mtp.*)
    turn = random_tokens(22, seed=75)
    with LLM(str(mtp_dir), block_size=4, kv_cache_blocks=128, max_num_seqs=4,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        assert _run(llm, prompts) == _reference(hf, prompts)
        # a second turn resumes the first's state snapshot (a hit under MTP leaves its last block to recompute)
        first = llm.generate([{"prompt_token_ids": turn}], SamplingParams(max_tokens=8, **GREEDY), use_tqdm=False)[0]
        second = turn + first.outputs[0].token_ids + random_tokens(5, seed=76)
        out = llm.generate([{"prompt_token_ids": second}], SamplingParams(max_tokens=12, **GREEDY),
                           use_tqdm=False)[0]
        assert out.num_cached_tokens > 0
        assert out.outputs[0].token_ids == _reference(hf, [second])[0]


def test_tensor_parallel_ranks_split_the_heads_and_their_state_and_give_transformers_tokens(model_dir, models,
                                                                                         prompts):
    """TP=2 (two worker processes over gloo): each rank runs half the delta nets' key and value heads with their
    state slots and snapshots, half the attention heads and half of each expert; the greedy tokens stay
    transformers', prefix hits included."""
    head = random_tokens(16, seed=60)
    shared = [head + random_tokens(5 + i, seed=61 + i) for i in range(3)]
    with LLM(str(model_dir), tensor_parallel_size=2, block_size=4, max_num_batched_tokens=16, kv_cache_blocks=128,
             max_num_seqs=4) as llm:
        assert _run(llm, prompts) == _reference(models[1], prompts)
        outs = [llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=12, **GREEDY),
                             use_tqdm=False)[0] for p in shared]
        assert [o.outputs[0].token_ids for o in outs] == _reference(models[1], shared)
        assert [o.num_cached_tokens for o in outs] == [0, 0, 16]
        assert {"worker/0", "worker/1"} <= set(llm.client.ready_detail)


@needs("openai", "the test talks to the server through the real openai client")
@needs("dlslime", "the KV data plane's TCP transport (and Debian's libibverbs1)")
def test_a_disaggregated_pair_moves_each_prompts_recurrent_state_with_its_kv(model_dir):
    """1P1D over dlslime TCP: the prefill engine saves each prompt's state into a snapshot slot its transfer holds,
    the decode engine's migration reads that row of every state pool with the KV blocks, and resumes it: every
    request, chat and completion, streamed or not (each twice: twice the snapshot slots), gets what a colocated
    engine gives, and afterwards neither engine holds a block, a transfer or a snapshot slot."""
    import helpers_pd as pdh

    pdh.check_pair_equals_colocated(str(model_dir), ["--block-size", "4", "--kv-cache-blocks", "200",
                                                     "--max-num-seqs", "8"], ("--num-state-snapshots", "4"), n=8)
