"""Starts a DP deployment under Ray: the router process and one rank process per DP rank, as
actors. Ray does placement, start-up and liveness; the data plane is ZeroMQ.

The ranks get one placement-group bundle each; the router (no CPU reserved: it only moves
messages) is placed on this node, next to the clients that connect to it. address="local"
starts a private Ray instance for this process; address="auto" joins the cluster started by
launch/ray_head.sh (and ray_worker.sh on other nodes).

shutdown() stops everything in order: the router asks the ranks to leave, each rank stops its
engine and destroys its DP group, and the actors exit through Ray's graceful termination
(status 0), with a kill only for an actor that does not exit in time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import threading

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from deepinfer_dp.config import EngineConfig

logger = logging.getLogger(__name__)
RAY_TEMP_DIR = "/tmp/ray_dp"
START_TIMEOUT_S = 600.0  # model load on every rank, GGUF conversion on a cold cache included
STOP_TIMEOUT_S = 30.0


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
        from deepinfer_dp.distributed.groups import JOIN_TIMEOUT_S
        from deepinfer_dp.engine.llm_engine import LLMEngine

        cpus = rank_cpus(self.dp_rank, self.world_size) if self.config.torch_device().type == "cpu" else None
        if cpus is not None:  # before the engine starts its device and OpenMP threads
            bind_this_process(cpus)
        engine = LLMEngine(self.config)  # load first: the group timeout should not count it
        groups = init_dp_groups(self.dp_rank, self.world_size, store_host, store_port,
                                engine.device, timeout_s, JOIN_TIMEOUT_S)
        engine.join_dp_group(groups)
        if host not in ("127.0.0.1", "localhost"):  # multi-node: bind this node's address
            host = ray.util.get_node_ip_address()
        server = RankServer(engine, self.dp_rank, router_addr, host)
        self._thread = threading.Thread(target=server.serve_or_exit, name=f"dp-rank-{self.dp_rank}", daemon=True)
        self._thread.start()
        return {"address": server.address, "pid": os.getpid(), "vocab_size": engine.vocab_size,
                "max_model_len": engine.max_model_len}

    def ping(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float) -> bool:
        """Waits for the rank to leave after the router's Shutdown; True when it did."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self._thread is None or not self._thread.is_alive()


class RouterActor:
    """The router process (cluster/router.py) as a Ray actor, with the rank actors as its
    Liveness. It also serves the store the first DP group forms on."""

    def __init__(self, policy: str, host: str, collective_timeout_s: float) -> None:
        from deepinfer_dp.cluster.policies import make_policy
        from deepinfer_dp.cluster.router import Router
        from deepinfer_dp.distributed.groups import serve_store

        self.router = Router(make_policy(policy), host, collective_timeout_s)
        self.store = serve_store(host, collective_timeout_s)
        self.actors: list = []

    def addresses(self) -> dict:
        return {"frontend": self.router.frontend_address, "backend": self.router.backend_address,
                "store_port": self.store.port, "pid": os.getpid()}

    def attach_ranks(self, addresses: list[str], actors: list) -> None:
        self.actors = actors
        self.router.attach_ranks(addresses, liveness=self)
        self.router.start()

    def alive(self, dp_rank: int) -> bool:
        try:
            return bool(ray.get(self.actors[dp_rank].ping.remote(), timeout=10))
        except (ray.exceptions.RayError, TimeoutError):
            return False

    def kill(self, dp_rank: int) -> None:
        ray.kill(self.actors[dp_rank], no_restart=True)

    def stop(self) -> None:
        self.router.close()


