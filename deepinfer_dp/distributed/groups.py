"""The data-parallel process groups of one rank.

Two groups over the same ranks: the CPU group (Gloo) carries the lockstep vote under ZOS, so
the vote never waits on the device; the device group (NCCL on CUDA, the Gloo group on CPU)
carries collectives on device tensors. Every collective has a timeout, so a dead or stuck
peer turns into an error instead of a hang.

Two ways in: torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or a
TCPStore address handed out by a launcher (Ray). A torch process holds one default group, so
re-forming after a failure means destroy_dp_groups() and init again on a fresh store.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 30.0
# How long a starting rank waits for all its peers to arrive at the store. Separate from
# the collective timeout: a peer still loading its model on a busy machine is not a dead one.
JOIN_TIMEOUT_S = 300.0
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class DPGroups:
    rank: int
    world_size: int
    cpu_group: dist.ProcessGroup
    device_group: dist.ProcessGroup
    device: torch.device  # where tensors for device_group live
    timeout_s: float
    origin: str  # "torchrun" or the store's host:port, for error messages
    store: dist.Store | None = None  # the store the group formed on (kept alive with it)


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world_size) when this process was started by torchrun with more than one rank."""
    if not all(v in os.environ for v in _TORCHRUN_VARS):
        return None
    world = int(os.environ["WORLD_SIZE"])
    return (int(os.environ["RANK"]), world) if world > 1 else None


def init_dp_groups_from_env(device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> DPGroups:
    """Joins the group torchrun describes in the environment (its agent hosts the store).

    Each attempt of an elastic restart (`torchrun --max-restarts`) gets keys of its own in the
    store: the previous attempt's are still there, and a rank that read a dead peer's address
    from them would fail to connect (seen with --standalone)."""
    env = torchrun_env()
    if env is None:
        raise RuntimeError(f"not under torchrun with WORLD_SIZE > 1: need {', '.join(_TORCHRUN_VARS)}")
    rank, world = env
    timeout = timedelta(seconds=timeout_s)
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group("gloo", store=dist.PrefixStore(f"deepinfer_dp/attempt_{attempt}", store),
                            rank=rank, world_size=world, timeout=timeout)
    return _make_groups(rank, world, device, timeout_s, "torchrun")


def init_dp_groups(rank: int, world_size: int, host: str, port: int, device: torch.device,
                   timeout_s: float = DEFAULT_TIMEOUT_S, join_timeout_s: float | None = None) -> DPGroups:
    """Joins a group through the TCPStore at host:port (serve_store: unauthenticated, for
    tests and benchmarks on loopback; the cluster's ranks use join_dp_groups over
    cluster/group_store.py). The store must already be served. `join_timeout_s` (default:
    the collective timeout) bounds the wait for every peer to arrive: at start-up a peer may
    still be loading its model."""
    join_s = timeout_s if join_timeout_s is None else join_timeout_s
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=join_s))
    store.set_timeout(timedelta(seconds=timeout_s))
    return join_dp_groups(rank, world_size, store, f"{host}:{port}", device, timeout_s, join_s)


def join_dp_groups(rank: int, world_size: int, store: dist.Store, origin: str, device: torch.device,
                   timeout_s: float = DEFAULT_TIMEOUT_S, join_timeout_s: float | None = None) -> DPGroups:
    """Joins a group through `store`, already connected (the cluster's authenticated store,
    cluster/group_store.py; `origin` names it in errors). The groups keep the store alive: a
    store written in Python lives as long as its Python object."""
    join_s = timeout_s if join_timeout_s is None else join_timeout_s
    _wait_for_peers(store, world_size, join_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    groups = _make_groups(rank, world_size, device, timeout_s, origin)
    groups.store = store
    return groups


def use_interface_of(address: str) -> str:
    """Makes this process's Gloo groups listen on the interface that holds `address`, and
    returns its name. Gloo otherwise takes the address the machine's hostname resolves to,
    which is often 127.0.0.1 (or, in a network namespace, an address of another stack): its
    peers on other nodes would be told to connect there."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == address for a in addrs):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return name
    raise ValueError(f"no network interface of this machine has the address {address}")


def _wait_for_peers(store: dist.Store, world_size: int, timeout_s: float) -> None:
    """Returns once every rank has reached the store, so that Gloo's rendezvous (bounded by
    the collective timeout) starts with all of them there."""
    arrived = store.add("deepinfer_dp/arrived", 1)
    deadline = time.monotonic() + timeout_s
    while arrived < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {arrived} of {world_size} DP ranks reached the group's store "
                               f"within {timeout_s:.0f}s")
        time.sleep(0.05)
        arrived = store.add("deepinfer_dp/arrived", 0)


def serve_store(host: str = "127.0.0.1", timeout_s: float = DEFAULT_TIMEOUT_S, port: int = 0) -> dist.TCPStore:
    """A TCPStore server on `port` (0: a free one; store.port) of `host` only; keep the object
    alive while ranks join. TCPStore alone would listen on every interface: it is handed a
    socket bound here instead (it owns the descriptor from then on)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    if port:  # a fixed port: the previous run's connections in TIME_WAIT must not block it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    port = sock.getsockname()[1]
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach())


def _make_groups(rank: int, world: int, device: torch.device, timeout_s: float, origin: str) -> DPGroups:
    cpu_group = dist.group.WORLD
    if device.type == "cuda":
        torch.cuda.set_device(device)
        device_group = dist.new_group(backend="nccl", timeout=timedelta(seconds=timeout_s))
    else:
        device = torch.device("cpu")
        device_group = cpu_group  # on CPU both are Gloo: one group is enough
    return DPGroups(rank, world, cpu_group, device_group, device, timeout_s, origin)


def destroy_dp_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_gather_json(groups: DPGroups, obj) -> list:
    """Every rank's `obj` (msgspec-encodable), in rank order. JSON bytes in uint8 tensors over
    the CPU group: no pickle, unlike all_gather_object."""
    data = torch.frombuffer(bytearray(msgspec.json.encode(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    sizes = [torch.zeros_like(size) for _ in range(groups.world_size)]
    dist.all_gather(sizes, size, group=groups.cpu_group)
    width = int(max(s.item() for s in sizes))
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[: data.numel()] = data
    bufs = [torch.zeros(width, dtype=torch.uint8) for _ in range(groups.world_size)]
    dist.all_gather(bufs, padded, group=groups.cpu_group)
    return [msgspec.json.decode(buf[: int(n.item())].numpy().tobytes())
            for buf, n in zip(bufs, sizes, strict=True)]
