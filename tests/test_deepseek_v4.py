"""DeepSeek-V4 against transformers on a tiny random checkpoint (fp32) with all three attention kinds (sliding,
CSA with its indexer, HCA) and a hash-MoE first layer, prompts longer than the window and than several compression
windows: prefill and decode logits, greedy tokens, mixed batches, chunked prefill; loading DeepSeek's checkpoint
layout; and the engine end to end (prefix hits, preemption), since every cache it needs lies in per-token rows."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from helpers_engine import write_tiny_tokenizer
from helpers_optional import needs
from helpers_spec import add_v4_mtp_layer, check_speculation_follows_plain, make_runner, plain_decoding, requests
from helpers_tiny_models import ATOL, PagedRunner, hf_logits, load_flotilla_model, random_tokens

from flotilla import LLM, SamplingParams

if not hasattr(transformers, "DeepseekV4Config"):
    pytest.skip(f"transformers {transformers.__version__} has no DeepSeek-V4 (5.24 does): the reference is missing",
                allow_module_level=True)
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)

VOCAB = 320
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=8,
    n_shared_experts=1, layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                                     "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, sliding_window=8,
    o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3, hc_mult=2, hc_sinkhorn_iters=5,
    partial_rotary_factor=0.25, num_nextn_predict_layers=0, max_position_embeddings=512, bos_token_id=1,
    eos_token_id=2)
"""index_n_heads 8: an entry's indexer score is 0 only when every head's ReLU is, so top-k meets ties (which any
two implementations may break apart) rarely."""


def write_tiny_v4(path: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random DeepSeek-V4 saved as transformers saves it (DeepSeek's own tensor names); every parameter and
    buffer drawn at random, the ones transformers starts at zero or one (sinks, position biases, mHC, hash table,
    router bias) included."""
    torch.manual_seed(seed)
    config = transformers.DeepseekV4Config(**{**CONFIG, **overrides})
    model = transformers.DeepseekV4ForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            one = name.endswith(("norm.weight", ".scale", "hc_scale"))
            p.copy_((1.0 if one else 0.0) + (0.1 if one else 0.2) * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(VOCAB)]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    model.save_pretrained(path, safe_serialization=True)
    write_tiny_tokenizer(path, vocab_size=VOCAB)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_v4(tmp_path_factory.mktemp("v4") / "m")


@pytest.fixture(scope="module")
def models(folder):
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return load_flotilla_model(folder), hf


