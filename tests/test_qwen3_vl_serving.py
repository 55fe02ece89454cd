"""Qwen3-VL served: images as base64 PNGs through the real openai client against `flotilla serve` on a tiny random
checkpoint, each answer equal to transformers' greedy generate on the same pixels; prefill chunks that cut through
images; prefix caching that tells images apart; bad images refused with a 400 naming the part, the server serving on."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from helpers_engine import CORPUS, SPECIALS
from helpers_optional import needs, require
from helpers_server import start_server
from helpers_vl import (
    IMAGE,
    TEXT_VOCAB,
    VISION_END,
    VISION_START,
    hf_inputs,
    load_hf_vl_model,
    write_tiny_qwen3_vl_model,
)
from PIL import Image
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoImageProcessor, PreTrainedTokenizerFast

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # (conftest.py)

openai = require("openai", "the tests talk to the server through the real client")

PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "size": {"longest_edge": 128 * 128, "shortest_edge": 32 * 32}}
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VL_TOKENS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"]  # ids 300 .. 303
MAX_TOKENS = 12


def write_vl_tokenizer(d: Path) -> None:
    """A byte-level BPE whose vision tokens sit at the tiny checkpoint's ids (300 ...), fillers before them."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TEXT_VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(tok.get_vocab_size(), TEXT_VOCAB)] + VL_TOKENS)
    assert tok.token_to_id("<|image_pad|>") == IMAGE
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "chat_template": TEMPLATE, "model_max_length": 256}))
    (d / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))


