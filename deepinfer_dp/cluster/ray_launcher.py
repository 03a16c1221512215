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
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from deepinfer_dp.cluster.data_plane import AuthMode, ClusterKey, cluster_key_for
from deepinfer_dp.config import EngineConfig

logger = logging.getLogger(__name__)
RAY_TEMP_DIR = "/tmp/ray_dp"
LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 600.0  # model load on every rank, GGUF conversion on a cold cache included
STOP_TIMEOUT_S = 30.0


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

    def start(self, store_host: str, store_port: int, router_addr: str, timeout_s: float, host: str) -> dict:
        """Loads the engine, joins the first DP group and serves."""
        from deepinfer_dp.distributed import init_dp_groups
        from deepinfer_dp.distributed.groups import JOIN_TIMEOUT_S

        engine = self._load()  # load first: the group timeout should not count it
        groups = init_dp_groups(self.dp_rank, self.world_size, store_host, store_port,
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

    def take_over(self, dp_rank: int, router_addr: str, timeout_s: float, host: str) -> dict:
        """A warm spare becomes DP rank `dp_rank` (whose process died): rejoin() as that rank."""
        self.dp_rank = dp_rank
        self.config = EngineConfig(**{**self._config, "dp_rank": dp_rank})
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

        if host not in ("127.0.0.1", "localhost"):  # multi-node: bind this node's address
            host = ray.util.get_node_ip_address()
        server = RankServer(engine, self.dp_rank, router_addr, host, group_timeout_s=timeout_s, key=self.key)
        self._thread = threading.Thread(target=server.serve_or_exit, name=f"dp-rank-{self.dp_rank}", daemon=True)
        self._thread.start()
        return {"address": server.address, "pid": os.getpid(), "vocab_size": engine.vocab_size,
                "max_model_len": engine.max_model_len, "node_id": ray.get_runtime_context().get_node_id()}

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
    key: ClusterKey | None = None
    spare: bool = True  # keep a warm spare rank process (CPU ranks only, see create_spare)

    def create(self, dp_rank: int):
        return ray.remote(RankActor).options(
            num_cpus=self.cpus_per_rank, num_gpus=self.gpus, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, dp_rank),
        ).remote({**self.config, "dp_rank": dp_rank}, dp_rank, self.dp_size, self.key)

    def create_spare(self, node_id: str):
        """A rank process for later, on `node_id` (call RankActor.warm on it), or None.
        It reserves nothing: it idles until it takes a dead rank's place, and then runs on the
        cores it binds (the dead rank's share; the dead rank's bundle stays reserved and
        unused). GPU ranks get no spare: Ray hands a GPU to an actor only at its creation, in
        the dead rank's bundle."""
        if not self.spare or self.gpus:
            return None
        return ray.remote(RankActor).options(
            num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=True),
        ).remote({**self.config, "dp_rank": 0}, 0, self.dp_size, self.key)


