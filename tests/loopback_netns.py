"""A private network namespace with nothing in it but its loopback, for a process tree that
listens on every interface and cannot be told otherwise.

torchrun's agent is one: it hosts its rendezvous store and the ranks' TCPStore on the wildcard
address (torch's TCPStore binds every interface whatever host it is given, libuv or not).
Inside such a namespace "every interface" is a loopback no other namespace reaches. Named
dinf-lo-PID-N, so that a leftover is easy to find; needs root, and skips the test without it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
from collections.abc import Iterator

import pytest
from netns_utils import PREFIX, ip, netns_pids

_made = itertools.count()


@contextlib.contextmanager
def loopback_netns() -> Iterator[str]:
    """Yields the namespace's name (run a command in it with `ip netns exec NAME ...`, open a
    socket in it with netns_utils.in_netns). On exit every process still inside is killed and
    the namespace deleted."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2: torchrun listens on every interface, so it runs in a "
                    "private network namespace")
    name = f"{PREFIX}lo-{os.getpid()}-{next(_made)}"
    ip("netns", "add", name)
    try:
        ip("-n", name, "link", "set", "lo", "up")
        yield name
    finally:
        for pid in netns_pids(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ip("netns", "del", name, check=False)
