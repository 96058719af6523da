"""Images in HTTP requests -> the bytes of their files. The server fetches nothing.

    OpenAI      {"type": "image_url", "image_url": {"url": "data:image/png;base64,...",
                                                   "detail": "auto"}}      (detail: ignored)
    Anthropic   {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "..."}}

PNG, JPEG (declared `image/jpeg`, or `image/jpg` as clients write it) and WebP only. Refused
with 400 naming the part (`where`): a remote URL (http, https, or an Anthropic "url" / "file"
source: "send the image itself"), a data URL that is not base64 or not of an image type served,
base64 that does not decode, and a declared media type the file's own signature contradicts (a
JPEG sent as image/png). Bytes that are no image at all, a truncated file, a decompression bomb,
too many images: the serving core checks those (worker/images.py) and names the same part.

`image_body_bytes` is what the HTTP body limit allows for images: base64 is 4/3 of the bytes.
"""

from __future__ import annotations

import base64
import binascii
import math
from typing import Any

from cluster.http.errors import HttpError
from cluster.model_vision import ModelVision

MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
"""The media types served, and the format each must be. `image/jpg` is no registered type, but
clients write it (browsers' and Python's guesses from a `.jpg` name differ) and vLLM and SGLang,
which read the bytes whatever the declared type, serve it."""
PART_BYTES = 512
"""An image part's JSON besides its base64 (keys, type, media type, detail): a generous bound."""


def image_body_bytes(vision: ModelVision | None) -> int:
    """The most a request body's images may take, in base64 with their parts (0: text model)."""
    if vision is None:
        return 0
    per_image = 4 * math.ceil(vision.limits.max_bytes / 3) + PART_BYTES
    return vision.limits.max_images * per_image


def openai_image(part: dict[str, Any], where: str) -> bytes:
    """An `image_url` part's file; `where` names the part ("messages[0].content[1]")."""
    where = f"{where}.image_url"
    if set(part) - {"type", "image_url"}:
        raise HttpError.invalid(where, f"unknown keys {sorted(set(part) - {'type', 'image_url'})}")
    image_url = part.get("image_url")
    if isinstance(image_url, str):  # the older shorthand: the URL itself
        image_url = {"url": image_url}
    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
        raise HttpError.invalid(where, 'expected {"url": "data:image/png;base64,..."}')
    if set(image_url) - {"url", "detail"}:
        raise HttpError.invalid(where, f"unknown keys {sorted(set(image_url) - {'url', 'detail'})}")
    return data_url_bytes(image_url["url"], where)


def data_url_bytes(url: str, where: str) -> bytes:
    """The file in a `data:<media type>;base64,<data>` URL."""
    scheme = url.partition(":")[0].lower() if ":" in url else ""
    if scheme in ("http", "https", "ftp", "file", "s3", "gs"):
        raise HttpError.invalid(
            where,
            f"a {scheme} URL: the server fetches nothing; send a data URL "
            "(data:image/png;base64,...)",
        )
    if scheme != "data":
        raise HttpError.invalid(where, "expected a data URL (data:image/png;base64,...)")
    header, comma, data = url[len("data:") :].partition(",")
    if not comma:
        raise HttpError.invalid(where, "a data URL without its ',' before the data")
    media_type, *params = [p.strip() for p in header.split(";")]
    if "base64" not in (p.lower() for p in params):
        raise HttpError.invalid(where, "the data URL must be base64 (data:image/png;base64,...)")
    return base64_image(data, media_type.lower(), where)


def anthropic_image(block: dict[str, Any], where: str) -> bytes:
    """An `image` block's file; `where` names the block ("messages[0].content[1]")."""
    if set(block) - {"type", "source", "cache_control"}:
        unknown = sorted(set(block) - {"type", "source", "cache_control"})
        raise HttpError.invalid(where, f"unknown keys {unknown}")
    where = f"{where}.source"
    source = block.get("source")
    if not isinstance(source, dict):
        raise HttpError.invalid(where, 'expected {"type": "base64", "media_type", "data"}')
    kind = source.get("type")
    if kind in ("url", "file"):
        raise HttpError.invalid(
            where, f"a {kind} source: the server fetches nothing; send the image as base64"
        )
    if kind != "base64" or set(source) - {"type", "media_type", "data"}:
        raise HttpError.invalid(where, 'expected {"type": "base64", "media_type", "data"}')
    media_type, data = source.get("media_type"), source.get("data")
    if not isinstance(media_type, str) or not isinstance(data, str):
        raise HttpError.invalid(where, "media_type and data must be strings")
    return base64_image(data, media_type.lower(), where)


def base64_image(data: str, media_type: str, where: str) -> bytes:
    """Decoded base64 of a file of `media_type`, which its signature must not contradict."""
    expected = MEDIA_TYPES.get(media_type)
    if expected is None:
        raise HttpError.invalid(
            where, f"media type {media_type or '(none)'!r}; send {', '.join(MEDIA_TYPES)}"
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise HttpError.invalid(where, f"the base64 data does not decode ({err})") from None
    sniffed = signature_format(raw)
    if sniffed is not None and sniffed != expected:
        raise HttpError.invalid(where, f"declared {media_type}, but the data is a {sniffed} file")
    return raw


def signature_format(data: bytes) -> str | None:
    """The format the file's first bytes say (None: none of PNG, JPEG, WebP, GIF)."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    return None
