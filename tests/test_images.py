"""Images before the model: data URLs and allowed hosts (server/media.py), each image checked and its placeholder
expanded to the token count the image processor cuts (actors/images.py), refusals that name the part, and prefix-cache
keys that tell images apart (actors/batching.py)."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import json
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from flotilla.actors.batching import image_keys
from flotilla.actors.images import MAX_IMAGE_PIXELS, ImagePrompt
from flotilla.actors.tokenizer import RequestError, RequestTokenizer
from flotilla.sampling_params import SamplingParams
from flotilla.server.media import MediaPolicy, decode_data_url, load_images
from flotilla.server.protocol import ProtocolError, chat_image_urls, chat_messages, parse_chat_request
from flotilla.transport.messages import GenerateRequest, ImageData

IMAGE_TOKEN = 7
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "patch_size": 16, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                "size": {"longest_edge": 128 * 128, "shortest_edge": 32 * 32}}


def png(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def huge_png_header(width: int, height: int) -> bytes:
    """A PNG that claims width x height pixels (a decompression bomb's header; its data is a tiny image's)."""
    data = bytearray(png(4, 4))
    ihdr = bytearray(data[12:29])
    ihdr[4:8], ihdr[8:12] = width.to_bytes(4, "big"), height.to_bytes(4, "big")
    data[12:29] = ihdr
    data[29:33] = zlib.crc32(bytes(ihdr)).to_bytes(4, "big")
    return bytes(data)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("vl")
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl", "image_token_id": IMAGE_TOKEN,
        "vision_config": {"patch_size": 16, "spatial_merge_size": 2}, "text_config": {"vocab_size": 64}}))
    (d / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return d


@pytest.fixture(scope="module")
def prompt(folder) -> ImagePrompt:
    return ImagePrompt(folder)


def test_each_placeholder_becomes_as_many_tokens_as_the_image_processor_cuts_patches(prompt):
    images = [png(100, 60), png(40, 200, seed=1), png(20, 20, seed=2)]
    ids, items = prompt.expand([1, IMAGE_TOKEN, 2, 3, IMAGE_TOKEN, IMAGE_TOKEN, 4],
                               [ImageData(data=d, param=f"p{i}") for i, d in enumerate(images)])
    cut = prompt.processor(images=[Image.open(io.BytesIO(d)) for d in images], return_tensors="np")["image_grid_thw"]
    assert [it.grid for it in items] == [tuple(g) for g in cut.tolist()]
    counts = [int(np.prod(g)) // 4 for g in cut.tolist()]
    assert [it.length for it in items] == counts
    a, b, c = counts
    assert [it.offset for it in items] == [1, 1 + a + 2, 1 + a + 2 + b]
    want = [1] + [IMAGE_TOKEN] * a + [2, 3] + [IMAGE_TOKEN] * (b + c) + [4]
    assert ids.tolist() == want
    assert len({it.hash for it in items}) == 3


def _tokenizer(prompt: ImagePrompt | None, max_images: int = 2) -> RequestTokenizer:
    return RequestTokenizer(None, 4096, [0], vocab_size=64, images=prompt, max_images=max_images)


def _request(images: list[bytes]) -> GenerateRequest:
    ids = np.asarray([1] + [IMAGE_TOKEN] * len(images) + [2], dtype=np.int32)
    return GenerateRequest(rid="r", sampling=SamplingParams(max_tokens=4), prompt_token_ids=ids,
                           images=[ImageData(data=d, param=f"messages[0].content[{i}]") for i, d in enumerate(images)])


BAD_IMAGES = {
    "not an image": b"hello, not an image at all",
    "empty": b"",
    "truncated": png(64, 64)[:200],
    "corrupt": png(64, 64)[:40] + bytes(200) + png(64, 64)[240:],
    "too many pixels": huge_png_header(20000, 20000),
    "aspect beyond 200:1": png(402, 2),
}


@pytest.mark.parametrize("kind", list(BAD_IMAGES))
def test_an_image_that_cannot_be_used_is_refused_naming_its_part(prompt, kind):
    with pytest.raises(RequestError) as e:
        _tokenizer(prompt).tokenize(_request([png(32, 32), BAD_IMAGES[kind]]))
    assert e.value.param == "messages[0].content[1]" and e.value.status == 400
    assert "'messages[0].content[1]'" in str(e.value)


def test_too_many_images_and_a_model_without_images_are_refused(prompt):
    with pytest.raises(RequestError, match="at most 2 images") as e:
        _tokenizer(prompt).tokenize(_request([png(32, 32, seed=i) for i in range(3)]))
    assert e.value.param == "messages[0].content[2]"
    with pytest.raises(RequestError, match="does not take images"):
        _tokenizer(None).tokenize(_request([png(32, 32)]))
    req = _request([png(32, 32)])
    req.prompt_token_ids = np.asarray([1, 2], dtype=np.int32)  # (a template that placed no image)
    with pytest.raises(RequestError, match="placed 0 image placeholders for 1 images"):
        _tokenizer(prompt).tokenize(req)


def test_image_tokens_count_toward_the_context_limit(prompt):
    small = RequestTokenizer(None, 20, [0], vocab_size=64, images=prompt, max_images=2)
    with pytest.raises(RequestError, match="maximum context length") as e:
        small.tokenize(_request([png(128, 128)]))  # 16 x 16 patches: 64 tokens
    assert e.value.code == "context_length_exceeded"
    assert MAX_IMAGE_PIXELS >= 8192 * 8192


def test_prefix_cache_keys_differ_where_the_images_do_and_equal_text_where_there_is_none(prompt):
    one, two = png(64, 64, seed=1), png(64, 64, seed=2)
    ids, a = prompt.expand([1, 2, IMAGE_TOKEN, 3], [ImageData(data=one)])
    _, b = prompt.expand([1, 2, IMAGE_TOKEN, 3], [ImageData(data=two)])
    _, again = prompt.expand([1, 2, IMAGE_TOKEN, 3], [ImageData(data=one)])
    ka, kb, kagain = image_keys(ids, a), image_keys(ids, b), image_keys(ids, again)
    assert ka[:2].tolist() == [1, 2] and ka[-1] == 3  # text keys itself: a shared text prefix still hits
    run = slice(a[0].offset, a[0].offset + a[0].length)
    assert (ka[run] < 0).all() and (ka[run] != kb[run]).all()
    assert np.array_equal(ka, kagain)
    assert image_keys(ids, []) is None


# ---- the front end -----------------------------------------------------------------------------------------------


def test_image_url_parts_reach_the_template_as_image_parts_in_order():
    body = {"model": "m", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "compare"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                     {"type": "image_url", "image_url": {"url": "https://x.test/a.png",
                                                                         "detail": "low"}}]}]}
    req = parse_chat_request(json.dumps(body))
    assert chat_messages(req)[1]["content"] == [{"type": "text", "text": "compare"}, {"type": "image"},
                                                {"type": "image"}]
    assert chat_messages(req)[0]["content"] == "be brief"
    assert chat_image_urls(req) == [("messages[1].content[1]", "data:image/png;base64,AAAA"),
                                    ("messages[1].content[2]", "https://x.test/a.png")]
    body["messages"][1]["content"][1] = {"type": "image_url"}
    with pytest.raises(ProtocolError) as e:
        parse_chat_request(json.dumps(body))
    assert e.value.status == 400 and e.value.param == "messages[1].content[1].image_url"


@pytest.mark.parametrize(("url", "status", "says"), [
    ("data:image/png;base64,@@@@", 400, "does not decode"),
    ("data:text/plain;base64,aGk=", 400, "not an image type"),
    ("data:image/png,rawbytes", 400, "only base64"),
    ("data:image/png;base64", 400, "not a data URL"),
    ("file:///etc/passwd", 400, "must be a data: URL"),
    ("http://127.0.0.1:1/a.png", 400, "data URLs only"),
])
def test_an_image_url_that_cannot_be_loaded_is_a_clear_error(url, status, says):
    with pytest.raises(ProtocolError) as e:
        asyncio.run(load_images([("messages[0].content[0]", url)], MediaPolicy()))
    assert e.value.status == status and e.value.param == "messages[0].content[0]" and says in str(e.value)


def test_a_data_url_larger_than_the_limit_is_a_413():
    with pytest.raises(ProtocolError) as e:
        decode_data_url(data_url(bytes(4096)), "p", max_bytes=1024)
    assert e.value.status == 413


class _Images(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/cat.png":
            body = png(32, 32, seed=5)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        elif self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/")
            self.end_headers()
        else:
            self.send_response(404)
            self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_http_images_come_only_from_allowed_hosts_within_the_limits():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        allowed = MediaPolicy(allowed_domains=("127.0.0.1",))
        got = asyncio.run(load_images([("p", f"{base}/cat.png")], allowed))
        assert got[0].data == png(32, 32, seed=5) and got[0].param == "p"
        cases = [(MediaPolicy(allowed_domains=("example.com",)), "/cat.png", 400, "not allowed"),
                 (allowed, "/missing.png", 400, "HTTP 404"),
                 (allowed, "/moved", 400, "HTTP 302"),  # a redirect is not followed off the allowed hosts
                 (MediaPolicy(allowed_domains=("127.0.0.1",), max_bytes=100), "/cat.png", 413, "larger than")]
        for policy, path, status, says in cases:
            with pytest.raises(ProtocolError) as e:
                asyncio.run(load_images([("p", base + path)], policy))
            assert e.value.status == status and says in str(e.value), (path, str(e.value))
    finally:
        server.shutdown()
        server.server_close()
