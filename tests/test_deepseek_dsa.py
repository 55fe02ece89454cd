"""DeepSeek-V3.2 and GLM-5 (DeepSeek Sparse Attention) against transformers on tiny random checkpoints (fp32) whose
indexer top-k is smaller than the prompts, so attention really is sparse: prefill and paged decode logits, greedy
tokens, mixed batches, chunked prefill, GLM-5's shared-selection layers and interleaved indexer RoPE, FP8
checkpoints; and the engine end to end: prefix hits, preemption, MTP, tensor parallelism, prefill-decode
disaggregation (the indexer's keys ride in the latent cache's rows)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers_engine import write_tiny_tokenizer
from helpers_optional import needs
from helpers_spec import add_mtp_layer, check_same, make_runner, oracle, run
from helpers_tiny_models import (
    TINY_DSA_CONFIGS,
    PagedRunner,
    check_greedy_matches_generate,
    check_mixed_batch_equals_each_alone,
    check_prefill_then_paged_decode,
    load_flotilla_model,
    load_hf_model,
    random_tokens,
    write_tiny_deepseek_fp8_pair,
    write_tiny_dsa_model,
)

from flotilla import LLM, SamplingParams
from flotilla.models.hf_config import load_hf_config, parse_hf_config
from flotilla.models.loader import load_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_dsa")
    dirs = {name: write_tiny_dsa_model(root / name, name) for name in TINY_DSA_CONFIGS}
    for d in dirs.values():
        write_tiny_tokenizer(d, vocab_size=320)
    return dirs


@pytest.fixture(scope="module")
def models(model_dirs) -> dict:
    return {name: (load_flotilla_model(d), load_hf_model(d)) for name, d in model_dirs.items()}


def test_the_indexers_follow_the_config_and_their_keys_ride_in_the_latent_rows(model_dirs, models):
    v32, glm = load_hf_config(model_dirs["deepseek_v32"]), load_hf_config(model_dirs["glm_moe_dsa"])
    assert (v32.dsa.index_topk, v32.dsa.index_n_heads, v32.dsa.rope_interleave) == (6, 16, False)
    assert glm.dsa.rope_interleave and glm.dsa.shared == (False, True, False, True)
    model = models["glm_moe_dsa"][0]
    assert [layer.self_attn.indexer is not None for layer in model.model.layers] == [True, False, True, False]
    assert model.kv_cache_shape(10, 4) == (10, 4, 32 + 16 + 32 + 4)  # [c_kv | k_pe | the indexer's key | its scale]
    assert model.mla_backend_name == "torch"
    with pytest.raises(ValueError, match="indexer_types"):
        parse_hf_config({**json.loads((model_dirs["glm_moe_dsa"] / "config.json").read_text()),
                         "indexer_types": ["shared", "full", "full", "full"]})


@pytest.mark.parametrize("name", list(TINY_DSA_CONFIGS))
def test_prefill_then_paged_decode_match_transformers(name, models):
    check_prefill_then_paged_decode(*models[name])


@pytest.mark.parametrize("name", list(TINY_DSA_CONFIGS))
def test_greedy_tokens_match_transformers_generate(name, models):
    check_greedy_matches_generate(*models[name])


@pytest.mark.parametrize("name", list(TINY_DSA_CONFIGS))
def test_mixed_batch_equals_each_sequence_alone(name, models):
    check_mixed_batch_equals_each_alone(*models[name])


def test_chunked_prefill_equals_one_shot(models):
    """Each chunk's queries score every cached key, the earlier chunks' included."""
    model, _ = models["glm_moe_dsa"]
    tokens = random_tokens(21, seed=4)
    one_shot = PagedRunner(model, block_size=4).step([(0, tokens)])[0]
    runner = PagedRunner(model, block_size=4, seed=9)
    chunks = [runner.step([(0, tokens[a:b])])[0] for a, b in ((0, 7), (7, 10), (10, 21))]
    torch.testing.assert_close(torch.cat(chunks), one_shot, atol=1e-5, rtol=0)


def test_an_fp8_checkpoint_equals_its_dequantized_weights(tmp_path):
    """The indexer's wq_b and wk load as FP8 block-scaled linears with the other projections."""
    fp8_dir, float_dir = write_tiny_deepseek_fp8_pair(tmp_path, "deepseek_v32", block=(16, 16))
    fp8 = load_model(fp8_dir, progress=False).module
    assert fp8.model.layers[0].self_attn.indexer.wq_b.weight.dtype == torch.float8_e4m3fn
    tokens = random_tokens(19, seed=6)
    got = PagedRunner(fp8.eval(), block_size=4).step([(0, tokens)])[0]
    want = PagedRunner(load_flotilla_model(float_dir), block_size=4).step([(0, tokens)])[0]
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)  # (activations quantized per token group)


