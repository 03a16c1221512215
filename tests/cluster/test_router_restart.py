"""The router is no single point of failure: `serve --dp-size 2` with 50 streams in flight,
SIGKILL of the router process. The standby router takes over on the same ports, the ranks and
the API server reconnect, and new requests are served again within 10 s of the death (the feature's
deadline); every stream ends, complete and equal to the offline result or with an error
event, none hangs."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import psutil  # noqa: E402
import pytest  # noqa: E402
from serve_process import Stream, descendants, live_descendants, serve_process, still_running, stream_completion  # noqa: E402
from server_utils import ENGINE_OPTIONS  # noqa: E402

from deepinfer_dp.entrypoints.llm import LLM  # noqa: E402
from deepinfer_dp.sampling_params import SamplingParams  # noqa: E402

PROMPTS = [f"Stream {i} goes on and" for i in range(50)]
MAX_TOKENS = 12  # short: greedy tokens far from near-ties, which prefill batching can flip
SERVING_AGAIN_WITHIN_S = 10.0


def test_router_sigkill_under_streams(tiny_model_dir, tmp_path):
    offline = LLM(str(tiny_model_dir), **ENGINE_OPTIONS)
    expected = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    offline.shutdown()
    with serve_process(str(tiny_model_dir), tmp_path / "serve.log") as (proc, url):
        router = min(_routers(proc.pid), key=lambda p: p.create_time())  # the standby came after it
        ranks_and_spare = {p.pid for p in _ranks(proc.pid)}
        results = [Stream() for _ in PROMPTS]
        threads = [threading.Thread(target=stream_completion, args=(url, p, MAX_TOKENS, r), daemon=True)
                   for p, r in zip(PROMPTS, results, strict=True)]
        for t in threads:
            t.start()
        while not any(r.first_chunk for r in results):
            time.sleep(0.01)
        router.kill()
        killed = time.monotonic()
        served_after = _first_success(url, killed)
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a stream hangs"
        assert served_after < SERVING_AGAIN_WITHIN_S, (served_after, (tmp_path / "serve.log").read_text()[-3000:])
        for prompt, want, got in zip(PROMPTS, expected, results, strict=True):
            assert got.done, (prompt, got)
            if got.error is None:
                assert got.text == want and got.finish_reason in ("length", "stop"), (prompt, got, want)
            else:  # a clean error naming the cause, after the right tokens so far
                assert "router" in got.error and want.startswith(got.text), (prompt, got)
        assert any(r.error for r in results), "no stream was in flight when the router died"
        assert router.pid not in [p.pid for p in _routers(proc.pid)]
        assert proc.poll() is None
        # the warm spare went with the router that started it (Ray ends an actor with its owner);
        # the new router starts another, so that the next dead rank is not a cold start
        _wait_for(lambda: {p.pid for p in _ranks(proc.pid)} - ranks_and_spare, "a new warm spare", timeout_s=120)


@pytest.mark.slow
def test_router_sigkill_while_a_rank_restarts_leaves_no_half_started_rank(tiny_model_dir, tmp_path):
    """A rank killed, then the router killed while the rank's replacement is still starting (no
    spare: a new process imports torch and loads, seconds). The replacement belongs to the
    dead router and goes with it; the new router starts rank 1 again; the group is back at full
    size with exactly two rank processes, and the stop leaves nothing behind."""
    log = tmp_path / "serve.log"
    with serve_process(str(tiny_model_dir), log, "--no-router-spare-rank") as (proc, url):
        first = _ranks(proc.pid)
        assert len(first) == 2, first
        first[1].kill()
        half_started = _wait_for(lambda: [p for p in _ranks(proc.pid) if p.pid != first[0].pid], "a replacement")[0]
        router = min(_routers(proc.pid), key=lambda p: p.create_time())
        router.kill()
        _wait_for(lambda: _all_up(url), "both ranks up again")
        # the new router found the rank not serving: the router died while it was starting
        assert re.search(r"ranks up: \[(True, False|False, True)\]", log.read_text()), log.read_text()[-3000:]
        seen = descendants(proc.pid)
        assert not half_started.is_running() or half_started.status() == psutil.STATUS_ZOMBIE, log.read_text()[-3000:]
        assert len(_ranks(proc.pid)) == 2, (_ranks(proc.pid), log.read_text()[-3000:])
        assert _first_success(url, time.monotonic()) < 60
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        _wait_for(lambda: not still_running(seen), "every process gone", timeout_s=10)


def _ranks(pid: int) -> list:
    """The rank processes, the ones still starting included."""
    return live_descendants(pid, "RankActor")


def _all_up(url: str) -> bool:
    with contextlib.suppress(httpx.TransportError):
        ranks = httpx.get(url + "/health", timeout=10).json()["ranks"]
        return len(ranks) == 2 and all(r["up"] for r in ranks)
    return False


def _wait_for(check, what: str, timeout_s: float = 240.0):
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return got


def _routers(pid: int) -> list:
    """The router processes: the one serving and its standby."""
    return live_descendants(pid, "RouterActor")


def _first_success(url: str, since: float) -> float:
    """Seconds from `since` to the first request answered 200 (each try gets a short timeout:
    one sent while the router was down may be failed, never left waiting)."""
    body = {"model": "tiny", "prompt": "again", "max_tokens": 2, "temperature": 0}
    while time.monotonic() - since < 60:
        try:
            if httpx.post(url + "/v1/completions", json=body, timeout=15).status_code == 200:
                return time.monotonic() - since
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("no request was served within 60 s of the router's death")
