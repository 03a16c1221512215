"""Who may speak on the ZeroMQ data plane (clients <-> router <-> ranks).

Every socket uses ZeroMQ CURVE, loopback included: any local process can reach a loopback
port, and one forged Shutdown would stop a rank. At start the deployment makes one key pair
per role (the router, the ranks, the clients: API servers and the offline driver):

  - a binding socket is a CURVE server with its role's secret key, and a ZAP handler in its
    context admits a peer only if the peer's public key is that of a role allowed to send to
    that socket (a rank's inbox: the router; the router's frontend: the clients; its backend:
    the ranks; a client's inbox: the router), and names the peer by that role (the frames'
    User-Id, which cluster/inbox.py checks against each message's type);
  - a connecting socket is a CURVE client with its role's key pair and the server's public key.

CURVE makes a client prove it holds the secret key of the public key it presents, so a
process without a key is dropped at the handshake, and a client (the process that parses
HTTP) cannot send a rank anything at all. CURVE rather than an HMAC on each message: it also
encrypts prompts and outputs and refuses replays of captured messages, and libzmq does it per
connection, not per message in Python.

The keys go to the router and the ranks as Ray actor arguments and to API server processes
through multiprocessing's pipe (only the client's secret: `for_role`), never on a command line
or in the environment. `data_plane_auth: off` turns CURVE off: then any local process can
drive or stop the cluster (unsafe; only for measuring what CURVE costs).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from dataclasses import dataclass, field
from typing import Literal

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

logger = logging.getLogger(__name__)
AuthMode = Literal["auto", "on", "off"]
ROUTER, RANK, CLIENT = "router", "rank", "client"
ROLES = (ROUTER, RANK, CLIENT)
# a peer that does not speak CURVE to the socket's key (plain ZeroMQ, a wrong server key)
FAILED_HANDSHAKE = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


@dataclass(frozen=True)
class ClusterKey:
    """The data plane's CURVE keys (Z85 text, as zmq.curve_keypair makes them): every role's
    public key, and the secret keys of the roles this process may act as."""

    publics: dict[str, bytes]
    secrets: dict[str, bytes] = field(repr=False)  # never in a log line

    @classmethod
    def generate(cls) -> ClusterKey:
        if not zmq.has("curve"):
            raise RuntimeError("data-plane authentication needs libzmq built with CURVE (libsodium)")
        pairs = {role: zmq.curve_keypair() for role in ROLES}
        return cls({r: pub for r, (pub, _) in pairs.items()}, {r: sec for r, (_, sec) in pairs.items()})

    @classmethod
    def from_secret(cls, secret: bytes) -> ClusterKey:
        """Every role's key pair derived from one shared secret (HMAC-SHA256 per role): the
        servers of a group started separately (hybrid and external modes) read the same secret
        from a file and so hold the same keys, with nothing sent between them."""
        if not zmq.has("curve"):
            raise RuntimeError("data-plane authentication needs libzmq built with CURVE (libsodium)")
        secrets = {role: z85.encode(hmac.new(secret, f"deepinfer-dp data plane {role}".encode(),
                                             hashlib.sha256).digest()) for role in ROLES}
        return cls({role: zmq.curve_public(sec) for role, sec in secrets.items()}, secrets)

    def for_role(self, role: str) -> ClusterKey:
        """What a process of `role` is given: its own secret key and the public keys."""
        return ClusterKey(dict(self.publics), {role: self.pair(role)[1]})

    def pair(self, role: str) -> tuple[bytes, bytes]:
        if role not in self.secrets:
            raise ValueError(f"this process does not hold the data plane's {role} key")
        return self.publics[role], self.secrets[role]

    def role_of(self, public: bytes) -> str | None:
        """The role whose public key (Z85) is `public`, compared in constant time; None if none."""
        found = None
        for role, key in self.publics.items():
            if hmac.compare_digest(key, public):
                found = role
        return found


def cluster_key_for(host: str, mode: AuthMode = "auto") -> ClusterKey | None:
    """Fresh keys for a deployment: always, unless `mode` is off (no keys: plain sockets).
    `auto` and `on` are the same since loopback is authenticated too; `host` is kept for the
    callers (the data plane binds it either way)."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"data_plane_auth must be auto, on or off, not {mode!r}")
    return None if mode == "off" else ClusterKey.generate()


def role_key(key: ClusterKey | None, role: str) -> ClusterKey | None:
    """`key` narrowed to what a process of `role` is given (None, no authentication, stays None)."""
    return None if key is None else key.for_role(role)


def host_of(address: str) -> str:
    """The host of a tcp://HOST:PORT address (an IPv6 host keeps its brackets)."""
    return address.removeprefix("tcp://").rsplit(":", 1)[0]


