"""The images of a chat request, loaded before preprocessing: data URLs decoded, remote URLs
fetched from the allowed domains only, each checked to be a PNG, JPEG, WebP or GIF image.

A request with images needs a model whose engine advertises ``Capability.VISION`` (400 naming
the engine otherwise, before anything is fetched). A remote ``http(s)`` URL is refused (400)
unless its host is one of ``--allowed-media-domains`` (exact host names, no wildcards); an
allowed one is fetched with a short timeout, without redirects or proxies, and must answer 200
with an image. An image may take at most ``--max-image-bytes`` bytes, a request's images
together ``MAX_REQUEST_IMAGE_BYTES``, and a request at most ``MAX_IMAGES`` images.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import os
import re
from dataclasses import dataclass

import httpx

from ..errors import InvalidArgument
from ..llm import Capability
from ._content_parts import image_urls
from .errors import bad_request
from .models import ModelEntry
from .protocol import ChatCompletionRequest

__all__ = [
    "DEFAULT_MAX_IMAGE_BYTES",
    "FETCH_TIMEOUT",
    "MAX_IMAGES",
    "MAX_REQUEST_IMAGE_BYTES",
    "MediaPolicy",
    "add_media_args",
    "image_type",
    "load_images",
    "media_from_args",
]

#: Bytes one image may take (``--max-image-bytes``'s default), decoded or fetched.
DEFAULT_MAX_IMAGE_BYTES = 10 * 1024 * 1024
#: Bytes all the images of one request may take together.
MAX_REQUEST_IMAGE_BYTES = 32 * 1024 * 1024
#: Images one request may hold.
MAX_IMAGES = 16
#: Seconds a remote image's fetch may take in all.
FETCH_TIMEOUT = 10.0
#: The image types taken, by MIME type.
IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),(.*)", re.DOTALL | re.IGNORECASE)


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be."""

    allowed_domains: frozenset[str] = frozenset()
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_request_bytes: int = MAX_REQUEST_IMAGE_BYTES
    fetch_timeout: float = FETCH_TIMEOUT


