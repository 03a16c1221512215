"""One server's share of a DP group started separately on each node: vLLM's hybrid and external
load-balancing modes (docs/lb_modes.md).

Each `deepinfer-dp serve` of the group runs the ranks `local` (its node's, or its one rank in
external mode) as processes of its own (cluster/lb_rank.py) and a Router in this process that
routes only to them. All ranks of all servers form one lockstep group through the store that
global rank 0 serves; every router also holds a socket to the other servers' ranks and wakes
them for its waves (cluster/waves.py), so a wave started on one node runs on every rank, with
placeholder steps where a rank has nothing. Each router sees its own ranks' steps and waves,
and its wave index stays the group's: every rank takes part in every wave.

A group of separately started processes cannot re-form without its missing members: when a
local rank dies or a vote fails (a peer elsewhere died), the server stops with status 1 so
that its supervisor restarts it (cluster/fixed_group.py); the restarted servers meet again at
rank 0's store.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import time
from pathlib import Path

from deepinfer_dp.cluster.data_plane import CLIENT, RANK, ClusterKey, role_key
from deepinfer_dp.cluster.deployment import connect
from deepinfer_dp.cluster.fixed_group import FixedGroupMembership
from deepinfer_dp.cluster.lb_rank import LBRankSpec, run_lb_rank
from deepinfer_dp.cluster.router import Router
from deepinfer_dp.cluster.router_client import RouterClient
from deepinfer_dp.config import EngineConfig
from deepinfer_dp.config_file import DataParallelSection, DPSettings
from deepinfer_dp.distributed.groups import JOIN_TIMEOUT_S

logger = logging.getLogger(__name__)
STOP_S = 4.0  # the ranks' exit after Shutdown, before they are killed


class LBNode:
    """This server's router over its `local` ranks (started here) in a group of dp_size; its
    `client` is the EngineClient to serve. shutdown() stops the ranks; safe to call twice."""

    def __init__(self, config: EngineConfig, settings: DPSettings, dp: DataParallelSection, local: range,
                 model_name: str) -> None:
        self.config = per_local_threads(config, len(local))
        self.local = local
        router = settings.router
        key = group_key(dp.key_file, router.data_plane_auth)
        self.router = Router(router, host=router.data_plane_host, key=key, membership_cls=FixedGroupMembership)
        ctx = mp.get_context("spawn")
        self._procs: dict[int, mp.Process] = {}
        self._closed = False
        conns = {}
        try:
            for rank in local:  # all started before any is waited for: each reports once the whole group joined
                spec = LBRankSpec(config=dataclasses.replace(self.config, dp_rank=rank), store_host=dp.address,
                                  store_port=dp.rpc_port, router_backend=self.router.backend_address,
                                  host=router.data_plane_host, timeout_s=router.collective_timeout_s,
                                  join_timeout_s=JOIN_TIMEOUT_S, key=role_key(key, RANK))
                parent, child = ctx.Pipe(duplex=False)
                self._procs[rank] = ctx.Process(target=run_lb_rank, args=(spec, child), name=f"dp-rank-{rank}",
                                                daemon=True)
                self._procs[rank].start()
                child.close()
                conns[rank] = parent
            infos = [self._wait_ready(rank, conn) for rank, conn in conns.items()]
            self.router.attach_ranks(infos[0]["addresses"], self, local=local)
            self.router.start()
            self.client: RouterClient = connect(self.router.frontend_address, infos[0], self.config, model_name,
                                                router.data_plane_host, role_key(key, CLIENT), list(local))
        except BaseException:
            self.shutdown()
            raise
        self.membership.on_broken = self._broken

    @property
    def membership(self) -> FixedGroupMembership:
        return self.router.membership

    def _wait_ready(self, rank: int, conn) -> dict:
        """The rank's report once the whole group has joined (no time limit here: the rank's
        own join timeout bounds it); its error, or its death, raises."""
        while not conn.poll(0.2):
            if not self._procs[rank].is_alive():
                raise RuntimeError(f"DP rank {rank} exited (status {self._procs[rank].exitcode}) before "
                                   f"joining its group; see its log above")
        info = conn.recv()
        conn.close()
        if "error" in info:
            raise RuntimeError(f"could not join the DP group: {info['error']}")
        return info

    def _broken(self, reason: str) -> None:
        on_fatal = getattr(self.client, "on_fatal", None)
        if on_fatal is not None:
            on_fatal(RuntimeError(reason))

    # ---- Liveness (membership.py): this server's rank processes ------------------------------
    def alive(self, dp_rank: int) -> bool:
        return self._procs[dp_rank].is_alive()

    def kill(self, dp_rank: int) -> None:
        self._procs[dp_rank].kill()

    def restart(self, dp_rank: int) -> str:
        raise RuntimeError("a rank of a separately started group is not restarted on its own")

    def shutdown(self) -> None:
        """The client, the router (Shutdown to the local ranks that are up), then the processes,
        killed if they have not exited within STOP_S."""
        if self._closed:
            return
        self._closed = True
        client = getattr(self, "client", None)
        if client is not None:
            client.close()
        self.router.close()
        # A broken group's ranks wait for a Reform that never comes: nothing to wait for.
        deadline = time.monotonic() + (0.0 if self.membership.broken else STOP_S)
        for rank, proc in self._procs.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive() and not self.membership.broken:
                logger.warning("DP rank %d did not exit %.0fs after Shutdown; killing it", rank, STOP_S)
            if proc.is_alive():
                proc.kill()
                proc.join()


def group_key(key_file: str | None, auth: str) -> ClusterKey | None:
    """The data plane's keys of a separately started group, from the shared secret in
    `key_file` (None: authentication off, which only data_plane_auth: off allows)."""
    if auth == "off":
        return None
    if key_file is None:
        raise ValueError("data_parallel.key_file: the servers of a hybrid or external group authenticate each "
                         "other with a shared secret: give --data-parallel-key-file (the same file on every node), "
                         "or --router-data-plane-auth off (unsafe)")
    try:
        lines = Path(key_file).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"data_parallel.key_file: cannot read {key_file}: {e}") from None
    secret = lines[0].strip().encode() if lines else b""
    if len(secret) < 16:
        raise ValueError(f"data_parallel.key_file: {key_file} must hold a secret of at least 16 characters "
                         f"on its first line (e.g. openssl rand -hex 32 > {key_file})")
    return ClusterKey.from_secret(secret)


def per_local_threads(config: EngineConfig, num_local: int) -> EngineConfig:
    """As per_rank_threads (cluster/deployment.py), over this server's ranks, not the group's:
    the other nodes' ranks do not share this machine's cores."""
    if config.torch_threads is None and config.torch_device().type == "cpu":
        return dataclasses.replace(config, torch_threads=max(1, (os.cpu_count() or 1) // num_local))
    return config