class RouterActor:
    """The router process (cluster/router.py) as a Ray actor, with the rank actors as its
    Liveness: it checks them, kills them, and replaces a dead one: by the warm spare when there
    is one (a rank process with its imports done, most of a restart's time), else by a new
    actor in the dead rank's bundle. It also serves the store the first DP group forms on."""

    def __init__(self, policy: str, host: str, collective_timeout_s: float, max_rank_restarts: int,
                 key: ClusterKey | None = None) -> None:
        from deepinfer_dp.cluster.policies import make_policy
        from deepinfer_dp.cluster.router import Router
        from deepinfer_dp.distributed.groups import serve_store

        self.router = Router(make_policy(policy), host, collective_timeout_s, max_rank_restarts=max_rank_restarts,
                             key=key)
        self.store = serve_store(host, collective_timeout_s)
        self.actors: list = []
        self.infos: list[dict] = []
        self.spec: RankSpec | None = None
        self.spare = None  # a warm rank process that replaces the next dead rank (RankSpec.create_spare)
        self._spare_warm = None  # its RankActor.warm call: the process id once its imports are done
        self._spare_lock = threading.Lock()  # two ranks may die, and restart, at once

    def addresses(self) -> dict:
        return {"frontend": self.router.frontend_address, "backend": self.router.backend_address,
                "store_port": self.store.port, "pid": os.getpid()}

    def attach_ranks(self, spec: RankSpec, infos: list[dict], actors: list) -> None:
        self.spec, self.infos, self.actors = spec, list(infos), list(actors)
        self.router.attach_ranks([i["address"] for i in infos], liveness=self)
        self.router.start()
        with self._spare_lock:
            self._new_spare()

    def _new_spare(self) -> None:
        if self.router.membership.max_restarts > 0:
            self.spare = self.spec.create_spare(ray.get_runtime_context().get_node_id())
            self._spare_warm = self.spare.warm.remote() if self.spare is not None else None

    def spare_actor(self):
        return self.spare

    def spare_pid(self, timeout_s: float) -> int | None:
        """The spare's process id once it is warm (None: no spare)."""
        with self._spare_lock:
            warm = self._spare_warm if self.spare is not None else None
        return None if warm is None else ray.get(warm, timeout=timeout_s)

    def rank_actors(self) -> list:
        return list(self.actors)

    def rank_infos(self) -> list[dict]:
        """The ranks' (address, pid, ...) now: a restarted rank has a new process."""
        return list(self.infos)

    def alive(self, dp_rank: int) -> bool:
        info = self.infos[dp_rank]
        if info.get("node_id") == ray.get_runtime_context().get_node_id() and not _process_exists(info["pid"]):
            return False  # on this node a dead process is seen at once, before Ray reports it
        try:
            return bool(ray.get(self.actors[dp_rank].ping.remote(), timeout=10))
        except (ray.exceptions.RayError, TimeoutError):
            return False

    def kill(self, dp_rank: int) -> None:
        ray.kill(self.actors[dp_rank], no_restart=True)

    def restart(self, dp_rank: int) -> str:
        """The warm spare, or else a new rank actor in the dead one's bundle, loaded and serving
        with no group; its address (the router then takes it back with a Reform at full size).
        A spare that took over is replaced by a new one, warming up in the background."""
        with self._spare_lock:
            spare, self.spare = self.spare, None
        args = (self.router.backend_address, self.spec.timeout_s, self.spec.host)
        info = None
        if spare is not None:
            try:
                info = self._serving(dp_rank, spare, spare.take_over.remote(dp_rank, *args))
            except ray.exceptions.RayActorError:  # the spare itself died: a new process then
                logger.exception("DP rank %d: the spare rank process is gone; starting a new one", dp_rank)
        if info is None:
            actor = self.spec.create(dp_rank)
            info = self._serving(dp_rank, actor, actor.rejoin.remote(*args))
        with self._spare_lock:
            if self.spare is None:
                self._new_spare()
        return info["address"]

    def _serving(self, dp_rank: int, actor, call) -> dict:
        """`actor` is DP rank `dp_rank` from now on; its info once `call` (loading) returns."""
        self.actors[dp_rank] = actor  # from now on, alive() and kill() mean this one
        try:
            info = ray.get(call, timeout=START_TIMEOUT_S)
        except BaseException:
            ray.kill(actor, no_restart=True)
            raise
        self.infos[dp_rank] = info
        return info

    def stop(self) -> None:
        self.router.close()


def ensure_ray(address: str, num_cpus: int) -> bool:
    """Connects to Ray; returns True if this call started a private local instance.

    A private instance ("local") listens on 127.0.0.1 only, every process of it (GCS, raylet,
    agents, workers), like the project's own sockets; nothing outside the machine can reach it,
    so it runs without Ray's token authentication. Joining a cluster ("auto" or an address)
    uses Ray's token authentication (launch/ray_head.sh makes the token)."""
    if ray.is_initialized():
        return False
    with _keep_signal_handlers():
        if address == "local":
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            _loopback_only()
            # Ray starts workers at nice 15 by default; ranks are the work itself, not helpers,
            # and a deprioritized rank slows every rank (lockstep).
            os.environ.setdefault("RAY_worker_niceness", "0")
            ray.init(address="local", include_dashboard=False, num_cpus=num_cpus, _node_ip_address=LOOPBACK,
                     object_store_memory=100 * 2**20, _temp_dir=RAY_TEMP_DIR, log_to_driver=False)
            return True
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        ray.init(address=address)
        return False


