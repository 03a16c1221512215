"""The DP group's rendezvous store, on the data plane's CURVE (cluster/data_plane.py).

torch's TCPStore authenticates nobody: any peer that reaches its port can list every key
(LIST_KEYS), read the Gloo listeners' addresses, overwrite the rendezvous keys or join the
group. A secret key prefix does not help, since the keys can be listed. So the group's ranks
rendezvous through this store instead: a ZeroMQ ROUTER socket that is a CURVE server with its
server's role key (the router in internal mode, global rank 0 in hybrid and external modes)
and admits only peers holding the rank role's secret key; each rank's side is a `dist.Store`
(GroupStoreClient) whose requests go over one CURVE DEALER socket. A peer without the rank key
fails the handshake and never reaches a key; CURVE also encrypts the traffic and refuses
replays. With `data_plane_auth: off` (no key) the sockets are plain, like the rest.

The server keeps the keys in a dict on one thread: a get or wait of a key not there yet is
answered when it is set, or with a timeout error at its deadline.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist
import zmq

from deepinfer_dp.cluster.data_plane import RANK, ClusterKey, DataPlane
from deepinfer_dp.distributed.groups import DPGroups, join_dp_groups

REPLY_S = 30.0  # how long an answer to a request that does not wait may take
_IDLE_POLL_MS = 100


@dataclass
class _Waiting:
    ident: bytes
    rid: int
    op: str  # get or wait
    keys: list[str]
    deadline: float


class GroupStoreServer:
    """The store, bound on `port` of `host` (0: a free one; `.port`), answering on a thread of
    its own until close(). `role` is the key the server presents (ROUTER or RANK)."""

    def __init__(self, host: str, key: ClusterKey | None, role: str, port: int = 0) -> None:
        self._plane = DataPlane(key, role)
        self._sock = self._plane.bound(zmq.ROUTER, host, admit=(RANK,), port=port, LINGER=0)
        self.port = int(self._sock.LAST_ENDPOINT.decode().rsplit(":", 1)[1])
        self._data: dict[str, bytes] = {}
        self._waiting: list[_Waiting] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="group-store", daemon=True)
        self._thread.start()

    @property
    def failed_handshakes(self) -> int:
        """Peers that failed the CURVE handshake or were refused (no rank key)."""
        return self._plane.failed_handshakes + self._plane.refused

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._sock.poll(self._poll_ms()):
                    ident, payload = self._sock.recv_multipart()[:2]
                    self._handle(ident, payload)
                self._expire()
        finally:
            self._sock.close(linger=0)

    def _poll_ms(self) -> int:
        if not self._waiting:
            return _IDLE_POLL_MS
        left = min(w.deadline for w in self._waiting) - time.monotonic()
        return max(0, min(_IDLE_POLL_MS, int(left * 1000) + 1))

    def _handle(self, ident: bytes, payload: bytes) -> None:
        rid = -1
        try:
            rid, op, *args = msgspec.msgpack.decode(payload)
            result = self._apply(ident, rid, op, args)
        except Exception as e:  # a rank's bad request: it gets the error, the store goes on
            self._reply(ident, rid if isinstance(rid, int) else -1, False, f"{type(e).__name__}: {e}")
            return
        if result is not _PENDING:
            self._reply(ident, rid, True, result)
        self._wake()

    def _apply(self, ident: bytes, rid: int, op: str, args: list):
        data = self._data
        if op == "set":
            data[args[0]] = args[1]
        elif op == "add":
            value = int(data.get(args[0], b"0")) + int(args[1])
            data[args[0]] = str(value).encode()
            return value
        elif op == "compare_set":  # torch's semantics: a missing key matches an empty expected value
            key, expected, desired = args
            current = data.get(key)
            if (current is None and expected == b"") or current == expected:
                data[key] = desired
                return desired
            return expected if current is None else current
        elif op == "check":
            return all(k in data for k in args[0])
        elif op == "delete_key":
            return data.pop(args[0], None) is not None
        elif op == "num_keys":
            return len(data)
        elif op in ("get", "wait"):
            keys = [args[0]] if op == "get" else list(args[0])
            self._waiting.append(_Waiting(ident, rid, op, keys, time.monotonic() + float(args[1])))
            return _PENDING
        elif op != "ping":
            raise ValueError(f"unknown store operation {op!r}")
        return None

    def _wake(self) -> None:
        ready = [w for w in self._waiting if all(k in self._data for k in w.keys)]
        for w in ready:
            self._waiting.remove(w)
            self._reply(w.ident, w.rid, True, self._data[w.keys[0]] if w.op == "get" else None)

    def _expire(self) -> None:
        now = time.monotonic()
        for w in [w for w in self._waiting if w.deadline <= now]:
            self._waiting.remove(w)
            self._reply(w.ident, w.rid, False, f"timeout: {w.keys} not set in the DP group's store in time")

    def _reply(self, ident: bytes, rid: int, ok: bool, value) -> None:
        try:
            self._sock.send_multipart([ident, msgspec.msgpack.encode([rid, ok, value])], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the rank has gone: nobody to answer

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join()
        self._plane.close()


_PENDING = object()


class GroupStoreClient(dist.Store):
    """A rank's side of the store at host:port, whose server presents the `server` role's key;
    this process authenticates with the rank role's key. Waits up to `connect_timeout_s` for
    the server to answer at all (it may start later than this rank), then `timeout_s` (the
    store's timeout) for each get or wait."""

    def __init__(self, host: str, port: int, key: ClusterKey | None, server: str, timeout_s: float,
                 connect_timeout_s: float) -> None:
        super().__init__()
        self.set_timeout(timedelta(seconds=timeout_s))
        self.origin = f"{host}:{port}"
        self._plane = DataPlane(None, RANK)  # connects only: no handshake to check here
        self._sock = self._plane.ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        if key is not None:
            self._sock.curve_serverkey = key.publics[server]
            self._sock.curve_publickey, self._sock.curve_secretkey = key.pair(RANK)
        self._sock.connect(f"tcp://{host}:{port}")
        self._lock = threading.Lock()
        self._rid = 0
        self._call("ping", answer_s=connect_timeout_s)

    def _call(self, op: str, *args, answer_s: float = REPLY_S):
        with self._lock:
            self._rid += 1
            rid = self._rid
            self._sock.send(msgspec.msgpack.encode([rid, op, *args]))
            deadline = time.monotonic() + answer_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self._sock.poll(int(left * 1000) + 1):
                    raise dist.DistStoreError(f"the DP group's store at {self.origin} did not answer {op} within "
                                              f"{answer_s:.0f}s (is it up, and does this rank hold the group's key?)")
                got, ok, value = msgspec.msgpack.decode(self._sock.recv())
                if got != rid:
                    continue  # the late answer to an earlier request that timed out
                if not ok:
                    raise dist.DistStoreError(f"the DP group's store at {self.origin}: {value}")
                return value

    def _wait_s(self, timeout: timedelta | None) -> float:
        return (self.timeout if timeout is None else timeout).total_seconds()

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, _bytes(value))

    def get(self, key: str) -> bytes:
        wait_s = self._wait_s(None)
        return self._call("get", key, wait_s, answer_s=wait_s + REPLY_S)

    def add(self, key: str, value: int) -> int:
        return self._call("add", key, value)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._call("compare_set", key, _bytes(expected), _bytes(desired))

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait_s = self._wait_s(timeout)
        self._call("wait", list(keys), wait_s, answer_s=wait_s + REPLY_S)

    def delete_key(self, key: str) -> bool:
        return self._call("delete_key", key)

    def num_keys(self) -> int:
        return self._call("num_keys")

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
            self._plane.close()

    def __del__(self) -> None:
        self.close()


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def join_group(rank: int, world_size: int, host: str, port: int, key: ClusterKey | None, server: str,
               device: torch.device, timeout_s: float, join_timeout_s: float | None = None) -> DPGroups:
    """init_dp_groups over the store at host:port (served with the `server` role's key),
    authenticated with this rank's `key`."""
    join_s = timeout_s if join_timeout_s is None else join_timeout_s
    client = GroupStoreClient(host, port, key, server, timeout_s, join_s)
    return join_dp_groups(rank, world_size, client, client.origin, device, timeout_s, join_s)
