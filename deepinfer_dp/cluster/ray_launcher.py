"""Starts DP ranks as Ray actors in a placement group (one bundle per rank) and wires them
to a router. Ray does placement, start-up and liveness; the data plane is ZeroMQ.

address="local" starts a private Ray instance for this driver; address="auto" joins the
cluster started by launch/ray_head.sh (and ray_worker.sh on other nodes).
"""

from __future__ import annotations

import dataclasses
import os
import threading

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deepinfer_dp.config import EngineConfig
from deepinfer_dp.distributed.groups import serve_store

RAY_TEMP_DIR = "/tmp/ray_dp"
START_TIMEOUT_S = 600.0  # model load on every rank, GGUF conversion on a cold cache included


class RankActor:
    """One DP rank inside a Ray actor: LLMEngine + RankServer on a background thread, so the
    actor still answers ping() while the rank blocks on its socket."""

    def __init__(self, config: dict, dp_rank: int, world_size: int) -> None:
        self.config = EngineConfig(**config)
        self.dp_rank = dp_rank
        self.world_size = world_size
        self._thread: threading.Thread | None = None

    def start(self, store_host: str, store_port: int, router_addr: str, timeout_s: float, host: str) -> dict:
        from deepinfer_dp.cluster.rank import RankServer
        from deepinfer_dp.distributed import init_dp_groups
        from deepinfer_dp.distributed.cpu_binding import bind_this_process, rank_cpus
        from deepinfer_dp.engine.llm_engine import LLMEngine

        cpus = rank_cpus(self.dp_rank, self.world_size) if self.config.torch_device().type == "cpu" else None
        if cpus is not None:  # before the engine starts its device and OpenMP threads
            bind_this_process(cpus)
        engine = LLMEngine(self.config)  # load first: the group timeout should not count it
        groups = init_dp_groups(self.dp_rank, self.world_size, store_host, store_port,
                                engine.device, timeout_s)
        engine.join_dp_group(groups)
        if host not in ("127.0.0.1", "localhost"):  # multi-node: bind this node's address
            host = ray.util.get_node_ip_address()
        server = RankServer(engine, self.dp_rank, router_addr, host)
        self._thread = threading.Thread(target=server.serve, name=f"dp-rank-{self.dp_rank}", daemon=True)
        self._thread.start()
        return {"address": server.address, "pid": os.getpid(), "vocab_size": engine.vocab_size,
                "max_model_len": engine.max_model_len}

    def ping(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def pid(self) -> int:
        return os.getpid()


def ensure_ray(address: str, num_cpus: int) -> bool:
    """Connects to Ray; returns True if this call started a private local instance."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if address == "local":
        # Ray starts workers at nice 15 by default; ranks are the work itself, not helpers,
        # and a deprioritized rank slows every rank (lockstep).
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(address="local", include_dashboard=False, num_cpus=num_cpus,
                 object_store_memory=100 * 2**20, _temp_dir=RAY_TEMP_DIR, log_to_driver=False)
        return True
    ray.init(address=address)
    return False


class RayRanks:
    """The actors of one DP deployment; implements the router's Liveness."""

    def __init__(self, config: EngineConfig, router, dp_size: int, address: str = "local",
                 strategy: str = "PACK", cpus_per_rank: float = 1.0, timeout_s: float = 30.0) -> None:
        self.owns_ray = ensure_ray(address, max(os.cpu_count() or 1, int(dp_size * cpus_per_rank + 0.999)))
        gpus = 1 if config.torch_device().type == "cuda" else 0
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus} if gpus else {})}
        self.pg = placement_group([dict(bundle) for _ in range(dp_size)], strategy=strategy.upper())
        ray.get(self.pg.ready(), timeout=START_TIMEOUT_S)
        actor_cls = ray.remote(RankActor)
        cfg = dataclasses.asdict(config)
        self.actors = [
            actor_cls.options(num_cpus=cpus_per_rank, num_gpus=gpus, max_restarts=0,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, i))
            .remote({**cfg, "dp_size": dp_size, "dp_rank": i, "device": _rank_device(config)}, i, dp_size)
            for i in range(dp_size)]
        store = serve_store(router.host, timeout_s)  # served here, so ranks need no ordering
        try:
            self.infos = ray.get([a.start.remote(router.host, store.port, router.address, timeout_s,
                                                 router.host) for a in self.actors], timeout=START_TIMEOUT_S)
        except BaseException as e:
            self.shutdown()  # a rank failed to start (bad model path...): leave nothing behind
            cause = getattr(e, "cause", None)  # a RayTaskError carries the rank's own exception
            if isinstance(cause, Exception):
                raise cause from e
            raise
        self._store = store
        router.attach_ranks([info["address"] for info in self.infos], liveness=self)

    def alive(self, dp_rank: int) -> bool:
        try:
            return bool(ray.get(self.actors[dp_rank].ping.remote(), timeout=10))
        except (ray.exceptions.RayError, TimeoutError):
            return False

    def kill(self, dp_rank: int) -> None:
        ray.kill(self.actors[dp_rank], no_restart=True)

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a, no_restart=True)
        remove_placement_group(self.pg)
        if self.owns_ray:
            ray.shutdown()


def _rank_device(config: EngineConfig) -> str:
    # Inside its GPU bundle a rank sees only its own device, as cuda:0.
    return "cuda" if config.torch_device().type == "cuda" else "cpu"