def image_type(data: bytes) -> str | None:
    """The MIME type of an encoded PNG, JPEG, WebP or GIF image by its magic bytes (None: none
    of them)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    return None


async def load_images(entry: ModelEntry, req: ChatCompletionRequest,
                      policy: MediaPolicy) -> list[bytes]:
    """The request's images in prompt order (none: ``[]``).

    Raises:
        HttpError: 400 when the engine takes no images, or an image is malformed, not an
            image, too large, from a domain not allowed, or could not be fetched.
    """
    urls = image_urls(req.messages)
    if not urls:
        return []
    entry.require(Capability.VISION, urls[0][0].removesuffix(".image_url.url"))
    if entry.vision is None:
        raise bad_request(f"the {entry.engine_name or 'serving'} engine of model "
                          f"'{entry.name}' advertises vision without an image token and count",
                          param="messages")
    if len(urls) > MAX_IMAGES:
        raise bad_request(f"a request may hold at most {MAX_IMAGES} images, got {len(urls)}",
                          param="messages", code="invalid_value")
    images: list[bytes] = []
    total = 0
    for param, url in urls:
        if url[:5].lower() == "data:":
            data = _data_url(url, param, policy.max_image_bytes)
        else:
            data = await _fetch(url, param, policy)
        total += len(data)
        if total > policy.max_request_bytes:
            raise bad_request(f"the request's images take more than "
                              f"{policy.max_request_bytes} bytes", param=param,
                              code="invalid_value")
        images.append(data)
    return images


def _data_url(url: str, param: str, cap: int) -> bytes:
    match = _DATA_URL.fullmatch(url)
    if match is None:
        raise bad_request(f"'{param}' is not a valid data URL", param=param,
                          code="invalid_value")
    mime, params, payload = match.group(1).lower(), match.group(2).lower(), match.group(3)
    if mime not in IMAGE_TYPES:
        raise bad_request(f"'{param}': {mime or 'no MIME type'!r} is not an image type taken "
                          f"({', '.join(IMAGE_TYPES)})", param=param, code="invalid_value")
    if "base64" not in params.split(";"):
        raise bad_request(f"'{param}': the data URL must be base64-encoded (';base64,')",
                          param=param, code="invalid_value")
    if len(payload) > cap * 4 // 3 + 4:
        raise bad_request(f"'{param}': the image is larger than {cap} bytes", param=param,
                          code="invalid_value")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"'{param}': the data URL's base64 is invalid ({exc})",
                          param=param, code="invalid_value") from None
    return _checked(data, param, cap)


def _checked(data: bytes, param: str, cap: int) -> bytes:
    if len(data) > cap:
        raise bad_request(f"'{param}': the image is larger than {cap} bytes", param=param,
                          code="invalid_value")
    if image_type(data) is None:
        raise bad_request(f"'{param}' does not hold a PNG, JPEG, WebP or GIF image",
                          param=param, code="invalid_value")
    return data


async def _fetch(url: str, param: str, policy: MediaPolicy) -> bytes:
    try:  # the host as the client that fetches reads it
        host = httpx.URL(url).host.lower()
    except (httpx.InvalidURL, ValueError):
        raise bad_request(f"'{param}' is not a valid URL", param=param,
                          code="invalid_value") from None
    if host not in policy.allowed_domains:
        raise bad_request(f"'{param}': remote image URLs are refused unless their host is in "
                          f"--allowed-media-domains (host {host!r} is not); send the image as "
                          "a data: URL", param=param, code="invalid_value")
    cap = policy.max_image_bytes
    try:
        async with asyncio.timeout(policy.fetch_timeout), httpx.AsyncClient(
                timeout=policy.fetch_timeout, follow_redirects=False, trust_env=False) as client:
            async with client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise bad_request(f"'{param}': fetching the image failed: HTTP "
                                      f"{resp.status_code}", param=param, code="invalid_value")
                kind = resp.headers.get("content-type", "").split(";")[0].strip().lower()
                if kind and not kind.startswith("image/"):
                    raise bad_request(f"'{param}': the URL holds {kind!r}, not an image",
                                      param=param, code="invalid_value")
                chunks: list[bytes] = []
                size = 0
                async for chunk in resp.aiter_bytes():
                    size += len(chunk)
                    if size > cap:
                        break
                    chunks.append(chunk)
    except (httpx.HTTPError, TimeoutError, ValueError) as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
        raise bad_request(f"'{param}': fetching the image failed: {reason}", param=param,
                          code="invalid_value") from None
    if size > cap:
        raise bad_request(f"'{param}': the image is larger than {cap} bytes", param=param,
                          code="invalid_value")
    return _checked(b"".join(chunks), param, cap)


def add_media_args(parser: argparse.ArgumentParser) -> None:
    """``--allowed-media-domains`` and ``--max-image-bytes`` (with their DYN_* variables)."""
    env = os.environ.get
    parser.add_argument(
        "--allowed-media-domains", nargs="*", metavar="HOST",
        default=_hosts(env("DYN_ALLOWED_MEDIA_DOMAINS", "")),
        help="hosts whose http(s) image URLs the frontend fetches (space- or comma-separated; "
             "default: none, remote image URLs are refused) [DYN_ALLOWED_MEDIA_DOMAINS]",
    )
    parser.add_argument(
        "--max-image-bytes", type=int, metavar="BYTES",
        default=env("DYN_MAX_IMAGE_BYTES", str(DEFAULT_MAX_IMAGE_BYTES)),
        help="largest image a request may send or have fetched [DYN_MAX_IMAGE_BYTES]",
    )


def _hosts(text: str) -> list[str]:
    """Host names in a space- or comma-separated list."""
    return [h for h in re.split(r"[\s,]+", text) if h]


def media_from_args(args: argparse.Namespace) -> MediaPolicy:
    """The policy the flags ask for.

    Raises:
        InvalidArgument: ``--max-image-bytes`` below 1.
    """
    hosts = frozenset(h.lower() for item in args.allowed_media_domains for h in _hosts(item))
    if args.max_image_bytes < 1:
        raise InvalidArgument(f"--max-image-bytes must be >= 1, got {args.max_image_bytes}")
    return MediaPolicy(hosts, args.max_image_bytes,
                       max(MAX_REQUEST_IMAGE_BYTES, args.max_image_bytes))
