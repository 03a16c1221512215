"""Who may speak on the ZeroMQ data plane (clients <-> router <-> ranks).

On one machine (every socket on 127.0.0.1, the default) the sockets are plain TCP: only this
machine's processes can reach them, the same boundary the private Ray instance relies on, and
nothing is spent on encryption. Past one machine (a non-loopback host, or `data_plane_auth:
on`) every socket uses ZeroMQ CURVE with one cluster key pair made at start:

  - a binding socket is a CURVE server with the cluster secret key, and its context runs a
    ZAP handler that admits only clients whose public key is the cluster's;
  - a connecting socket is a CURVE client holding the cluster key pair.

A peer without the secret key cannot finish the handshake (CURVE makes a client prove it holds
the secret key of the public key it presents), so its connection is dropped before any of its
messages reach the router or a rank. CURVE rather than an HMAC on each message: it also
encrypts prompts and outputs on the wire and refuses replays of captured messages (a replayed
Shutdown would stop a rank), and libzmq does it per connection, not per message in Python.

The key pair goes to the ranks and the router as Ray actor arguments and to API server
processes through multiprocessing's pipe: never on a command line or in the environment.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass, field
from typing import Literal

import zmq
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)
AuthMode = Literal["auto", "on", "off"]
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ClusterKey:
    """The cluster's CURVE key pair (Z85 text, as zmq.curve_keypair makes it)."""

    public: bytes
    secret: bytes = field(repr=False)  # never in a log line

    @classmethod
    def generate(cls) -> ClusterKey:
        if not zmq.has("curve"):
            raise RuntimeError("data-plane authentication needs libzmq built with CURVE (libsodium)")
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


def cluster_key_for(host: str, mode: AuthMode = "auto") -> ClusterKey | None:
    """A fresh key pair when the data plane must authenticate peers: `on`, or `auto` with a
    host other than loopback; None (plain sockets) otherwise."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"data_plane_auth must be auto, on or off, not {mode!r}")
    if mode == "off" or (mode == "auto" and host in _LOOPBACK):
        return None
    return ClusterKey.generate()


class _OnlyClusterKey:
    """The ZAP handler's rule: the client's public key must be the cluster's."""

    def __init__(self, public: bytes) -> None:
        self._public = public

    def callback(self, domain: str, client_key: bytes) -> bool:
        allowed = hmac.compare_digest(client_key, self._public)
        if not allowed:
            logger.warning("data plane: refused a peer that does not hold the cluster key")
        return allowed


class DataPlane:
    """A ZeroMQ context whose sockets are CURVE-authenticated when `key` is set."""

    def __init__(self, key: ClusterKey | None) -> None:
        self.key = key
        self.ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        if key is not None:
            self._auth = ThreadAuthenticator(self.ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", _OnlyClusterKey(key.public))

    def bound(self, kind: int, host: str, port: int = 0, **options: int) -> zmq.Socket:
        """A socket bound to `port` of `host`, or a random one (its LAST_ENDPOINT is the
        address), with `options` (zmq option name -> value) set first."""
        sock = self._socket(kind, options)
        if self.key is not None:
            sock.curve_server = True
            sock.curve_secretkey = self.key.secret
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            sock.bind_to_random_port(f"tcp://{host}")
        return sock

    def connected(self, kind: int, address: str, **options: int) -> zmq.Socket:
        """A socket connected to `address`, with `options` set first."""
        sock = self._socket(kind, options)
        if self.key is not None:
            sock.curve_serverkey = self.key.public
            sock.curve_publickey = self.key.public
            sock.curve_secretkey = self.key.secret
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
