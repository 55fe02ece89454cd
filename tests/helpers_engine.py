"""Tiny engines for end-to-end tests: a tiny random model folder with a real (tiny) tokenizer.

The tokenizer is a byte-level BPE trained here on a few sentences (deterministic), with ChatML
special tokens at ids 0-2 so the tiny models' bos 1 / eos 2 mean <|im_start|> / <|im_end|>.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from helpers_tiny_models import write_tiny_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Continuous batching keeps the GPU busy; paged attention keeps memory tidy.",
    "日本語のテキストと emoji 🙂🚀 mixed with numbers 12345.",
] * 20


def write_tiny_tokenizer(model_dir: Path, vocab_size: int) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    assert tok.get_vocab_size() <= vocab_size and tok.token_to_id("<|im_end|>") == 2
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": CHATML, "model_max_length": 256}))


def write_tiny_engine_model(model_dir: Path, name: str = "llama", seed: int = 0) -> Path:
    """A tiny random model (helpers_tiny_models) plus a tokenizer that fits its 320-token vocabulary."""
    write_tiny_model(model_dir, name, seed)
    write_tiny_tokenizer(model_dir, vocab_size=320)
    return model_dir


def set_max_positions(model_dir: Path, positions: int) -> Path:
    """A longer window for a tiny engine model: max_position_embeddings and the tokenizer's model_max_length (which
    caps max_model_len as in vLLM) both `positions`."""
    for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
        path = model_dir / name
        path.write_text(json.dumps({**json.loads(path.read_text()), key: positions}))
    return model_dir


def greedy_on_cuda_switched(model: str, variable: str, monkeypatch) -> dict[str, list[list[int]]]:
    """greedy_on_cuda's tokens with the environment variable `variable` at "0" and at "1" in the worker processes'
    environment (an A/B switch read at import), keyed by its value; asserts both engines ran CUDA graphs."""
    outs = {}
    for value in ("0", "1"):
        monkeypatch.setenv(variable, value)
        outs[value], detail = greedy_on_cuda(model)
        assert detail["worker/0"]["cuda_graphs"] == "on", detail
    return outs


def greedy_on_cuda(model: str, prompts: int = 10, **options) -> tuple[list[list[int]], dict]:
    """(greedy tokens, the engine's ready detail) of `prompts` random prompts with lengths 3-59 and max_tokens 3, 5,
    7, ... (batches shrink step by step, so several CUDA-graph sizes replay) on a bf16 CUDA engine with `options`."""
    from flotilla import LLM, SamplingParams

    rng = random.Random(9)
    ids = [[rng.randrange(3, 300) for _ in range(rng.randrange(3, 60))] for _ in range(prompts)]
    params = [SamplingParams(max_tokens=3 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(prompts)]
    # token ids in and out (skip_tokenizer_init): helpers_tiny_models' folders have no tokenizer, and without one
    # the tokenizer actor's vocabulary would be 1 token ("prompt token ids must be in [0, 1)")
    options.setdefault("skip_tokenizer_init", True)
    with LLM(model, kv_cache_blocks=512, block_size=16, device="cuda", dtype="bfloat16", max_num_seqs=16,
             **options) as engine:  # fmt: skip
        outs = engine.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], engine.client.ready_detail
