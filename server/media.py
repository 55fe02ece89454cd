"""The images of a chat request, from the URLs of its image_url parts to the bytes the engine decodes.

A ``data:image/...;base64,`` URL is decoded here. An http(s) URL is fetched only from a host the operator allowed
(``--allowed-media-domains``): a server that fetches any URL a client names is an SSRF hole, reaching whatever its
own network reaches. Fetches are bounded in time and size and never follow redirects (a redirect could leave the
allowed hosts). Whether the bytes are an image is the engine's tokenizer's question: it decodes them (Pillow) and
answers a bad one with a 400 naming the part.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from flotilla.server.protocol import ProtocolError
from flotilla.transport.messages import ImageData


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how much of them the front end takes."""

    allowed_domains: tuple[str, ...] = ()
    """Hosts whose http(s) URLs are fetched (a domain also allows its subdomains); empty: data URLs only."""
    fetch_timeout_s: float = 5.0
    """How long one fetch may take, seconds."""
    max_bytes: int = 32 * 2**20
    """Largest image file taken, bytes."""

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == d or host.endswith("." + d) for d in self.allowed_domains)


def _bad(param: str, message: str) -> ProtocolError:
    return ProtocolError(400, message, param=param, code="invalid_image")


def decode_data_url(url: str, param: str, max_bytes: int) -> bytes:
    """The payload of ``data:image/<type>;base64,<data>``; a 400 naming ``param`` for anything else."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:"):
        raise _bad(param, f"Invalid '{param}': not a data URL.")
    media, *params = head[5:].split(";")
    if not media.lower().startswith("image/"):
        raise _bad(param, f"Invalid '{param}': the data URL's media type {media!r} is not an image type.")
    if "base64" not in params:
        raise _bad(param, f"Invalid '{param}': only base64 data URLs are supported.")
    if len(payload) * 3 // 4 > max_bytes:
        raise ProtocolError(413, f"Invalid '{param}': the image is larger than {max_bytes} bytes.", param=param,
                            code="image_too_large")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(param, f"Invalid '{param}': the data URL's base64 does not decode.") from None


async def fetch_url(client: httpx.AsyncClient, url: str, param: str, policy: MediaPolicy) -> bytes:
    """An allowed http(s) URL's body, within the policy's time and size; a 400 naming ``param`` otherwise."""
    host = urlsplit(url).hostname or ""
    if not policy.allowed_domains:
        raise _bad(param, f"Invalid '{param}': this server takes images as base64 data URLs only; fetching URLs is "
                          "off (the operator allows hosts with --allowed-media-domains).")
    if not policy.allows(host):
        raise _bad(param, f"Invalid '{param}': images from {host or 'this URL'!r} are not allowed here.")
    try:
        async with asyncio.timeout(policy.fetch_timeout_s), client.stream("GET", url) as r:
            if r.status_code != 200:
                raise _bad(param, f"Invalid '{param}': fetching the image answered HTTP {r.status_code}.")
            chunks, size = [], 0
            async for chunk in r.aiter_bytes():
                size += len(chunk)
                if size > policy.max_bytes:
                    raise ProtocolError(413, f"Invalid '{param}': the image is larger than {policy.max_bytes} bytes.",
                                        param=param, code="image_too_large")
                chunks.append(chunk)
            return b"".join(chunks)
    except TimeoutError:
        raise _bad(param, f"Invalid '{param}': fetching the image took longer than {policy.fetch_timeout_s:g} s.") \
            from None
    except httpx.HTTPError as e:
        raise _bad(param, f"Invalid '{param}': the image could not be fetched ({type(e).__name__}).") from None


async def load_images(urls: Sequence[tuple[str, str]], policy: MediaPolicy) -> list[ImageData]:
    """(param, url) pairs in prompt order -> the images' bytes; a ProtocolError names the first bad part."""
    out: list[ImageData] = []
    client: httpx.AsyncClient | None = None
    try:
        for param, url in urls:
            scheme = url.split(":", 1)[0].lower() if ":" in url else ""
            if scheme == "data":
                data = decode_data_url(url, param, policy.max_bytes)
            elif scheme in ("http", "https"):
                client = client or httpx.AsyncClient(follow_redirects=False, timeout=policy.fetch_timeout_s)
                data = await fetch_url(client, url, param, policy)
            else:
                raise _bad(param, f"Invalid '{param}': the image URL must be a data: URL (or an http(s) URL of an "
                                  "allowed host).")
            out.append(ImageData(data=data, param=param))
    finally:
        if client is not None:
            await client.aclose()
    return out
