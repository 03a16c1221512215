"""Fetching and decoding one image: a PIL image, raw bytes, a data URL, an http(s) URL or a
local file (only under the allowed folder). Runs on the image worker's threads, never on the
step loop or an HTTP event loop. Every failure is a MediaError saying what was wrong."""

from __future__ import annotations

import base64
import binascii
import io
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError


class MediaError(ValueError):
    """An image that could not be fetched, decoded or processed."""


@dataclass(frozen=True)
class MediaLimits:
    fetch_timeout_s: float = 10.0  # whole fetch of an http(s) image, connect to last byte
    max_image_bytes: int = 20 * 2**20  # encoded size, any source
    max_image_pixels: int = 64 * 2**20  # decoded width x height (a decompression bomb stops here)
    allowed_local_media_path: str | None = None  # local files only under this folder; None: none


def load_image(source: object, limits: MediaLimits) -> Image.Image:
    """An RGB PIL image from `source` (PIL image, bytes, or a URL string)."""
    if isinstance(source, Image.Image):
        return _checked(source, limits).convert("RGB")
    if isinstance(source, (bytes, bytearray)):
        return decode_image(bytes(source), limits)
    if not isinstance(source, str):
        raise MediaError(f"an image must be a PIL image, bytes or a URL string, got {type(source).__name__}")
    return decode_image(fetch_bytes(source, limits), limits)


def url_scheme(url: str) -> str:
    """"data", "http", "https" or "file"; MediaError for any other."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme not in ("data", "http", "https", "file"):
        raise MediaError(f"unsupported image URL scheme {scheme or url[:16]!r}: use data:, http(s): or file:")
    return scheme


def file_url_path(url: str) -> str:
    return urllib.parse.unquote(urllib.parse.urlparse(url).path)


def allowed_local_path(path: str, limits: MediaLimits) -> Path:
    """The resolved `path`, or MediaError when it is not under the allowed local media folder."""
    if limits.allowed_local_media_path is None:
        raise MediaError("local image files are not allowed (start with --allowed-local-media-path to allow a "
                         "folder)")
    root = Path(limits.allowed_local_media_path).resolve()
    target = Path(path).resolve()
    if not target.is_relative_to(root):
        raise MediaError(f"the file {path!r} is not under the allowed local media path {str(root)!r}")
    return target


def fetch_bytes(url: str, limits: MediaLimits) -> bytes:
    scheme = url_scheme(url)
    if scheme == "data":
        data = _data_url(url)
    elif scheme == "file":
        data = _local_file(file_url_path(url), limits)
    else:
        data = _http(url, limits)
    if len(data) > limits.max_image_bytes:
        raise MediaError(f"the image has {len(data)} bytes, more than the limit of {limits.max_image_bytes}")
    return data


def decode_image(data: bytes, limits: MediaLimits) -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as img:
            _checked(img, limits)
            img.load()
            return img.convert("RGB")
    except UnidentifiedImageError:
        raise MediaError(f"the {len(data)} bytes are not an image Pillow can read") from None
    except (OSError, Image.DecompressionBombError, SyntaxError) as e:
        raise MediaError(f"the image could not be decoded: {e}") from None


def _checked(img: Image.Image, limits: MediaLimits) -> Image.Image:
    width, height = img.size
    if width < 1 or height < 1 or width * height > limits.max_image_pixels:
        raise MediaError(f"the image is {width}x{height} pixels; at most {limits.max_image_pixels} pixels are "
                         "allowed")
    return img


def _data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("a data URL needs a ',' between its header and its data")
    if not header.endswith(";base64"):
        return urllib.parse.unquote_to_bytes(payload)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"the data URL's base64 data is invalid: {e}") from None


def _http(url: str, limits: MediaLimits) -> bytes:
    deadline = time.monotonic() + limits.fetch_timeout_s
    request = urllib.request.Request(url, headers={"User-Agent": "deepinfer-dp"})
    try:
        with urllib.request.urlopen(request, timeout=limits.fetch_timeout_s) as resp:
            length = resp.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > limits.max_image_bytes:
                raise MediaError(f"the image at {url} has {length} bytes, more than the limit of "
                                 f"{limits.max_image_bytes}")
            chunks, size = [], 0
            while chunk := resp.read(65536):
                chunks.append(chunk)
                size += len(chunk)
                if size > limits.max_image_bytes:
                    raise MediaError(f"the image at {url} is larger than the limit of {limits.max_image_bytes} bytes")
                if time.monotonic() > deadline:
                    raise TimeoutError
            return b"".join(chunks)
    except MediaError:
        raise
    except urllib.error.HTTPError as e:
        raise MediaError(f"fetching {url} failed: HTTP {e.code} {e.reason}") from None
    except TimeoutError:
        raise MediaError(f"fetching {url} took longer than {limits.fetch_timeout_s:g} s") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError):
            raise MediaError(f"fetching {url} took longer than {limits.fetch_timeout_s:g} s") from None
        raise MediaError(f"fetching {url} failed: {reason}") from None


def _local_file(path: str, limits: MediaLimits) -> bytes:
    target = allowed_local_path(path, limits)
    try:
        size = target.stat().st_size
        if size > limits.max_image_bytes:
            raise MediaError(f"the file {path!r} has {size} bytes, more than the limit of {limits.max_image_bytes}")
        return target.read_bytes()
    except OSError as e:
        raise MediaError(f"cannot read {path!r}: {e.strerror or e}") from None