def png(width: int, height: int, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def image_part(data: bytes, media: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{base64.b64encode(data).decode()}"}}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = write_tiny_qwen3_vl_model(tmp_path_factory.mktemp("qwen3vl") / "m", moe=False)
    write_vl_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def reference(folder):
    """(messages -> the text transformers' greedy generate answers) on the served checkpoint and template; each
    answer is computed once (the tests ask for the same few many times)."""
    hf = load_hf_vl_model(folder)
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    answers: dict[tuple[str, tuple[bytes, ...]], tuple[str, list[int]]] = {}

    def answer(messages: list[dict], images: list[bytes]) -> tuple[str, list[int]]:
        """The greedy answer's text and the prompt's token ids (each image's placeholders expanded)."""
        key = (json.dumps(messages, sort_keys=True, default=repr), tuple(images))
        if key not in answers:
            answers[key] = generate(messages, images)
        text, ids = answers[key]
        return text, list(ids)

    def generate(messages: list[dict], images: list[bytes]) -> tuple[str, list[int]]:
        parts = [[{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]
                 if isinstance(m["content"], list) else m["content"] for m in messages]
        text = tok.apply_chat_template([{**m, "content": c} for m, c in zip(messages, parts)], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False)
        grids: list[tuple[int, int, int]] = []
        pixels = None
        if images:
            batch = processor(images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt")
            grids = [tuple(g) for g in batch["image_grid_thw"].tolist()]
            pixels = batch["pixel_values"]
            expanded, it = [], iter(grids)
            for t in ids:
                expanded.extend([IMAGE] * (int(np.prod(next(it))) // 4) if t == IMAGE else [t])
            ids = expanded
        with torch.inference_mode():
            out = hf.generate(**hf_inputs(ids, pixels, grids), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                              do_sample=False)
        return tok.decode(out[0, len(ids):], skip_special_tokens=True), ids

    return answer


@pytest.fixture(scope="module")
def server(folder):
    # prefill chunks of 16 tokens with blocks of 4: the images' placeholder runs are cut across chunks and blocks
    srv = start_server(str(folder), "--max-num-batched-tokens", "16", "--block-size", "4", "--kv-cache-blocks", "256",
                       "--limit-mm-per-prompt", '{"image": 3}', "--max-model-len", "256", timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(client, messages: list[dict], stream: bool = False):
    kw = dict(model="m", messages=messages, max_tokens=MAX_TOKENS, temperature=0.0, extra_body={"ignore_eos": True})
    if not stream:
        return client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage


CAT, DOG, WIDE = png(64, 48, 1), png(40, 90, 2), png(120, 32, 3)


def test_images_stream_what_transformers_generates_from_their_pixels(client, reference):
    cases = [
        [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part(CAT)]}],
        [{"role": "system", "content": "Be brief."},
         {"role": "user", "content": [image_part(DOG), {"type": "text", "text": "and"}, image_part(WIDE),
                                      {"type": "text", "text": "compare them"}]}],
    ]
    for messages, images in zip(cases, ([CAT], [DOG, WIDE]), strict=True):
        want, ids = reference(messages, images)
        text, usage = ask(client, messages, stream=True)
        assert text == want
        assert usage.prompt_tokens == len(ids) and usage.completion_tokens == MAX_TOKENS
        assert ask(client, messages).choices[0].message.content == want


def test_the_same_text_with_another_image_never_hits_the_prefix_cache_and_the_same_image_does(client, reference):
    text = [{"type": "text", "text": "The quick brown fox jumps over the lazy dog. Describe:"}]
    first = [{"role": "user", "content": text + [image_part(CAT)]}]
    other = [{"role": "user", "content": text + [image_part(DOG)]}]
    a, b = ask(client, first), ask(client, other)
    assert a.choices[0].message.content == reference(first, [CAT])[0]
    assert b.choices[0].message.content == reference(other, [DOG])[0]
    # the text before the image may be shared; nothing from the image on is
    before_image = reference(first, [CAT])[1].index(IMAGE)
    assert b.usage.prompt_tokens_details.cached_tokens <= before_image
    again = ask(client, first)
    assert again.choices[0].message.content == a.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens > before_image  # the image's blocks too


BAD_PARTS = {
    "not an image": image_part(b"plain text, not an image"),
    "empty": image_part(b""),
    "truncated": image_part(png(64, 64, 4)[:150]),
    "bad base64": {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not-base64@@"}},
    "not an image type": image_part(png(32, 32, 5), media="text/plain"),
    "http URL of a host not allowed": {"type": "image_url", "image_url": {"url": "http://169.254.169.254/x.png"}},
    "file URL": {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
    "no image_url": {"type": "image_url"},
    "aspect beyond 200:1": image_part(png(402, 2, 6)),
    "unknown media part": {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
}


@pytest.mark.parametrize("kind", list(BAD_PARTS))
def test_a_bad_image_is_a_400_naming_its_part_and_the_server_serves_on(server, client, reference, kind):
    body = {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "look"}, image_part(CAT), BAD_PARTS[kind]]}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("messages[0].content[2]") and error["type"] == "invalid_request_error", error
    good = [{"role": "user", "content": [image_part(CAT)]}]
    assert ask(client, good).choices[0].message.content == reference(good, [CAT])[0]


def test_more_images_than_the_limit_are_refused(server):
    parts = [image_part(png(32, 32, 10 + i)) for i in range(4)]
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[3]", r.text
    assert "at most 3 images" in r.json()["error"]["message"]


def test_the_offline_llm_takes_images_as_data_urls_pil_images_or_bytes(folder, reference):
    from flotilla import LLM, SamplingParams

    conversations = [
        [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part(CAT)]}],
        [{"role": "user", "content": [{"type": "image", "image": Image.open(io.BytesIO(DOG))},
                                      {"type": "text", "text": "and"}, {"type": "image", "image": WIDE}]}],
    ]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), kv_cache_blocks=128, block_size=4, max_num_batched_tokens=16) as llm:
        outs = llm.chat(conversations, params, use_tqdm=False)
    as_served = [conversations[0], [{"role": "user", "content": [image_part(DOG), {"type": "text", "text": "and"},
                                                                 image_part(WIDE)]}]]
    for out, messages, images in zip(outs, as_served, ([CAT], [DOG, WIDE]), strict=True):
        assert out.outputs[0].text == reference(messages, images)[0]


def test_an_encoder_actor_beside_the_worker_answers_as_the_steps_do_and_lets_go_of_every_image(folder, reference):
    from flotilla import LLM, SamplingParams

    conversations = [[{"role": "user", "content": [image_part(CAT), {"type": "text", "text": "hi"}]}],
                     [{"role": "user", "content": [image_part(DOG), image_part(WIDE)]}],
                     [{"role": "user", "content": [{"type": "text", "text": "again"}, image_part(CAT)]}]]
    images = ([CAT], [DOG, WIDE], [CAT])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), image_encoder="actor", kv_cache_blocks=128, block_size=4, max_num_batched_tokens=16) as llm:
        actors = llm.client.runtime.actors
        assert "encoder/0" in actors
        outs = llm.chat(conversations, params, use_tqdm=False)
        assert actors["encoder/0"].requests_encoded == len(conversations)
        llm.generate(["text alone"], params, use_tqdm=False)  # (its step tells the worker the others finished)
        assert actors["encoder/0"].encoder.num_pinned == 0 and not actors["scheduler/0"]._encoding
    for out, messages, imgs in zip(outs, conversations, images, strict=True):
        assert out.outputs[0].text == reference(messages, imgs)[0]


