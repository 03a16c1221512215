"""One DP rank of a group whose servers were started separately (hybrid and external modes,
docs/lb_modes.md): a process its node's server spawns, running LLMEngine + RankServer.

Global rank 0 serves the group's TCPStore at the configured address and port; every rank
joins the group through it (waiting for peers that start later), and the ranks exchange their
data-plane addresses over the group itself (all_gather_json), so that each node's router can
wake the other nodes' ranks for a wave. The rank then reports to its server through the pipe
and serves until its router says Shutdown. It dies with the server that spawned it
(PR_SET_PDEATHSIG): a rank is never left behind without its endpoint.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

from deepinfer_dp.cluster.data_plane import ClusterKey
from deepinfer_dp.config import EngineConfig

logger = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class LBRankSpec:
    config: EngineConfig  # dp_size and dp_rank set: the group's size, this rank's global rank
    store_host: str  # where rank 0 serves the group's store
    store_port: int
    router_backend: str  # this node's router, where the rank sends its outputs
    host: str  # the address the rank's own socket binds
    timeout_s: float  # the lockstep vote's timeout
    join_timeout_s: float  # how long the rank waits for every peer at the store
    key: ClusterKey | None  # the rank role's key (None: data_plane_auth off)


def run_lb_rank(spec: LBRankSpec, conn: Any) -> None:
    """The rank process's body (multiprocessing spawn target). Sends its server one dict:
    {"addresses": every rank's, "vocab_size", "max_model_len", "sampling_defaults"}, or
    {"error": why} when it could not join, then serves until Shutdown."""
    _die_with_parent()
    try:
        server, store = _join(spec, conn)
    except BaseException as e:
        logger.exception("DP rank %d could not join its group", spec.config.dp_rank)
        conn.send({"error": f"DP rank {spec.config.dp_rank}: {type(e).__name__}: {e}"})
        raise SystemExit(1) from None
    conn.close()
    server.serve_or_exit()  # returns after Shutdown, its engine stopped and its group destroyed
    del store  # rank 0: the group's store lived as long as its rank
    logging.shutdown()
    os._exit(0)  # the interpreter's teardown of torch's threads takes seconds and does nothing more


def _join(spec: LBRankSpec, conn: Any):
    from deepinfer_dp.cluster.data_plane import RANK
    from deepinfer_dp.cluster.group_store import GroupStoreServer, join_group
    from deepinfer_dp.cluster.rank import RankServer
    from deepinfer_dp.distributed.groups import all_gather_json, use_interface_of
    from deepinfer_dp.engine.llm_engine import LLMEngine

    rank, config = spec.config.dp_rank, spec.config
    if spec.host not in ("127.0.0.1", "localhost"):  # across nodes: Gloo listens where the data plane does
        use_interface_of(spec.host)
    engine = LLMEngine(config)  # load first: the join timeout should not count it
    # rank 0 serves the store with the rank role's key: no router here holds the whole group's
    store = GroupStoreServer(spec.store_host, spec.key, RANK, port=spec.store_port) if rank == 0 else None
    server = RankServer(engine, rank, spec.router_backend, spec.host, group_timeout_s=spec.timeout_s, key=spec.key)
    groups = join_group(rank, config.dp_size, spec.store_host, spec.store_port, spec.key, RANK, engine.device,
                        spec.timeout_s, spec.join_timeout_s)
    engine.join_dp_group(groups)
    addresses = all_gather_json(groups, server.address)
    conn.send({"addresses": addresses, "vocab_size": engine.vocab_size, "max_model_len": engine.max_model_len,
               "sampling_defaults": engine.input_processor.sampling_defaults})
    return server, store


def _die_with_parent() -> None:
    """SIGKILL this process when the server that spawned it dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        logger.warning("no prctl here: this rank will outlive its server if that one is killed")
