"""A request waiting for its images: it counts as local work (the DP vote), stays out of the
C++ scheduler until ready, and an abort while it waits drops it without a trace."""

from __future__ import annotations

import http.server
import threading
import time

import pytest
from mm_utils import build_tiny_llava, make_image, png_bytes

from deepinfer_dp.config import EngineConfig
from deepinfer_dp.engine.llm_engine import LLMEngine
from deepinfer_dp.multimodal.image_worker import MultiModalPrompt
from deepinfer_dp.sampling_params import SamplingParams

RELEASE = threading.Event()


class _Held(http.server.BaseHTTPRequestHandler):
    body = png_bytes(make_image(80))

    def do_GET(self):  # noqa: N802 - http.server's name
        RELEASE.wait(timeout=30)  # the test decides when the image arrives
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def engine_and_url(tmp_path_factory):
    model = build_tiny_llava(tmp_path_factory.getbasetemp() / "tiny-llava")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Held)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine = LLMEngine(EngineConfig(model=str(model), max_model_len=256))
    yield engine, f"http://127.0.0.1:{server.server_address[1]}/held.png"
    RELEASE.set()
    engine.shutdown()
    server.shutdown()
    server.server_close()


def submit(engine: LLMEngine, url: str) -> str:
    text = "USER: <image>\nwhat is it? ASSISTANT:"
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    return engine.add_checked(engine.tokenizer(text).input_ids, params, mm=MultiModalPrompt(text, [url]))


def test_waiting_request_is_local_work_outside_the_scheduler_until_ready(engine_and_url):
    engine, url = engine_and_url
    RELEASE.clear()
    rid = submit(engine, url)
    engine.step()
    assert engine.has_local_unfinished_requests() and engine.stats()["mm_requests_waiting"] == 1
    assert engine.scheduler.get_sequence(rid) is None  # not scheduled while its image is fetched
    RELEASE.set()
    finished, deadline = False, time.monotonic() + 120
    while not finished and time.monotonic() < deadline:
        finished = any(o.request_id == rid and o.finished for o in engine.step())
    engine.flush_inflight_reqs()
    assert finished and not engine.has_local_unfinished_requests()


def test_abort_while_waiting_for_images(engine_and_url):
    engine, url = engine_and_url
    RELEASE.clear()
    rid = submit(engine, url)
    assert engine.abort_request(rid) == [rid]
    assert not engine.has_local_unfinished_requests() and rid not in engine.requests
    RELEASE.set()