def test_token_id_prompts_take_images_as_vllms_multi_modal_data(folder):
    """LLM.generate({"prompt_token_ids": ids with one placeholder per image, "multi_modal_data": {"image": ...}}), as
    vLLM's offline API takes it (what a benchmark with dummy weights and no tokenizer sends)."""
    from flotilla import LLM, SamplingParams

    hf = load_hf_vl_model(folder)
    processor = AutoImageProcessor.from_pretrained(str(folder), backend="pil")
    ids = [11, 12, VISION_START, IMAGE, VISION_END, 13, VISION_START, IMAGE, VISION_END, 14]
    pictures = [Image.open(io.BytesIO(DOG)), WIDE]
    batch = processor(images=[Image.open(io.BytesIO(b)) for b in (DOG, WIDE)], return_tensors="pt")
    grids = [tuple(g) for g in batch["image_grid_thw"].tolist()]
    expanded, it = [], iter(grids)
    for t in ids:
        expanded.extend([IMAGE] * (int(np.prod(next(it))) // 4) if t == IMAGE else [t])
    with torch.inference_mode():
        want = hf.generate(**hf_inputs(expanded, batch["pixel_values"], grids), max_new_tokens=MAX_TOKENS,
                           min_new_tokens=MAX_TOKENS, do_sample=False)[0, len(expanded):].tolist()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), skip_tokenizer_init=True, kv_cache_blocks=128, block_size=4) as llm:
        out, = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": pictures}}], params,
                            use_tqdm=False)
    assert out.outputs[0].token_ids == want and out.num_prompt_tokens == len(expanded)


@pytest.mark.slow
def test_tensor_parallel_ranks_each_run_the_vision_tower_and_answer_as_transformers_does(folder, reference):
    from flotilla import LLM, SamplingParams

    conversations = [[{"role": "user", "content": [image_part(CAT), {"type": "text", "text": "hi"}]}],
                     [{"role": "user", "content": [image_part(DOG), image_part(WIDE)]}]]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), tensor_parallel_size=2, kv_cache_blocks=128, block_size=4, max_num_batched_tokens=16) as llm:
        outs = llm.chat(conversations, params, use_tqdm=False)
    for out, messages, images in zip(outs, conversations, ([CAT], [DOG, WIDE]), strict=True):
        assert out.outputs[0].text == reference(messages, images)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("encoder", ["step", "actor", "remote"])
