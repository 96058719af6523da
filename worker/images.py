"""Images as requests send them: decoded, checked and identified, the same way on the router
and on the worker. Imports no torch (the router imports it).

An image arrives as the bytes of a PNG, JPEG or WebP file (gRPC `images`, an OpenAI data URL,
an Anthropic base64 block). `check_image` refuses, with an `InvalidRequest` naming the part:
bytes that are no image of those formats, a file whose header promises more pixels than the
operator allows (checked before any pixel is decoded: a decompression bomb costs nothing), a
truncated or corrupt file (it is decoded in full), an animation, a file over the byte limit.
An accepted image's identity is the first 128 bits of the SHA-256 of its bytes (seed 000): the
same file is the same image on every worker and the router; two files differ in identity even
when their sizes are equal.
"""

from __future__ import annotations

import hashlib
import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from worker.errors import InvalidRequest

FORMATS = ("PNG", "JPEG", "WEBP")
"""What Pillow must recognise the bytes as; anything else is refused by its format's name."""
DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_MAX_IMAGE_BYTES = 16 << 20


@dataclass(frozen=True)
class ImageLimits:
    """What the operator allows one request (config `engine.max_images`, ...)."""

    max_images: int = DEFAULT_MAX_IMAGES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Width x height of one image, read from its header before decoding."""
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    """Size of one image's file."""

    def __post_init__(self) -> None:
        for name in ("max_images", "max_pixels", "max_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"ImageLimits.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class CheckedImage:
    """An accepted image: its pixels as 8-bit RGB and its identity."""

    rgb: Image.Image
    content_hash: int
    """First 128 bits of SHA-256 of the file's bytes, big-endian, as an int."""
    format: str

    @property
    def width(self) -> int:
        return int(self.rgb.width)

    @property
    def height(self) -> int:
        return int(self.rgb.height)


def content_hash(data: bytes) -> int:
    """The image identity of seed 000: the first 128 bits of SHA-256 of the bytes."""
    return int.from_bytes(hashlib.sha256(data).digest()[:16], "big")


def check_image(data: bytes, field: str, limits: ImageLimits) -> CheckedImage:
    """Decode and check one image; raises InvalidRequest(field, why) for anything refused."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise InvalidRequest(field, f"expected the image file's bytes, got {type(data).__name__}")
    data = bytes(data)
    if not data:
        raise InvalidRequest(field, "empty: expected a PNG, JPEG or WebP file")
    if len(data) > limits.max_bytes:
        raise InvalidRequest(
            field, f"the image file is {len(data)} bytes; at most {limits.max_bytes} are allowed"
        )
    with warnings.catch_warnings():  # Pillow's own bomb warning: our limit is checked below
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=None)
        except UnidentifiedImageError:
            raise InvalidRequest(field, "not an image: expected a PNG, JPEG or WebP file") from None
        except (OSError, ValueError, Image.DecompressionBombError) as err:
            raise InvalidRequest(field, f"unreadable image: {err}") from None
        with image:
            fmt = image.format or "unknown"
            if fmt not in FORMATS:
                raise InvalidRequest(
                    field, f"{fmt} images are not accepted; send PNG, JPEG or WebP"
                )
            width, height = image.size
            if width < 1 or height < 1:
                raise InvalidRequest(field, f"the image is {width}x{height} pixels")
            if width * height > limits.max_pixels:
                raise InvalidRequest(
                    field,
                    f"the image is {width}x{height} = {width * height} pixels; at most "
                    f"{limits.max_pixels} are allowed",
                )
            frames = int(getattr(image, "n_frames", 1))
            if frames > 1:
                raise InvalidRequest(
                    field, f"an animated {fmt} ({frames} frames); send a still image"
                )
            try:
                image.load()
                rgb = image.convert("RGB")
            except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
                raise InvalidRequest(field, f"truncated or corrupt {fmt} file: {err}") from None
    return CheckedImage(rgb, content_hash(data), fmt)


def check_images(images: Sequence[bytes], field: str, limits: ImageLimits) -> list[CheckedImage]:
    """Check every image of a request (`field[i]` names the i-th); refuses more than allowed
    before decoding any."""
    if len(images) > limits.max_images:
        raise InvalidRequest(
            field, f"{len(images)} images; at most {limits.max_images} are allowed per request"
        )
    return [check_image(data, f"{field}[{i}]", limits) for i, data in enumerate(images)]