class _ZapHandler:
    """The ZAP handler of one context, on a thread of its own: a CURVE peer is admitted to a
    socket whose ZAP domain lists its role ("rank", "client,router"...), and its frames carry
    the role as their User-Id. A plain poll loop (pyzmq's ThreadAuthenticator runs an asyncio
    poller whose stop() could wait forever, an API server then killed at its exit deadline).
    The same loop reads the bound sockets' monitors: a handshake that fails before ZAP is asked
    (a plain ZeroMQ peer, CURVE without this socket's public key) is counted there."""

    def __init__(self, ctx: zmq.Context, key: ClusterKey, plane: DataPlane) -> None:
        self._key, self._plane = key, plane
        self._sock = ctx.socket(zmq.REP)
        self._sock.linger = 0
        self._sock.bind("inproc://zeromq.zap.01")
        self._new_monitors: list[zmq.Socket] = []  # handed over by bound(), taken by the thread
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="data-plane-zap", daemon=True)
        self._thread.start()

    def watch(self, sock: zmq.Socket) -> None:
        """Counts `sock`'s failed handshakes from now on."""
        monitor = sock.get_monitor_socket(FAILED_HANDSHAKE | zmq.EVENT_MONITOR_STOPPED)
        with self._lock:
            self._new_monitors.append(monitor)

    def _run(self) -> None:
        poller, monitors = zmq.Poller(), []
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            with self._lock:
                new, self._new_monitors = self._new_monitors, []
            for monitor in new:
                poller.register(monitor, zmq.POLLIN)
            monitors += new
            for sock, _ in poller.poll(100):
                if sock is self._sock:
                    self._answer()
                elif self._on_event(sock):  # its socket closed
                    poller.unregister(sock)
                    monitors.remove(sock)
                    sock.close(linger=0)
        for monitor in monitors + self._new_monitors:
            monitor.close(linger=0)

    def _answer(self) -> None:
        msg = self._sock.recv_multipart()
        version, request_id = (msg + [b"", b""])[:2]
        role = self._admit(msg)
        self._sock.send_multipart([version, request_id, b"200" if role else b"400",
                                   b"OK" if role else b"refused", (role or "").encode(), b""])

    def _on_event(self, monitor: zmq.Socket) -> bool:
        """Counts a failed handshake; True once the monitored socket has closed."""
        event = recv_monitor_message(monitor)["event"]
        if event & FAILED_HANDSHAKE:
            self._plane.failed_handshakes += 1
        return event == zmq.EVENT_MONITOR_STOPPED

    def _admit(self, msg: list[bytes]) -> str | None:
        """The peer's role if it may connect to the socket, else None (counted and logged)."""
        domain = msg[2].decode(errors="replace") if len(msg) > 2 else ""
        curve = len(msg) >= 7 and msg[5] == b"CURVE"
        role = self._key.role_of(z85.encode(msg[6])) if curve else None
        if role is not None and role in domain.split(","):
            return role
        self._plane.refused += 1
        if self._plane.refused & (self._plane.refused - 1) == 0:  # 1, 2, 4, 8...: bounded logs
            logger.warning("data plane: refused a peer (%s) on a socket for %s; %d refused so far",
                           f"the {role} key" if role else "no key of this deployment", domain,
                           self._plane.refused)
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()


class DataPlane:
    """A ZeroMQ context whose sockets are CURVE-authenticated as `role` when `key` is set."""

    def __init__(self, key: ClusterKey | None, role: str) -> None:
        self.key, self.role = key, role
        self.ctx = zmq.Context()
        self.refused = 0  # handshakes refused by the ZAP handler
        self.failed_handshakes = 0  # handshakes that failed before it was asked
        self._auth: _ZapHandler | None = None
        if key is not None:
            key.pair(role)  # fails now, not at the first socket, if the role's key is missing
            self._auth = _ZapHandler(self.ctx, key, self)

    @property
    def authenticated(self) -> bool:
        return self.key is not None

    def bound(self, kind: int, host: str, admit: tuple[str, ...], port: int = 0, **options: int) -> zmq.Socket:
        """A socket bound to `port` of `host`, or a random one (its LAST_ENDPOINT is the
        address), that admits peers of the roles in `admit`, with `options` (zmq option name ->
        value) set first."""
        sock = self._socket(kind, options)
        if self._auth is not None:
            sock.zap_domain = ",".join(sorted(admit)).encode()
            sock.curve_server = True
            sock.curve_secretkey = self.key.pair(self.role)[1]
            self._auth.watch(sock)
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            sock.bind_to_random_port(f"tcp://{host}")
        return sock

    def connected(self, kind: int, address: str, server: str, **options: int) -> zmq.Socket:
        """A socket connected to `address`, where a socket of role `server` is bound, with
        `options` set first."""
        sock = self._socket(kind, options)
        if self.key is not None:
            sock.curve_serverkey = self.key.publics[server]
            sock.curve_publickey, sock.curve_secretkey = self.key.pair(self.role)
        sock.connect(address)
        return sock

    def _socket(self, kind: int, options: dict[str, int]) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        for name, value in options.items():
            sock.setsockopt(getattr(zmq, name), value)
        return sock

    def close(self) -> None:
        """Stops the ZAP handler and ends the context (close every socket first)."""
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