# ---- the engine -------------------------------------------------------------------------------------------------


def _reference(hf, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    out = []
    for p in prompts:
        with torch.inference_mode():
            ids = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                              max_new_tokens=max_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int = 12):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=max_tokens, **GREEDY),
                        use_tqdm=False)


@pytest.mark.parametrize("name", list(TINY_DSA_CONFIGS))
def test_the_engine_gives_transformers_tokens_with_chunks_prefix_hits_and_preemption(name, model_dirs, models):
    hf = models[name][1]
    head = random_tokens(16, seed=30)
    prompts = [head + random_tokens(n, seed=31 + n) for n in (3, 9, 17, 25)]
    want = _reference(hf, prompts)
    with LLM(str(model_dirs[name]), block_size=4, max_num_batched_tokens=16, kv_cache_blocks=128,
             max_num_seqs=4) as llm:
        first = _generate(llm, prompts[:1])
        rest = _generate(llm, prompts[1:])  # their heads hit the first one's cached blocks (index keys included)
        assert [o.outputs[0].token_ids for o in first + rest] == want
        assert all(o.num_cached_tokens == 16 for o in rest)
    with LLM(str(model_dirs[name]), block_size=4, kv_cache_blocks=16, max_num_seqs=4) as small:
        assert [o.outputs[0].token_ids for o in _generate(small, prompts)] == want
        assert small.client.runtime.actors["scheduler/0"].core.num_preemptions > 0


def test_tensor_parallel_ranks_split_the_heads_and_run_the_indexer_whole(model_dirs, models):
    prompts = [random_tokens(n, seed=40 + n) for n in (5, 14, 23)]
    with LLM(str(model_dirs["glm_moe_dsa"]), tensor_parallel_size=2, block_size=4, max_num_batched_tokens=16,
             kv_cache_blocks=128, max_num_seqs=4) as llm:
        assert [o.outputs[0].token_ids for o in _generate(llm, prompts)] == _reference(models["glm_moe_dsa"][1],
                                                                                       prompts)


@pytest.fixture(scope="module")
def mtp_dir(model_dirs, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("dsa_mtp") / "m"
    shutil.copytree(model_dirs["deepseek_v32"], d)
    return add_mtp_layer(d)  # (layer 1's tensors, its indexer's included: the MTP layer runs its own)


def test_mtp_speculation_with_a_sparse_mtp_layer_gives_the_tokens_of_plain_decoding(mtp_dir):
    plain = run(make_runner(mtp_dir, None))[:2]
    runner = make_runner(mtp_dir, 2)
    assert runner.model.model.mtp_layers[0].self_attn.indexer is not None
    runner.spec.draft_hook = oracle(plain[0], corrupt=True)
    tokens, logprobs, sched, verified = run(runner)
    check_same((tokens, logprobs), plain)
    assert 0 < sched.spec_accepted_tokens < sched.spec_draft_tokens


@needs("openai", "the test talks to the server through the real openai client")
@needs("dlslime", "the KV data plane's TCP transport (and Debian's libibverbs1)")
def test_a_disaggregated_pair_moves_the_indexer_keys_with_the_latents(model_dirs):
    import helpers_pd as pdh

    pdh.check_pair_equals_colocated(str(model_dirs["deepseek_v32"]), ["--block-size", "4", "--kv-cache-blocks", "200",
                                                                     "--max-num-seqs", "8", "--served-model-name", "m"],
                                    n=8, offset=7)