def test_every_parameter_comes_from_deepseeks_layout_and_the_cache_rows_fit_the_widest_layer(folder, models):
    from safetensors import safe_open

    with safe_open(str(next(folder.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.attn.indexer.compressor.wkv.weight" in names and "head.weight" in names  # DeepSeek's
    model, hf = models
    ours = dict(model.named_parameters())
    for name, p in hf.named_parameters():
        torch.testing.assert_close(ours[name], p, atol=0, rtol=0)
    # a row: the key-value head (32), the compressor's kv and gate projections (CSA: two series of 32 each; HCA:
    # one), the indexer's (two series of 16), then the entry (32) and indexer entry (16) of a window it ends
    csa = 32 + 2 * (2 * 32) + 2 * (2 * 16) + 32 + 16
    assert [layer.self_attn.row_width for layer in model.model.layers] == [32, csa, 32 + 2 * 32 + 32, csa]
    assert model.kv_cache_shape(10, 4) == (10, 4, csa)


def test_prefill_then_32_decode_steps_equal_transformers_and_its_greedy_tokens(models):
    model, hf = models
    prompt = random_tokens(45, seed=1, vocab=VOCAB)  # > window 8, 11 CSA entries, 5 HCA entries
    runner = PagedRunner(model, block_size=4)
    logits = [runner.step([(0, prompt)])[0]]
    tokens = list(prompt)
    for _ in range(32):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(runner.step([(0, [tokens[-1]])])[0])
    with torch.inference_mode():
        generated = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    assert tokens[len(prompt):] == generated[0, len(prompt):].tolist()
    torch.testing.assert_close(torch.cat(logits[:-1]), hf_logits(hf, tokens[:-1]), atol=ATOL, rtol=0)


def test_yarn_on_the_compressed_layers_as_the_released_checkpoints_have_it(tmp_path):
    """rope_parameters' scaling goes to the CSA / HCA layers, their compressors and the indexer, without YaRN's
    attention factor; the sliding layers keep plain RoPE."""
    folder = write_tiny_v4(tmp_path / "yarn", rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1})
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model = load_flotilla_model(folder)
    assert model.v4.compress_rope_scaling["rope_type"] == "yarn"
    prompt = random_tokens(45, seed=6, vocab=VOCAB)
    torch.testing.assert_close(PagedRunner(model, block_size=4).step([(0, prompt)])[0], hf_logits(hf, prompt),
                               atol=ATOL, rtol=0)


def test_chunks_across_windows_and_a_mixed_batch_equal_one_shot(models):
    model, hf = models
    a, b, c, d = (random_tokens(n, seed=s, vocab=VOCAB) for n, s in ((37, 2), (21, 3), (9, 4), (12, 6)))
    want = {i: hf_logits(hf, t) for i, t in enumerate((a, b, c, d))}
    runner = PagedRunner(model, block_size=4, seed=5)
    got = {0: [], 1: [], 2: [], 3: []}
    # d: a 2-token prompt, then one token a step, beside the others' chunks and then alone (decoding inside and past
    # the first window)
    steps = [[(0, a[:13]), (1, b[:5]), (3, d[:2])], [(0, a[13:30]), (1, b[5:]), (2, c), (3, d[2:3])],
             [(0, a[30:]), (3, d[3:4])], *([(3, d[i:i + 1])] for i in range(4, 12))]
    for step in steps:
        for (i, _), out in zip(step, runner.step(step), strict=True):
            got[i].append(out)
    for i in got:
        torch.testing.assert_close(torch.cat(got[i]), want[i], atol=ATOL, rtol=0)


def test_each_entry_is_written_once_into_the_row_that_ends_its_window_as_pooled_from_all_rows(models):
    """Chunks that end inside windows, then decode steps of two sequences at once that end windows of both rates:
    every window's entry (and indexer entry) sits in the row of its last token, equal to pooling the whole
    sequence's projections at once; no other row's entry columns are written (the cache starts NaN)."""
    model, _ = models
    a, b = random_tokens(48, seed=8, vocab=VOCAB), random_tokens(21, seed=10, vocab=VOCAB)
    runner = PagedRunner(model, block_size=4, seed=9)
    runner.step([(0, a[:6]), (1, b[:13])])
    runner.step([(0, a[6:19])])
    runner.step([(0, a[19:39]), (1, b[13:14])])  # (a prefill chunk and a decoding sequence in one step)
    for i in range(9):  # a's positions 39..47, and b's 14..20 beside the first seven: batched decode steps
        runner.step([(0, a[39 + i:40 + i])] + ([(1, b[14 + i:15 + i])] if 14 + i < 21 else []))
    for seq, length in ((0, 48), (1, 21)):
        slots = torch.tensor([runner.blocks[seq][p // 4] * 4 + p % 4 for p in range(length)])
        for layer, cache in zip(model.model.layers, runner.kv_caches, strict=True):
            attn = layer.self_attn
            if attn.compressor is None:
                continue
            rows = cache.view(-1, cache.shape[-1])[slots]
            ends = torch.arange(attn.rate - 1, length, attn.rate)
            for part, at, proj_at in ((attn.compressor, attn.entry_at, attn.proj_at),
                                      (attn.indexer, getattr(attn, "ientry_at", 0), getattr(attn, "iproj_at", 0))):
                if part is None:
                    continue
                want = part.entries(rows[:, proj_at:proj_at + 2 * part.width], model.compress_rotary)
                assert want.shape[0] == len(ends) == length // attn.rate
                torch.testing.assert_close(rows[ends, at:at + part.dim], want, atol=1e-6, rtol=0)
                others = torch.ones(length, dtype=torch.bool)
                others[ends] = False
                assert rows[others, at:at + part.dim].isnan().all()


@needs("triton", "the triton experts run under triton's CPU interpreter here")
def test_the_triton_experts_with_the_clamped_swiglu_give_the_torch_experts_logits(folder, models):
    """The MoE backend's fused kernels (the sorted GEMMs for a prefill, the small-batch path for decode steps) with
    swiglu_limit, hash-routed first layer included, against the torch experts."""
    from safetensors.torch import load_file

    from flotilla.models.deepseek_v4 import DeepseekV4ForCausalLM
    from flotilla.models.hf_config import load_hf_config

    model = DeepseekV4ForCausalLM(load_hf_config(folder), moe_backend="triton")
    model.load_weights(load_file(str(next(folder.glob("*.safetensors")))).items())
    assert model.moe_backend_name == "triton"
    runners = [PagedRunner(models[0], block_size=4, seed=3), PagedRunner(model.eval(), block_size=4, seed=3)]
    tokens = random_tokens(30, seed=12, vocab=VOCAB)
    for batch in ([(0, tokens[:26]), (1, tokens[:5])], [(0, tokens[26:27]), (1, tokens[5:6])]):
        want, got = (runner.step(batch) for runner in runners)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def triton_model(folder: Path):
    """The tiny model on the attention kernels (under triton's interpreter on a CPU), the experts in torch."""
    from safetensors.torch import load_file

    from flotilla.models.deepseek_v4 import DeepseekV4ForCausalLM
    from flotilla.models.hf_config import load_hf_config

    model = DeepseekV4ForCausalLM(load_hf_config(folder), attention_backend="triton", moe_backend="torch")
    model.load_weights(load_file(str(next(folder.glob("*.safetensors")))).items())
    assert model.attention_backend_name == "v4_triton"
    return model.eval()


@needs("triton", "the attention kernels run under triton's CPU interpreter here")
def test_the_attention_kernels_give_the_references_logits(folder, models):
    """The kernels' path (each token's window rows and entries as cache offsets; the indexer's logits over the
    entries' rows; sink attention) against the torch reference: chunks that end inside windows and across them,
    decodes that finish windows of both rates, a mixed batch."""
    from flotilla.models.deepseek_v4 import DeepseekV4ForCausalLM
    from flotilla.models.hf_config import load_hf_config

    with pytest.raises(ValueError, match="triton kernels or the torch reference"):
        DeepseekV4ForCausalLM(load_hf_config(folder), attention_backend="flashinfer")
    runners = [PagedRunner(models[0], block_size=4, seed=3), PagedRunner(triton_model(folder), block_size=4, seed=3)]
    a, b = random_tokens(45, seed=13, vocab=VOCAB), random_tokens(20, seed=14, vocab=VOCAB)
    # decodes at a's positions 37..40 and b's 7..10: both end a window of 4 and of 8 (at 39 and 7)
    steps = [[(0, a[:18]), (1, b[:6])], [(0, a[18:37]), (1, b[6:7])], *([(0, a[i:i + 1]), (1, b[i - 30:i - 29])]
                                                                        for i in range(37, 41))]
    for batch in steps:
        want, got = (runner.step(batch) for runner in runners)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def graph_shaped_step(runner: PagedRunner, batch: list[tuple[int, list[int]]], size: int, scratch: int,
                      max_blocks: int) -> list[torch.Tensor]:
    """One decode step as actors/cuda_graphs.py replays it: `size` rows, the rows past the batch's one token at
    position 0 on the scratch block, every block table `max_blocks` wide and max_seq_len as long as they allow."""
    from flotilla.kernels.attention import AttentionMetadata

    bs, cached, tables = runner.block_size, [], []
    for seq_id, _ in batch:
        blocks, n = runner.blocks[seq_id], runner.num_cached[seq_id]
        while len(blocks) < -(-(n + 1) // bs):
            blocks.append(runner.free_blocks.pop())
        cached.append(n)
        tables.append(blocks)
    pad = size - len(batch)
    meta = AttentionMetadata.from_lists(cached + [0] * pad, [1] * size, tables + [[scratch]] * pad, bs,
                                        max_blocks_per_seq=max_blocks)
    meta.max_seq_len = max_blocks * bs
    ids = torch.tensor([t for _, ids in batch for t in ids] + [0] * pad)
    with torch.inference_mode():
        hidden = runner.model(ids, torch.tensor(cached + [0] * pad), runner.kv_caches, meta)
        logits = runner.model.compute_logits(hidden)[:len(batch)]
    for seq_id, _ in batch:
        runner.num_cached[seq_id] += 1
    return list(logits.split(1))


@needs("triton", "the attention kernels run under triton's CPU interpreter here")
def test_decode_steps_shaped_as_cuda_graphs_replay_them_give_the_eager_steps_logits(folder):
    """What a decode graph runs (padding rows on a scratch block, tables and key lists as wide as the longest
    context allows, windows pooled under a mask instead of by the finishing rows read back) gives the real rows the
    eager step's logits, over decodes that finish windows of both compression rates."""
    model = triton_model(folder)
    eager, graphed = PagedRunner(model, block_size=4, seed=3), PagedRunner(model, block_size=4, seed=3)
    scratch = graphed.free_blocks.pop(0)
    eager.free_blocks.remove(scratch)
    a, b = random_tokens(23, seed=15, vocab=VOCAB), random_tokens(16, seed=16, vocab=VOCAB)
    for runner in (eager, graphed):
        runner.step([(0, a[:13]), (1, b[:6])])
    for i in range(5):  # positions 13..17 and 6..10: windows of 4 and 8 end along the way (at 15 and 7)
        batch = [(0, a[13 + i:14 + i]), (1, b[6 + i:7 + i])]
        want, got = eager.step(batch), graph_shaped_step(graphed, batch, 4, scratch, max_blocks=16)
        for w, g in zip(want, got, strict=True):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def greedy(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt."""
    out = []
    for p in prompts:
        with torch.inference_mode():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def test_the_engine_gives_transformers_tokens_with_chunks_prefix_hits_and_preemption(folder, models):
    hf = models[1]
    head = random_tokens(24, seed=30, vocab=VOCAB)
    prompts = [head + random_tokens(n, seed=31 + n, vocab=VOCAB) for n in (3, 9, 17)]
    want = greedy(hf, prompts, 12)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), block_size=4, max_num_batched_tokens=16, kv_cache_blocks=128, max_num_seqs=4) as llm:
        first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
        rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in first + rest] == want
        assert all(o.num_cached_tokens == 24 for o in rest)  # (the rows of every layer kind came from the cache)
    with LLM(str(folder), block_size=4, kv_cache_blocks=18, max_num_seqs=3) as small:
        outs = small.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert small.client.runtime.actors["scheduler/0"].core.num_preemptions > 0


@pytest.fixture(scope="module")
def mtp_dir(folder, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("v4mtp") / "m"
    shutil.copytree(folder, d)
    return add_v4_mtp_layer(d)


MTP_REQUESTS = ("r1", "r2", "r3", "r4", "r5", "r8", "r12")
"""The helpers' requests the MTP tests run: every kind (greedy, seeded, logprobs, penalised, a stop token) and r12,
which hits r1's prompt in the prefix cache."""


@pytest.fixture(scope="module")
def mtp_requests() -> list:
    return [r for r in requests() if r.rid in MTP_REQUESTS]


@pytest.fixture(scope="module")
def plain_v4(mtp_dir, mtp_requests):
    return plain_decoding(mtp_dir, mtp_requests)


@pytest.mark.parametrize("num_spec", [1, 2])
def test_mtp_speculation_gives_the_tokens_of_plain_decoding(mtp_dir, mtp_requests, plain_v4, num_spec):
    """The MTP layer (DeepSeek's mtp.0.*: hnorm / h_proj of each residual stream plus e_proj of the next token's
    embedding, one sliding-window decoder layer with its own cache layer, its own hc_head) drafts; the oracle hook
    replaces its random drafts with plain decoding's tokens, some wrong: greedy tokens, seeded samples and logprobs
    equal plain decoding's, with none, some and all drafts accepted."""
    runner = make_runner(mtp_dir, num_spec)
    model = runner.model
    assert model.num_layers == 5 and len(runner.kv_caches) == 5  # four layers, then the MTP layer's
    assert model.mtp.block.self_attn.rate == 0 and not model.mtp.block.mlp.hashed
    assert not model.checkpoint_filter()("mtp.0.head.weight") and model.checkpoint_filter()("mtp.0.e_proj.weight")
    check_speculation_follows_plain(runner, plain_v4, num_spec, mtp_requests)


def test_mtp_through_the_engine_gives_transformers_greedy_tokens(mtp_dir, models):
    """transformers drops mtp.*: its greedy tokens are what speculation must give, prefix hits included."""
    prompts = [random_tokens(n, seed=60 + n, vocab=VOCAB) for n in (6, 23)]
    want = greedy(models[1], prompts, 12)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(mtp_dir), block_size=4, kv_cache_blocks=128, max_num_seqs=4,
             speculative_config={"method": "mtp", "num_speculative_tokens": 2}) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert llm.client.runtime.actors["scheduler/0"].core.spec_draft_tokens > 0
    with pytest.raises(Exception, match="no MTP layer"):  # (the plain checkpoint declares none)
        LLM(str(models_dir_without_mtp(mtp_dir)), speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def models_dir_without_mtp(mtp_dir: Path) -> Path:
    """A copy of the MTP checkpoint's folder whose config declares an MTP layer its weights lack."""
    from safetensors.torch import load_file, save_file

    d = mtp_dir.parent / "no_mtp_weights"
    if not d.exists():
        shutil.copytree(mtp_dir, d)
        weights = load_file(str(d / "model.safetensors"))
        save_file({k: v for k, v in weights.items() if not k.startswith("mtp.")}, str(d / "model.safetensors"))
    return d


@pytest.mark.slow
def test_two_tensor_parallel_ranks_split_heads_and_experts_and_give_transformers_tokens(folder, models):
    """Each rank keeps half the query heads (and their sinks and output groups) and half of every expert's
    intermediate dims; the key-value head, the compressors and the indexer are whole on both."""
    hf = models[1]
    prompts = [random_tokens(n, seed=40 + n, vocab=VOCAB) for n in (5, 19, 37)]
    want = greedy(hf, prompts, 10)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), tensor_parallel_size=2, block_size=4, max_num_batched_tokens=16, kv_cache_blocks=128,
             max_num_seqs=4) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.slow
@needs("openai", "the test talks to the server through the real openai client")
@needs("dlslime", "the KV data plane's TCP transport (and Debian's libibverbs1)")
def test_a_disaggregated_pair_moves_every_layer_kinds_rows_and_answers_as_one_engine(folder):
    import helpers_pd as pdh

    pdh.check_pair_equals_colocated(str(folder), ["--block-size", "4", "--kv-cache-blocks", "200", "--max-num-seqs",
                                                  "8", "--served-model-name", "m"], n=8)


def test_the_config_reads_deepseeks_legacy_names_and_transformers_defaults():
    from flotilla.models.hf_config import parse_hf_config

    base = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 64,
            "hidden_size": 32, "moe_intermediate_size": 16, "num_hidden_layers": 5, "num_attention_heads": 2,
            "head_dim": 64, "n_routed_experts": 4, "num_experts_per_tok": 2}
    legacy = parse_hf_config({**base, "compress_ratios": [0, 4, 128, 4, 128], "num_hash_layers": 2,
                              "qk_rope_head_dim": 16, "rope_scaling": {"type": "yarn", "factor": 16,
                                                                       "original_max_position_embeddings": 65536}})
    v4 = legacy.deepseek_v4
    assert v4.layer_types == ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                              "compressed_sparse_attention", "heavily_compressed_attention")
    assert v4.mlp_layer_types == ("hash_moe", "hash_moe", "moe", "moe", "moe") and v4.rope_dim == 16
    assert v4.compress_rope_scaling["factor"] == 16 and v4.compress_rope_theta == 160000.0
    assert [v4.rate(i) for i in range(5)] == [0, 4, 128, 4, 128]
    default = parse_hf_config(base).deepseek_v4  # transformers': two HCA layers, then CSA and HCA in turn
    assert default.layer_types[:4] == ("heavily_compressed_attention",) * 2 + (
        "heavily_compressed_attention", "compressed_sparse_attention")
    assert default.mlp_layer_types == ("hash_moe",) * 3 + ("moe",) * 2 and default.compress_rope_scaling is None
    with pytest.raises(ValueError, match="unknown DeepSeek-V4 layer_types"):
        parse_hf_config({**base, "layer_types": ["full_attention"] * 5})


FP8_LINEARS = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.indexer\.wq_b\.weight$|\.(w1|w2|w3)\.weight$")
"""The linears V4-Flash-Base keeps in FP8 blocks: attention's projections, the indexer's queries, every expert."""
ROUTED = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
"""V4-Flash's routed experts are MXFP4 instead."""
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] as V4-Flash stores an expert: int8 [N, K / 2] of e2m1 pairs (low nibble first) and uint8 E8M0
    exponents [N, K / 32], one per 32 values of a row."""
    blocks = w.float().view(w.shape[0], -1, 32)
    exp = torch.ceil(torch.log2(blocks.abs().amax(-1).clamp(min=1e-12) / 6.0)).clamp(-127, 127)
    scaled = blocks / exp.exp2()[..., None]
    code = (scaled.abs()[..., None] - E2M1).abs().argmin(-1) + 8 * (scaled < 0)
    code = code.view(w.shape[0], -1, 2).to(torch.uint8)
    return (code[..., 0] | (code[..., 1] << 4)).view(torch.int8), (exp + 127).to(torch.uint8)


def test_an_fp8_and_mxfp4_checkpoint_loads_as_transformers_dequantizes_it(folder, tmp_path):
    """DeepSeek-V4-Flash's layout: e4m3 weights with float32 `weight_scale_inv` per 32 x 32 block here (128 x 128 in
    the release), partial blocks included, and routed experts in MXFP4 (expert_dtype fp4); the reference
    dequantizes both as they load, to the weights transformers' own dequantization gives."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from flotilla.kernels.quant.fp8_ref import block_dequantize, block_quantize

    quantized, dequantized = {}, {}
    for name, w in load_file(str(folder / "model.safetensors")).items():
        if ROUTED.search(name):
            q, s = mxfp4(w)
            dequantized[name] = Fp8Dequantize(None)._dequantize_one(q, s, torch.float32)
        elif FP8_LINEARS.search(name):
            q, s = block_quantize(w, (32, 32))
            dequantized[name] = block_dequantize(q, s, (32, 32))
        else:
            quantized[name] = dequantized[name] = w
            continue
        quantized[name], quantized[f"{name}_scale_inv"] = q, s
    config = json.loads((folder / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32], "activation_scheme": "dynamic",
             "expert_dtype": "fp4"}
    dirs = {}
    for sub, tensors, extra in (("quantized", quantized, {"quantization_config": quant}), ("float", dequantized, {})):
        d = dirs[sub] = tmp_path / sub
        d.mkdir()
        save_file(tensors, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps({**config, **extra}))
    assert sum(t.dtype == torch.int8 for t in quantized.values()) == 4 * 8 * 3  # (every routed expert's w1, w2, w3)
    a, b = load_flotilla_model(dirs["quantized"]), load_flotilla_model(dirs["float"])
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=name)
    prompt = random_tokens(30, seed=8, vocab=VOCAB)
    torch.testing.assert_close(PagedRunner(a, block_size=4).step([(0, prompt)])[0],
                               PagedRunner(b, block_size=4).step([(0, prompt)])[0], atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_engine_on_cuda_gives_transformers_tokens(folder, models):
    """The attention kernels on a GPU ("auto"; float32, decode steps in CUDA graphs), batched, chunked."""
    hf = models[1]
    prompts = [random_tokens(n, seed=50 + n, vocab=VOCAB) for n in (7, 26, 41)]
    want = greedy(hf, prompts, 10)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), device="cuda", dtype="float32", block_size=16, max_num_batched_tokens=32,
             kv_cache_blocks=64, max_num_seqs=4) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want


def test_dummy_weights_give_the_hash_layers_a_random_table_of_distinct_experts(folder):
    from flotilla.models.loader import load_model

    model = load_model(folder, load_format="dummy", progress=False).module
    table = model.model.layers[0].mlp.gate.tid2eid
    assert table.shape == (VOCAB, 2) and (table[:, 0] != table[:, 1]).all() and len(table.unique()) == 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decode_cuda_graphs_give_the_eager_tokens(folder):
    """Decode steps replayed from CUDA graphs (masked pooling, static tables) against eager steps, in float32 (the
    two take different splits of the key lists: bfloat16 would round them apart on a random tiny model)."""
    from test_cuda_graphs_static import _graph_and_eager

    outs = _graph_and_eager(str(folder), dtype="float32")
    assert outs[False] == outs[True]
