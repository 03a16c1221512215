"""A DP rank's process under Ray: RankActor (LLMEngine + RankServer in a Ray actor) and
RankSpec (how to start one: the deployment's first ranks, a restarted one, the warm spare)."""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from deepinfer_dp.cluster.data_plane import ClusterKey
from deepinfer_dp.config import EngineConfig


class RankActor:
    """One DP rank inside a Ray actor: LLMEngine + RankServer on a background thread, so the
    actor still answers ping() while the rank blocks on its socket."""

    def __init__(self, config: dict, dp_rank: int, world_size: int, key: ClusterKey | None = None) -> None:
        self._config = config
        self.config = EngineConfig(**config)
        self.dp_rank = dp_rank
        self.world_size = world_size
        self.key = key  # the data plane's key (an actor argument: not on any command line)
        self._thread: threading.Thread | None = None
        self._server = None  # the RankServer, once serving
        self._info: dict | None = None

    def start(self, store_host: str, store_port: int, router_addr: str, timeout_s: float, host: str) -> dict:
        """Loads the engine, joins the first DP group and serves."""
        from deepinfer_dp.cluster.data_plane import ROUTER
        from deepinfer_dp.cluster.group_store import join_group
        from deepinfer_dp.distributed.groups import JOIN_TIMEOUT_S

        engine = self._load()  # load first: the group timeout should not count it
        host = self._node_host(host)
        groups = join_group(self.dp_rank, self.world_size, store_host, store_port, self.key, ROUTER,
                            engine.device, timeout_s, JOIN_TIMEOUT_S)
        engine.join_dp_group(groups)
        return self._serve(engine, router_addr, timeout_s, host)

    def rejoin(self, router_addr: str, timeout_s: float, host: str) -> dict:
        """A restarted rank: loads the engine and serves with no group; the router's Reform
        (sent when it takes the rank back) makes it join the others'."""
        return self._serve(self._load(), router_addr, timeout_s, host)

    def warm(self) -> int:
        """A spare's work ahead of need: the engine's imports (torch, transformers, the model
        code), which are most of a new rank's start-up; loading the model itself is short.
        Returns the process id."""
        import deepinfer_dp.cluster.rank  # noqa: F401
        import deepinfer_dp.engine.llm_engine  # noqa: F401

        return os.getpid()

    def take_over(self, dp_rank: int, router_addr: str, timeout_s: float, host: str,
                  world_size: int | None = None) -> dict:
        """A warm spare becomes DP rank `dp_rank` of a group of `world_size` (default: the one
        it was made for): a dead rank's place, or a new one of a growing group; rejoin() as it."""
        self.dp_rank, self.world_size = dp_rank, world_size or self.world_size
        self.config = EngineConfig(**{**self._config, "dp_rank": dp_rank, "dp_size": self.world_size})
        return self.rejoin(router_addr, timeout_s, host)

    def _load(self):
        from deepinfer_dp.distributed.cpu_binding import bind_this_process, rank_cpus
        from deepinfer_dp.engine.llm_engine import LLMEngine

        cpus = rank_cpus(self.dp_rank, self.world_size) if self.config.torch_device().type == "cpu" else None
        if cpus is not None:  # before the engine starts its device and OpenMP threads
            bind_this_process(cpus)
        return LLMEngine(self.config)

    def _serve(self, engine, router_addr: str, timeout_s: float, host: str) -> dict:
        from deepinfer_dp.cluster.rank import RankServer

        host = self._node_host(host)
        server = RankServer(engine, self.dp_rank, router_addr, host, group_timeout_s=timeout_s, key=self.key)
        self._thread = threading.Thread(target=server.serve_or_exit, name=f"dp-rank-{self.dp_rank}", daemon=True)
        self._thread.start()
        self._server = server
        self._info = {"address": server.address, "pid": os.getpid(), "vocab_size": engine.vocab_size,
                      "max_model_len": engine.max_model_len, "node_id": ray.get_runtime_context().get_node_id(),
                      "sampling_defaults": engine.input_processor.sampling_defaults,
                      "takes_images": engine.images is not None,
                      "max_group_size": _max_group_size(engine)}
        return self._info

    @staticmethod
    def _node_host(host: str) -> str:
        """Where this rank listens: loopback on one machine; else this node's address, for the
        data plane and for Gloo (whose groups a re-form makes later also listen there)."""
        if host in ("127.0.0.1", "localhost"):
            return host
        from deepinfer_dp.distributed.groups import use_interface_of

        address = ray.util.get_node_ip_address()
        use_interface_of(address)
        return address

    def info(self) -> dict | None:
        """What a restarted router needs of a serving rank: its dp_rank, wave and start() info
        (None: not serving, e.g. a spare that took no rank's place)."""
        if self._server is None or not self.ping():
            return None
        return {**self._info, "dp_rank": self.dp_rank, "wave": self._server.wave}

    def ping(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float) -> bool:
        """Waits for the rank to leave after the router's Shutdown; True when it did."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self._thread is None or not self._thread.is_alive()


@dataclasses.dataclass
class RankSpec:
    """How to start a rank actor: the deployment's first ranks and a restarted one alike."""

    config: dict
    pg: Any
    dp_size: int
    cpus_per_rank: float
    gpus: int
    host: str
    timeout_s: float
    key: ClusterKey | None  # None: data_plane_auth off
    spare: bool  # keep a warm spare rank process (CPU ranks only, see create_spare): router.spare_rank

    def create(self, dp_rank: int, world_size: int | None = None):
        """Rank `dp_rank` of a group of `world_size` (default: the first group's) in its bundle
        of the placement group. A rank past the first group's bundles (the group grew) is
        placed as the warm spare is: CPU ranks only, reserving no Ray CPU, on the cores it
        binds; Ray hands a GPU only to an actor created in a bundle."""
        world_size = world_size or self.dp_size
        config = {**self.config, "dp_rank": dp_rank, "dp_size": world_size}
        if dp_rank < self.dp_size:
            strategy = PlacementGroupSchedulingStrategy(self.pg, dp_rank)
            return ray.remote(RankActor).options(num_cpus=self.cpus_per_rank, num_gpus=self.gpus, max_restarts=0,
                                                 scheduling_strategy=strategy).remote(config, dp_rank, world_size,
                                                                                      self.key)
        if self.gpus:
            raise RuntimeError(f"DP rank {dp_rank}: growing past the first group's {self.dp_size} placement "
                               "bundles works for CPU ranks only (a GPU rank needs a bundle with its GPU)")
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        return ray.remote(RankActor).options(num_cpus=0, max_restarts=0, scheduling_strategy=here).remote(
            config, dp_rank, world_size, self.key)

    def create_spare(self, node_id: str):
        """A rank process for later, on `node_id` (call RankActor.warm on it), or None.
        It reserves nothing: it idles until it takes a dead rank's place, and then runs on the
        cores it binds (the dead rank's share; the dead rank's bundle stays reserved and
        unused). GPU ranks get no spare: Ray hands a GPU to an actor only at its creation, in
        the dead rank's bundle. The affinity is strict: `node_id` is the router's node, the one
        that must outlive the others anyway; a soft one let Ray put the spare on a worker node
        while the head was starting processes, and it died with that node."""
        if not self.spare or self.gpus:
            return None
        return ray.remote(RankActor).options(
            num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote({**self.config, "dp_rank": 0}, 0, self.dp_size, self.key)



def _max_group_size(engine) -> int | None:
    """The most ranks the engine's model can be spread over: its routed experts under expert
    parallelism (each rank holds at least one); None when any size works."""
    spec = getattr(engine.worker.runner.model, "spec", None)
    if not engine.config.enable_expert_parallel or spec is None:
        return None
    return getattr(spec, "num_experts", None)


def rank_device(config: EngineConfig) -> str:
    # Inside its GPU bundle a rank sees only its own device, as cuda:0.
    return "cuda" if config.torch_device().type == "cuda" else "cpu"
