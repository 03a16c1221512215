"""Garbage on every listening socket of `deepinfer-dp serve --dp-size 2`, not only the data
plane's: the HTTP port, the router's and the ranks' ZeroMQ ports, the DP group's store the router
serves, Gloo's listeners, and the private Ray instance's ports (GCS, raylet, object manager,
the agents, every worker's gRPC server) and its Unix sockets (raylet, plasma store). The
test finds them all from the process tree (psutil), as an outsider on the machine could, and
sends each random bytes, a truncated msgpack frame and an HTTP request, while a half-open
connection to each stays open. Streams running through it all come out as in a clean run,
every process stays up and /health stays ok."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import msgspec  # noqa: E402
import psutil  # noqa: E402
from serve_process import Stream, descendants, serve_process, still_running, stream_completion  # noqa: E402

from deepinfer_dp.cluster import protocol as p  # noqa: E402

PROMPTS = [f"Request {i} of the batch goes on" for i in range(6)]
MAX_TOKENS = 48
ACCEPTING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix: a listening Unix socket


def payloads() -> dict[str, bytes]:
    frame = p.encoder.encode(p.AddRequest("intruder", list(range(64)), {"max_tokens": 8}, "intruder"))
    return {
        "random bytes": os.urandom(8192),
        "truncated msgpack": frame[: len(frame) // 2],
        "msgpack of the wrong shape": msgspec.msgpack.encode({"type": "Shutdown", "x": [1] * 100}),
        "an HTTP request": b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
    }


def listening(procs: list[psutil.Process]) -> dict[tuple[int, str | int], str]:
    """(socket family, port or path) -> 'pid name' for every socket these processes listen on."""
    accepting = _listening_unix_paths()
    found = {}
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            who = f"{proc.pid} {proc.name()}"
            for c in proc.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    found[(socket.AF_INET, c.laddr.port)] = who
            for c in proc.net_connections(kind="unix"):
                if c.laddr in accepting:
                    found[(socket.AF_UNIX, c.laddr)] = who
    return found


def _listening_unix_paths() -> set[str]:
    paths = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            fields = line.split()
            if len(fields) == 8 and int(fields[3], 16) & ACCEPTING:
                paths.add(fields[7])
    return paths


def connect(family: int, where: str | int) -> socket.socket:
    if family == socket.AF_UNIX:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(2)
        s.connect(where)
        return s
    return socket.create_connection(("127.0.0.1", where), timeout=2)


def attack(endpoints: list[tuple[int, str | int]]) -> None:
    """Each payload on a connection of its own to every endpoint; a peer that closes at once
    (reset) is a fine answer."""
    for family, where in endpoints:
        for data in payloads().values():
            with contextlib.suppress(OSError), connect(family, where) as s:
                s.sendall(data)
                s.settimeout(0.05)
                with contextlib.suppress(OSError):
                    s.recv(4096)


def half_open(endpoints: list[tuple[int, str | int]]) -> list[socket.socket]:
    """A connection to each endpoint that sends a few bytes of something and then nothing."""
    held = []
    for family, where in endpoints:
        with contextlib.suppress(OSError):
            s = connect(family, where)
            s.sendall(b"\xff\x00\x00")
            held.append(s)
    return held


def run_batch(url: str, during=None) -> list[Stream]:
    results = [Stream() for _ in PROMPTS]
    threads = [threading.Thread(target=stream_completion, args=(url, prompt, MAX_TOKENS, r), daemon=True)
               for prompt, r in zip(PROMPTS, results, strict=True)]
    for t in threads:
        t.start()
    while during is not None and any(t.is_alive() for t in threads):
        during()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a stream hangs"
    return results


def health_ok(url: str) -> bool:
    r = httpx.get(url + "/health", timeout=30)
    return r.status_code == 200 and r.json()["status"] == "ok" and not any(x["restarts"] for x in r.json()["ranks"])


def test_garbage_on_every_listening_socket_changes_nothing(tiny_model_dir, tmp_path):
    log = tmp_path / "serve.log"
    # max_num_seqs 1: each request runs alone on its rank, so its tokens depend only on whether
    # the attack changed anything, not on how the requests happened to be batched.
    with serve_process(str(tiny_model_dir), log, "--max-num-seqs", "1") as (proc, url):
        procs = [psutil.Process(proc.pid), *descendants(proc.pid)]
        found = listening(procs)
        names = " ".join(found.values())
        # the HTTP server, the router and both ranks (their Gloo and store ports among them), Ray's own
        assert all(n in names for n in ("gcs_server", "raylet", "RouterActor", "RankActor")), found
        assert (socket.AF_INET, int(url.rsplit(":", 1)[1])) in found
        endpoints = sorted(found, key=str)
        reference = run_batch(url)
        assert all(r.finish_reason == "length" and r.error is None for r in reference), reference

        held = half_open(endpoints)
        try:
            checks = []
            attacked = run_batch(url, during=lambda: (attack(endpoints), checks.append(health_ok(url))))
            assert checks and all(checks), checks
        finally:
            for s in held:
                s.close()
        assert [(r.text, r.finish_reason, r.error) for r in attacked] == \
               [(r.text, r.finish_reason, r.error) for r in reference], log.read_text()[-3000:]
        time.sleep(1.0)  # a process the attack killed has had time to go
        alive = still_running(procs)
        assert len(alive) == len(procs), (alive, log.read_text()[-3000:])
        assert health_ok(url)
        after = run_batch(url)
        assert [r.text for r in after] == [r.text for r in reference]
