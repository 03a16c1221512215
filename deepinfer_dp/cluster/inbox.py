"""A process's receiving socket on the data plane: it hands on only messages that decode and
that come from a role allowed to send them.

Every process receives on one PULL socket it binds. A frame that does not decode into one of
the socket's message types (not msgpack, a wrong shape, wrong types) is counted and dropped,
and so is a message whose sender's role (the User-Id the ZAP handler gave its connection,
cluster/data_plane.py) may not send that type (`senders`, protocol.py): a receive loop never
ends because of what a peer sent. The ZAP handler already admits only the roles of `senders`
to the socket; the check per message is the second line, and what keeps it honest if a socket
ever admits two roles.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec
import zmq

from deepinfer_dp.cluster.data_plane import DataPlane

logger = logging.getLogger(__name__)


class Inbox:
    """A PULL socket bound to `host` (`port`, or a random one) for `decoder`'s messages, each
    accepted only from the roles `senders` lists for its type. `dropped` counts what was not
    ("malformed", "unauthorized")."""

    def __init__(self, plane: DataPlane, host: str, decoder: msgspec.msgpack.Decoder,
                 senders: Mapping[type, tuple[str, ...]], name: str, port: int = 0, **options: int) -> None:
        admit = tuple(sorted({role for roles in senders.values() for role in roles}))
        self.socket = plane.bound(zmq.PULL, host, admit, port=port, **options)
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.dropped = {"malformed": 0, "unauthorized": 0}
        self._decoder, self._senders, self._name = decoder, senders, name
        self._check_sender = plane.authenticated

    def recv(self, flags: int = 0) -> tuple[Any, bytes] | None:
        """The next message and its bytes, or None for a frame that was dropped. Raises
        zmq.Again under zmq.NOBLOCK when nothing is waiting."""
        frame = self.socket.recv(flags, copy=False)
        raw = frame.bytes
        try:
            msg = self._decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return self._drop("malformed", f"{len(raw)} bytes that do not decode ({e})")
        if self._check_sender:
            sender = frame.get("User-Id")
            if sender not in self._senders.get(type(msg), ()):
                return self._drop("unauthorized", f"{type(msg).__name__} from {sender or 'an unknown peer'}")
        return msg, raw

    def total_dropped(self) -> int:
        return sum(self.dropped.values())

    def _drop(self, kind: str, what: str) -> None:
        self.dropped[kind] += 1
        n = self.dropped[kind]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a flood cannot flood the log
            logger.warning("%s: dropped %s (%d %s frame(s) so far)", self._name, what, n, kind)
        return None

    def close(self, linger: int = 0) -> None:
        self.socket.close(linger=linger)