def _loopback_only() -> None:
    """Ray takes 127.0.0.1 as "this node" only when it is told the node is not part of a
    cluster (its switch for single-machine platforms): then its gRPC servers bind loopback
    instead of every interface. The processes Ray starts read the variable; this one has
    already imported Ray's constants, so they are set too."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


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
    for clients; `infos` are the ranks' (address, pid, vocab_size, max_model_len); `key` is the
    data plane's (None on loopback unless `data_plane_auth` is on): clients need it too."""

    def __init__(self, config: EngineConfig, policy: str = "round_robin", address: str = "local",
                 strategy: str = "pack", collective_timeout_s: float = 30.0, host: str = "127.0.0.1",
                 cpus_per_rank: float = 1.0, max_rank_restarts: int = 3, data_plane_auth: AuthMode = "auto",
                 spare_rank: bool = True) -> None:
        dp_size = config.dp_size
        self.key = cluster_key_for(host, data_plane_auth)
        self.owns_ray = ensure_ray(address, max(os.cpu_count() or 1, int(dp_size * cpus_per_rank + 0.999)))
        gpus = 1 if config.torch_device().type == "cuda" else 0
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus} if gpus else {})}
        self.pg = placement_group([dict(bundle) for _ in range(dp_size)], strategy=strategy.upper())
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.router = ray.remote(RouterActor).options(num_cpus=0, scheduling_strategy=here).remote(
            policy, host, collective_timeout_s, max_rank_restarts, self.key)
        self.ranks: list = []
        try:
            ray.get(self.pg.ready(), timeout=START_TIMEOUT_S)
            addrs = ray.get(self.router.addresses.remote(), timeout=START_TIMEOUT_S)
            cfg = {**dataclasses.asdict(config), "device": _rank_device(config)}
            spec = RankSpec(cfg, self.pg, dp_size, cpus_per_rank, gpus, host, collective_timeout_s, self.key,
                            spare_rank)
            self.ranks = [spec.create(i) for i in range(dp_size)]
            self.infos = ray.get([a.start.remote(host, addrs["store_port"], addrs["backend"], collective_timeout_s,
                                                 host) for a in self.ranks], timeout=START_TIMEOUT_S)
            ray.get(self.router.attach_ranks.remote(spec, self.infos, self.ranks))
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
        ray.kill(ray.get(self.router.rank_actors.remote())[dp_rank], no_restart=True)

    def rank_infos(self) -> list[dict]:
        """The ranks' (address, pid, ...) as they are now (`infos` are the first processes)."""
        return ray.get(self.router.rank_infos.remote(), timeout=STOP_TIMEOUT_S)

    def spare_pid(self, timeout_s: float = START_TIMEOUT_S) -> int | None:
        """The spare rank's process once it is warm, if there is one (tests, fault drills)."""
        return ray.get(self.router.spare_pid.remote(timeout_s), timeout=timeout_s + STOP_TIMEOUT_S)

    def shutdown(self) -> None:
        spare = None
        try:  # the ranks as they are now: a restarted rank is a new actor
            self.ranks = ray.get(self.router.rank_actors.remote(), timeout=STOP_TIMEOUT_S) or self.ranks
            spare = ray.get(self.router.spare_actor.remote(), timeout=STOP_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError):
            pass
        try:
            ray.get(self.router.stop.remote(), timeout=STOP_TIMEOUT_S)  # sends Shutdown to the ranks
        except (ray.exceptions.RayError, TimeoutError):
            logger.warning("the router actor did not stop cleanly")
        leaving = [r.stop.remote(STOP_TIMEOUT_S) for r in self.ranks]  # engine stopped, group destroyed
        ray.wait(leaving, num_returns=len(leaving), timeout=STOP_TIMEOUT_S)
        actors = [*self.ranks, *([spare] if spare is not None else []), self.router]
        for actor in actors:
            actor.__ray_terminate__.remote()  # a graceful exit, after the calls queued before it
        for actor in actors:
            _wait_for_exit(actor)
        remove_placement_group(self.pg)
        if self.owns_ray:
            ray.shutdown()


def _process_exists(pid: int) -> bool:
    """False once the process is gone or a zombie (killed, not yet reaped by the raylet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:  # no /proc: only Ray's answer counts
        return True


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