def ensure_ray(address: str, num_cpus: int) -> bool:
    """Connects to Ray; returns True if this call started a private local instance."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with _keep_signal_handlers():
        if address == "local":
            # Ray starts workers at nice 15 by default; ranks are the work itself, not helpers,
            # and a deprioritized rank slows every rank (lockstep).
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(address="local", include_dashboard=False, num_cpus=num_cpus,
                     object_store_memory=100 * 2**20, _temp_dir=RAY_TEMP_DIR, log_to_driver=False)
            return True
        ray.init(address=address)
        return False


@contextlib.contextmanager
def _keep_signal_handlers():
    """ray.init installs a handler that dumps the stack and aborts on SIGTERM; this process's
    own handlers (a server's graceful stop, or the default: end) are put back after it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


class RayDeployment:
    """The router and rank actors of one DP deployment. `frontend` is the router's address
    for clients; `infos` are the ranks' (address, pid, vocab_size, max_model_len)."""

    def __init__(self, config: EngineConfig, policy: str = "round_robin", address: str = "local",
                 strategy: str = "pack", collective_timeout_s: float = 30.0, host: str = "127.0.0.1",
                 cpus_per_rank: float = 1.0) -> None:
        dp_size = config.dp_size
        self.owns_ray = ensure_ray(address, max(os.cpu_count() or 1, int(dp_size * cpus_per_rank + 0.999)))
        gpus = 1 if config.torch_device().type == "cuda" else 0
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus} if gpus else {})}
        self.pg = placement_group([dict(bundle) for _ in range(dp_size)], strategy=strategy.upper())
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.router = ray.remote(RouterActor).options(num_cpus=0, scheduling_strategy=here).remote(
            policy, host, collective_timeout_s)
        self.ranks: list = []
        try:
            ray.get(self.pg.ready(), timeout=START_TIMEOUT_S)
            addrs = ray.get(self.router.addresses.remote(), timeout=START_TIMEOUT_S)
            cfg = {**dataclasses.asdict(config), "device": _rank_device(config)}
            actor = ray.remote(RankActor)
            self.ranks = [actor.options(num_cpus=cpus_per_rank, num_gpus=gpus, max_restarts=0,
                                        scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, i))
                          .remote({**cfg, "dp_rank": i}, i, dp_size) for i in range(dp_size)]
            self.infos = ray.get([a.start.remote(host, addrs["store_port"], addrs["backend"], collective_timeout_s,
                                                 host) for a in self.ranks], timeout=START_TIMEOUT_S)
            ray.get(self.router.attach_ranks.remote([i["address"] for i in self.infos], self.ranks))
        except BaseException as e:
            self.shutdown()  # a rank failed to start (bad model path...): leave nothing behind
            cause = getattr(e, "cause", None)  # a RayTaskError carries the rank's own exception
            if isinstance(cause, Exception):
                raise cause from e
            raise
        self.frontend = addrs["frontend"]
        self.router_pid = addrs["pid"]

    def kill_rank(self, dp_rank: int) -> None:
        """Kills a rank's process at once, as a crash would (tests, fault drills)."""
        ray.kill(self.ranks[dp_rank], no_restart=True)

    def shutdown(self) -> None:
        try:
            ray.get(self.router.stop.remote(), timeout=STOP_TIMEOUT_S)  # sends Shutdown to the ranks
        except (ray.exceptions.RayError, TimeoutError):
            logger.warning("the router actor did not stop cleanly")
        leaving = [r.stop.remote(STOP_TIMEOUT_S) for r in self.ranks]  # engine stopped, group destroyed
        ray.wait(leaving, num_returns=len(leaving), timeout=STOP_TIMEOUT_S)
        for actor in [*self.ranks, self.router]:
            actor.__ray_terminate__.remote()  # a graceful exit, after the calls queued before it
        for actor in [*self.ranks, self.router]:
            _wait_for_exit(actor)
        remove_placement_group(self.pg)
        if self.owns_ray:
            ray.shutdown()


def _wait_for_exit(actor) -> None:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=STOP_TIMEOUT_S)
    except ray.exceptions.RayActorError:
        return  # it exited
    except (ray.exceptions.RayError, TimeoutError):
        pass
    ray.kill(actor, no_restart=True)  # still there: it did not exit in time


def _rank_device(config: EngineConfig) -> str:
    # Inside its GPU bundle a rank sees only its own device, as cuda:0.
    return "cuda" if config.torch_device().type == "cuda" else "cpu"
