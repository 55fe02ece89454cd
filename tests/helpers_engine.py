"""Tiny engines for end-to-end tests: a tiny random model folder with a real (tiny) tokenizer.

The tokenizer is a byte-level BPE trained here on a few sentences (deterministic), with ChatML
special tokens at ids 0-2 so the tiny models' bos 1 / eos 2 mean <|im_start|> / <|im_end|>.
"""

from __future__ import annotations

import json
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