def test_images_on_cuda_with_graphs_answer_what_transformers_does(folder, reference, encoder):
    """Decode steps replayed from CUDA graphs carry each sequence's rope delta (fp32, so tokens match exactly); an
    encoder actor's embeddings, made on its own CUDA stream, are read after that stream wrote them; a vision encoder
    of its own process stages them through pinned host memory for dlslime."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if encoder == "remote":
        require("dlslime", "the KV data plane's TCP transport (and Debian's libibverbs1)")
    srv = start_server(str(folder), "--device", "cuda", "--dtype", "float32", "--block-size", "16",
                       "--kv-cache-blocks", "64", "--max-model-len", "256", "--max-num-seqs", "4",
                       "--image-encoder", encoder,
                       "--kv-transfer-backend", "dlslime_tcp", timeout=600)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        for messages, images in (([{"role": "user", "content": [image_part(CAT)]}], [CAT]),
                                 ([{"role": "user", "content": [image_part(DOG), image_part(WIDE)]}], [DOG, WIDE])):
            assert ask(client, messages).choices[0].message.content == reference(messages, images)[0]
    finally:
        srv.stop()


@pytest.mark.slow
@needs("dlslime", "the KV data plane's TCP transport (and Debian's libibverbs1)")
def test_a_disaggregated_pair_answers_image_requests_as_transformers_does(folder, reference):
    """The decode engine tokenizes the same request, so it knows each image's grid and decodes at index +
    rope_delta; the image's embeddings stay on the prefill side, inside the KV it sends. The prefill engine encodes
    in encoder actors of its worker processes, in chunks of 16 tokens."""
    pd = start_server(str(folder), "--engines", "prefill,decode", "--kv-transfer-backend", "dlslime_tcp", "--block-size", "4",
                      "--kv-cache-blocks", "256", "--max-model-len", "256", "--served-model-name", "m",
                      "--image-encoder", "actor", "--max-num-batched-tokens", "16", timeout=300)
    try:
        client = openai.OpenAI(base_url=pd.url + "/v1", api_key="unused", max_retries=0)
        for messages, images in (([{"role": "user", "content": [image_part(CAT), {"type": "text", "text": "hi"}]}],
                                  [CAT]),
                                 ([{"role": "user", "content": [image_part(DOG), image_part(WIDE)]}], [DOG, WIDE])):
            text, usage = ask(client, messages, stream=True)
            assert text == reference(messages, images)[0]
        assert any("encoder/0 ready" in line for line in pd.log), "".join(pd.log[-30:])
    finally:
        assert pd.stop() == 0, "".join(pd.log[-30:])


def test_the_embeddings_cache_keeps_what_an_encoder_pinned_until_its_request_lets_go(folder):
    from flotilla.actors.encoder import ImageEncoder
    from flotilla.actors.images import ImagePrompt
    from flotilla.transport.messages import ImageData
    from helpers_tiny_models import load_flotilla_model

    prompt = ImagePrompt(folder)
    cat, dog, wide = (prompt.expand([IMAGE], [ImageData(data=d)])[1][0] for d in (CAT, DOG, WIDE))
    encoder = ImageEncoder(load_flotilla_model(folder), folder, torch.device("cpu"), torch.float32,
                           cache_tokens=cat.length)
    encoder.prepare("a", [cat])
    (embeds, deepstack), = encoder.embeddings([cat])
    assert encoder.num_pinned == 1 and embeds.shape[0] == cat.length == deepstack.shape[1]
    encoder.embeddings([dog])  # over the cache's size: the unpinned image goes, the pinned one stays
    assert cat.hash in encoder._cache and dog.hash in encoder._cache
    encoder.embeddings([wide])
    assert cat.hash in encoder._cache and dog.hash not in encoder._cache
    encoder.release("a")
    encoder.embeddings([dog])
    assert cat.hash not in encoder._cache and encoder.num_pinned == 0
    torch.testing.assert_close(encoder.embeddings([cat])[0][0], embeds)  # encoded again, the same


def test_a_vision_encoder_of_its_own_hands_embeddings_over_the_data_plane_as_colocated_ones(folder, reference):
    """image_encoder = remote: the tower runs in the vision encoder alone; each image's rows reach the worker's encoder
    by a data-plane read (local backend: one process), and every answer is the one the steps give."""
    from flotilla import LLM, SamplingParams

    conversations = [[{"role": "user", "content": [image_part(CAT), {"type": "text", "text": "hi"}]}],
                     [{"role": "user", "content": [image_part(DOG), image_part(WIDE), image_part(DOG)]}],
                     [{"role": "user", "content": [{"type": "text", "text": "again"}, image_part(CAT)]}]]
    images = ([CAT], [DOG, WIDE, DOG], [CAT])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), image_encoder="remote", kv_transfer_backend="local", kv_cache_blocks=128, block_size=4,
             max_num_batched_tokens=16, limit_mm_per_prompt={"image": 3}) as llm:
        actors = llm.client.runtime.actors
        outs = llm.chat(conversations, params, use_tqdm=False)
        vision, encoder = actors["vision_encoder/0"], actors["encoder/0"]
        assert actors["worker/0"].runner.model.visual is None  # (the tower's weights only where it runs)
        assert vision.images_served == 4 and encoder.requests_encoded == len(conversations)
        assert encoder.transfer.bytes_read > 0 and not vision._leases and vision.space.used == 0
        llm.generate(["text alone"], params, use_tqdm=False)  # (its step tells the worker the others finished)
        assert encoder.encoder.num_pinned == 0 and not encoder._wanted and not actors["scheduler/0"]._encoding
    for out, messages, imgs in zip(outs, conversations, images, strict=True):
        assert out.outputs[0].text == reference(messages, imgs)[0]


@pytest.mark.slow
@needs("dlslime", "the KV data plane's TCP transport (and Debian's libibverbs1)")
def test_a_served_vision_encoder_process_feeds_two_tensor_parallel_ranks_over_dlslime(folder, reference):
    """The vision encoder in a process of its own, its staging region read over TCP by the encoder actors of both
    tensor-parallel ranks (each in its worker's process); streamed answers equal transformers'."""
    srv = start_server(str(folder), "--image-encoder", "remote", "--kv-transfer-backend", "dlslime_tcp",
                       "--tensor-parallel-size", "2", "--block-size", "4", "--kv-cache-blocks", "128",
                       "--max-model-len", "256", "--max-num-batched-tokens", "16", timeout=300)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        for messages, images in (([{"role": "user", "content": [image_part(DOG), {"type": "text", "text": "and"},
                                                                 image_part(WIDE)]}], [DOG, WIDE]),
                                 ([{"role": "user", "content": [image_part(CAT)]}], [CAT])):
            assert ask(client, messages, stream=True)[0] == reference(messages, images)[0]
        assert any("vision_encoder/0 ready" in line for line in srv.log), "".join(srv.log[-30:])
        assert sum("(Qwen3VLVisionTower" in line for line in srv.log) == 1, "".join(srv.log[-30:])
    finally:
        assert srv.stop() == 0, "".join(srv.log[-30:])


def test_a_vision_encoder_staging_one_image_at_a_time_serves_a_batch_and_a_failed_encoding_fails_its_request_alone(
        folder, reference, monkeypatch):
    """A staging region that holds one image's rows: images wait for the rows their readers give back, and a batch of
    requests still answers as transformers does; a tower that raises fails that request with the reason and leaves
    nothing held, and the next request is served."""
    from flotilla import LLM, SamplingParams
    from flotilla.actors import vision_encoder
    from flotilla.server.engine_client import RequestFailed

    monkeypatch.setattr(vision_encoder, "STAGING_TOKENS", 0)  # (the processor's largest image: 16 tokens)
    big = [png(128, 128, seed) for seed in (10, 11, 12)]  # 16 tokens each
    conversations = [[{"role": "user", "content": [image_part(big[0]), image_part(WIDE)]}],
                     [{"role": "user", "content": [image_part(big[1]), {"type": "text", "text": "hi"},
                                                   image_part(big[2])]}],
                     [{"role": "user", "content": [image_part(big[2]), image_part(CAT)]}]]
    images = ([big[0], WIDE], [big[1], big[2]], [big[2], CAT])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(folder), image_encoder="remote", kv_transfer_backend="local", kv_cache_blocks=128, block_size=4,
             max_num_batched_tokens=16) as llm:
        vision = llm.client.runtime.actors["vision_encoder/0"]
        assert vision.space.rows == 16
        outs = llm.chat(conversations, params, use_tqdm=False)
        for out, messages, imgs in zip(outs, conversations, images, strict=True):
            assert out.outputs[0].text == reference(messages, imgs)[0]

        def broken(items):
            raise RuntimeError("the tower fell over")

        monkeypatch.setattr(vision.encoder, "rows", broken)
        with pytest.raises(RequestFailed, match="encoding its images failed: RuntimeError: the tower fell over"):
            llm.chat([{"role": "user", "content": [image_part(png(30, 70, 5))]}], params, use_tqdm=False)
        monkeypatch.undo()
        out, = llm.chat(conversations[0], params, use_tqdm=False)
        assert out.outputs[0].text == reference(conversations[0], images[0])[0]
        encoder = llm.client.runtime.actors["encoder/0"]
        assert not vision._leases and not encoder._wanted and not llm.client.runtime.actors["scheduler/0"]._encoding


def test_a_vision_encoder_of_its_own_is_refused_a_data_plane_it_cannot_read_from(folder):
    from flotilla.config import EngineConfig
    from flotilla.server.engine_client import engine_topology

    for backend in ("torch_dist", "cuda_ipc"):
        with pytest.raises(ValueError, match=f"host memory: kv_transfer_backend must be dlslime_tcp or local, not {backend}"):
            EngineConfig.from_options(model=str(folder), image_encoder="remote", kv_transfer_backend=backend)
    config = EngineConfig.from_options(model=str(folder), image_encoder="remote", kv_transfer_backend="local")
    with pytest.raises(ValueError, match="needs every actor in one process"):
        engine_topology(config, placement="process")
    topo = engine_topology(config, placement="inline")
    assert topo.spec("vision_encoder").process == "" and topo.spec("encoder").config["vision_encoder"]


@pytest.mark.slow
@needs("dlslime", "the KV data plane's TCP transport (and Debian's libibverbs1)")
def test_encoder_prefill_decode_engines_answer_as_transformers_and_a_503_follows_the_encoders_death(folder, reference):
    """EPD: an engine of role encoder (the vision tower alone), registered as such; the router names it for each
    request with images, the prefill engine's encoder actor reads the embeddings from it over dlslime, the decode
    engine pulls the KV; text requests pass the encoder by. Once the encoder engine is killed a request with images
    gets a 503 saying why (routed to it before the front end saw it die, or to no encoder at all), and text requests
    are served on."""
    import os
    import re
    import signal

    srv = start_server(str(folder), "--engines", "encoder,prefill,decode", "--kv-transfer-backend", "dlslime_tcp",
                       "--kv-transfer-timeout-s", "3", "--block-size", "4", "--kv-cache-blocks", "256",
                       "--max-model-len", "256", "--served-model-name", "m", timeout=300)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        text = [{"role": "user", "content": "no image at all"}]
        for messages, images in (([{"role": "user", "content": [image_part(DOG), {"type": "text", "text": "and"},
                                                                 image_part(WIDE)]}], [DOG, WIDE]),
                                 ([{"role": "user", "content": [image_part(CAT)]}], [CAT]), (text, [])):
            assert ask(client, messages, stream=True)[0] == reference(messages, images)[0]
        log = "".join(srv.log)
        assert "engine encoder-0 (encoder) registered" in log and sum("(Qwen3VLVisionTower" in line for line in
                                                                       srv.log) == 1, log[-3000:]
        metrics = httpx.get(srv.url + "/metrics").text
        routed = {line.split('engine="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in
                  metrics.splitlines() if line.startswith("flotilla_engine_requests_routed_total{")}
        assert routed.get("encoder-0") == 2 and routed.get("prefill-0") == 3, metrics
        pid, = (int(m[1]) for line in srv.log if (m := re.search(r"engine encoder-0 \(encoder\) registered: "
                                                                  r"vision_encoder/0=pid:(\d+)", line)))
        os.kill(pid, signal.SIGKILL)
        for _ in range(2):
            with pytest.raises(openai.APIStatusError) as failed:
                ask(client, [{"role": "user", "content": [image_part(png(30, 70, 6))]}])
            assert failed.value.status_code == 503 and "vision encoder" in failed.value.message
        assert ask(client, text).choices[0].message.content == reference(text, [])[0]
    finally:
        srv.stop()


def test_a_vision_encoder_that_never_answers_fails_the_request_after_the_data_plane_timeout(folder, monkeypatch):
    from flotilla import LLM, SamplingParams
    from flotilla.server.engine_client import RequestFailed

    params = SamplingParams(max_tokens=2, temperature=0.0)
    with LLM(str(folder), image_encoder="remote", kv_transfer_backend="local", kv_transfer_timeout_s=1.0,
             kv_cache_blocks=128, block_size=4) as llm:
        vision = llm.client.runtime.actors["vision_encoder/0"]

        async def lost(req):
            pass

        monkeypatch.setattr(vision, "on_embed_images_request", lost)
        with pytest.raises(RequestFailed, match="did not answer in 1 s") as failed:
            llm.chat([{"role": "user", "content": [image_part(CAT)]}], params, use_tqdm=False)
        assert failed.value.status == 503
        assert not llm.client.runtime.actors["encoder/0"]._wanted
