"""Fetching and decoding images: every source, and a clear error for each way one fails."""

import base64
import http.server
import threading
import time

import pytest
from mm_utils import make_image, png_bytes

from deepinfer_dp.multimodal.media import MediaError, MediaLimits, load_image


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def test_data_url_pil_and_bytes_decode_to_the_same_rgb_image():
    img = make_image(3)
    limits = MediaLimits()
    for source in (img, png_bytes(img), data_url(png_bytes(img))):
        out = load_image(source, limits)
        assert out.mode == "RGB" and out.size == img.size and out.tobytes() == img.tobytes()


@pytest.mark.parametrize("source, message", [
    (data_url(b"not an image at all"), "not an image"),
    ("data:image/png;base64,@@@", "base64"),
    ("ftp://example.com/a.png", "unsupported image URL scheme"),
    ("file:///etc/passwd", "local image files are not allowed"),
    (12, "must be a PIL image"),
])
def test_bad_sources_raise_media_error_naming_the_problem(source, message):
    with pytest.raises(MediaError, match=message):
        load_image(source, MediaLimits())


def test_byte_and_pixel_limits():
    raw = png_bytes(make_image(4, (64, 64)))
    with pytest.raises(MediaError, match="more than the limit"):
        load_image(data_url(raw), MediaLimits(max_image_bytes=len(raw) - 1))
    with pytest.raises(MediaError, match="pixels"):
        load_image(raw, MediaLimits(max_image_pixels=64 * 64 - 1))


def test_local_files_only_under_the_allowed_path(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(png_bytes(make_image(5)))
    (tmp_path / "outside.png").write_bytes(png_bytes(make_image(5)))
    limits = MediaLimits(allowed_local_media_path=str(allowed))
    assert load_image(f"file://{allowed / 'a.png'}", limits).size == (64, 48)
    with pytest.raises(MediaError, match="not under the allowed local media path"):
        load_image(f"file://{tmp_path / 'outside.png'}", limits)
    with pytest.raises(MediaError, match="not under the allowed local media path"):
        load_image(f"file://{allowed}/../outside.png", limits)
    with pytest.raises(MediaError, match="cannot read"):
        load_image(f"file://{allowed / 'missing.png'}", limits)


class _Images(http.server.BaseHTTPRequestHandler):
    body = png_bytes(make_image(6))

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/slow.png":
            time.sleep(2.0)
        if self.path == "/missing.png":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        try:
            self.wfile.write(self.body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_http_fetch_limits_and_errors(image_server):
    assert load_image(f"{image_server}/a.png", MediaLimits()).size == (64, 48)
    with pytest.raises(MediaError, match="HTTP 404"):
        load_image(f"{image_server}/missing.png", MediaLimits())
    with pytest.raises(MediaError, match="more than the limit"):
        load_image(f"{image_server}/a.png", MediaLimits(max_image_bytes=100))
    with pytest.raises(MediaError, match="took longer than 0.3 s"):
        load_image(f"{image_server}/slow.png", MediaLimits(fetch_timeout_s=0.3))


def test_a_front_end_checks_references_without_fetching_them(tmp_path):
    from deepinfer_dp.multimodal.front import check_url

    limits = MediaLimits(max_image_bytes=30, allowed_local_media_path=str(tmp_path))
    check_url("http://127.0.0.1:9/never-fetched.png", limits)  # nothing listens there: not fetched
    check_url(f"file://{tmp_path}/not-yet-there.png", limits)  # under the folder: the rank reads it
    check_url("data:image/png;base64," + "A" * 40, limits)
    for url, message in [("ftp://x/a.png", "unsupported image URL scheme"),
                         ("file:///etc/hostname", "not under the allowed local media path"),
                         ("data:image/png;base64," + "A" * 44, "more than the limit of 30")]:
        with pytest.raises(MediaError, match=message):
            check_url(url, limits)
