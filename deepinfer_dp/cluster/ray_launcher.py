"""Starts a DP deployment under Ray: the router process and one rank process per DP rank, as
actors. Ray does placement, start-up and liveness; the data plane is ZeroMQ.

The ranks get one placement-group bundle each; the router (no CPU reserved: it only moves
messages) is placed on this node, next to the clients that connect to it. address="local"
starts a private Ray instance for this process; address="auto" joins the cluster started by
launch/ray_head.sh (and ray_worker.sh on other nodes).

A standby router process waits with its imports done; when the router's process dies, a
thread here (RayDeployment._watch_router) sees it within WATCH_INTERVAL_S and hands the standby
the rank actors (RouterActor.recover): it binds the same two ports, so the ranks' and the
clients' sockets reconnect by themselves, and a new standby starts. The ranks, their DP group
and the clients stay as they are. (Ray's own actor restart took 10-17 s on a loaded machine:
a new worker process importing Ray and the router; the standby takes over in about a second.)

shutdown() stops everything in order: the router asks the ranks to leave, each rank stops its
engine and destroys its DP group, and the actors exit through Ray's graceful termination
(status 0), with a kill only for an actor that does not exit in time; all of it within a
deadline (a process stopping on SIGTERM has seconds, not minutes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
import signal
import socket
import threading
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from deepinfer_dp.cluster.data_plane import RANK, ROUTER, cluster_key_for, role_key
from deepinfer_dp.cluster.elastic import ScaleError
from deepinfer_dp.cluster.rank_actor import RankSpec, rank_device
from deepinfer_dp.cluster.router_actor import RouterActor, process_exists
from deepinfer_dp.config import EngineConfig
from deepinfer_dp.config_file import DPSettings

logger = logging.getLogger(__name__)
RAY_TEMP_DIR = "/tmp/ray_dp"
LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 600.0  # model load on every rank, GGUF conversion on a cold cache included
STOP_TIMEOUT_S = 30.0
WATCH_INTERVAL_S = 0.5


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
            with _own_session():
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
def _own_session():
    """The private instance's processes (GCS, raylet, and the workers the raylet starts) run in
    a session of their own: a SIGTERM or SIGINT sent to this process's group (a terminal's
    Ctrl-C, a supervisor's kill of the group) reaches this process, which drains and then stops
    them (shutdown(), ray.shutdown()), instead of killing them under it (its Ray calls would
    then wait a minute for the GCS and fail). They still die with this process: Ray sets each
    one's parent-death signal. Ray offers no option for it, so its Popen is wrapped meanwhile."""
    from ray._private import services

    original = getattr(services, "ConsolePopen", None)
    if original is None:  # another Ray version: its processes share this group
        logger.warning("Ray's processes share this process group (ray._private.services.ConsolePopen not found)")
        yield
        return

    class _InOwnSession(original):
        def __init__(self, *args, **kwargs) -> None:
            kwargs["start_new_session"] = True
            super().__init__(*args, **kwargs)

    services.ConsolePopen = _InOwnSession
    try:
        yield
    finally:
        services.ConsolePopen = original


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
    """The router and rank actors of one DP deployment, as `settings` (the deployment's router
    and Ray sections) say. `frontend` is the router's address
    for clients; `infos` are the ranks' (address, pid, vocab_size, max_model_len); `key` is the
    data plane's, every role's (None only with `data_plane_auth` off): clients need it too; the
    router and the ranks are given only their own role's secret (the router also the ranks',
    to start a rank again)."""

    def __init__(self, config: EngineConfig, settings: DPSettings, cpus_per_rank: float = 1.0) -> None:
        dp_size, router = config.dp_size, settings.router
        host = router.data_plane_host
        collective_timeout_s = router.collective_timeout_s
        self.key = cluster_key_for(host, router.data_plane_auth)
        cpus = max(os.cpu_count() or 1, int(dp_size * cpus_per_rank + 0.999))
        self.owns_ray = ensure_ray(settings.ray.address, cpus)
        gpus = 1 if config.torch_device().type == "cuda" else 0
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus} if gpus else {})}
        self.pg = placement_group([dict(bundle) for _ in range(dp_size)],
                                  strategy=settings.ray.placement_strategy.upper())
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self._new_router = lambda standby: ray.remote(RouterActor).options(
            num_cpus=0, scheduling_strategy=here).remote(router, host, role_key(self.key, ROUTER), ports, standby)
        ports = _free_ports(host, 2)
        self.router = self._new_router(False)
        self._standby = None
        self.ranks: list = []
        self.spare = None
        self._stopping = threading.Event()
        self._watch: threading.Thread | None = None
        try:
            ray.get(self.pg.ready(), timeout=START_TIMEOUT_S)
            addrs = ray.get(self.router.addresses.remote(), timeout=START_TIMEOUT_S)
            cfg = {**dataclasses.asdict(config), "device": rank_device(config)}
            self.spec = RankSpec(cfg, self.pg, dp_size, cpus_per_rank, gpus, host, collective_timeout_s,
                                 role_key(self.key, RANK), router.spare_rank)
            self.ranks = [self.spec.create(i) for i in range(dp_size)]
            self.infos = ray.get([a.start.remote(host, addrs["store_port"], addrs["backend"], collective_timeout_s,
                                                 host) for a in self.ranks], timeout=START_TIMEOUT_S)
            ray.get(self.router.attach_ranks.remote(self.spec, self.infos, self.ranks))
        except BaseException as e:
            self.shutdown()  # a rank failed to start (bad model path...): leave nothing behind
            cause = getattr(e, "cause", None)  # a RayTaskError carries the rank's own exception
            if isinstance(cause, Exception):
                raise cause from e
            raise
        self.frontend = addrs["frontend"]
        self.router_pid = addrs["pid"]  # the router's process now (a new one after a fail-over)
        self._standby = self._new_router(True)
        self._watch = threading.Thread(target=self._watch_router, name="router-watch", daemon=True)
        self._watch.start()

    def _watch_router(self) -> None:
        """Keeps a copy of the rank actors; when the router's process dies, the standby takes over."""
        while not self._stopping.wait(WATCH_INTERVAL_S):
            if not process_exists(self.router_pid):  # on this node: seen at once
                self._fail_over("its process is gone")
                continue
            try:
                self.ranks = ray.get(self.router.rank_actors.remote(), timeout=STOP_TIMEOUT_S)
                self.spare = ray.get(self.router.spare_actor.remote(), timeout=STOP_TIMEOUT_S)
            except ray.exceptions.RayActorError as e:
                self._fail_over(type(e).__name__)
            except (ray.exceptions.RayError, TimeoutError):
                logger.warning("the router process did not answer within %.0fs", STOP_TIMEOUT_S)

    def _fail_over(self, why: str) -> None:
        if self._stopping.is_set():
            return
        started = time.monotonic()
        logger.error("the router process died (%s); the standby takes over", why)
        with contextlib.suppress(ray.exceptions.RayError):
            ray.kill(self.router, no_restart=True)
        standby, self._standby = self._standby, None
        if standby is None:
            standby = self._new_router(True)
        try:
            up = ray.get(standby.recover.remote(self.spec, self.ranks, self.spare), timeout=STOP_TIMEOUT_S)
            pid = ray.get(standby.addresses.remote(), timeout=STOP_TIMEOUT_S)["pid"]
        except (ray.exceptions.RayError, TimeoutError):
            logger.exception("the standby router could not take over; trying a new one")
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(standby, no_restart=True)
            return  # the next watch turn tries again
        self.router, self.router_pid = standby, pid
        self._standby = self._new_router(True)
        logger.warning("a new router process serves, %.1fs after the death was seen (ranks up: %s)",
                       time.monotonic() - started, up)

    def router_process(self) -> int:
        """The router's process id now (after a restart, a new one)."""
        return ray.get(self.router.addresses.remote(), timeout=STOP_TIMEOUT_S)["pid"]

    def kill_rank(self, dp_rank: int) -> None:
        """Kills a rank's process at once, as a crash would (tests, fault drills)."""
        ray.kill(ray.get(self.router.rank_actors.remote())[dp_rank], no_restart=True)

    def rank_infos(self) -> list[dict]:
        """The ranks' (address, pid, ...) as they are now (`infos` are the first processes)."""
        return ray.get(self.router.rank_infos.remote(), timeout=STOP_TIMEOUT_S)

    def spare_pid(self, timeout_s: float = START_TIMEOUT_S) -> int | None:
        """The spare rank's process once it is warm, if there is one (tests, fault drills)."""
        return ray.get(self.router.spare_pid.remote(timeout_s), timeout=timeout_s + STOP_TIMEOUT_S)

    def scale(self, new_size: int, drain_timeout_s: float) -> dict:
        """Grows or shrinks the DP group to `new_size` ranks while it serves (cluster/elastic.py);
        what it did once done. Raises ScaleError: 400 (a bad size), 409 (a change is already
        in progress), 503 (it failed)."""
        started = ray.get(self.router.start_scale.remote(new_size, drain_timeout_s), timeout=STOP_TIMEOUT_S)
        if started["status"] != 202:
            raise ScaleError(started["status"], started["message"])
        deadline = time.monotonic() + drain_timeout_s + START_TIMEOUT_S + 2 * STOP_TIMEOUT_S
        while time.monotonic() < deadline:
            state = ray.get(self.router.scale_state.remote(started["id"]), timeout=STOP_TIMEOUT_S)
            if state["result"] is not None:
                if state["result"]["status"] != 200:
                    raise ScaleError(state["result"]["status"], state["result"]["message"])
                return {k: v for k, v in state["result"].items() if k != "status"}
            if not state["known"]:  # a router that took over knows nothing of the change
                raise ScaleError(503, "the router process restarted while the group changed size")
            time.sleep(0.2)
        raise ScaleError(503, "the change of the group's size did not finish in time")

    def is_scaling(self) -> bool:
        return bool(ray.get(self.router.scale_state.remote(), timeout=STOP_TIMEOUT_S)["scaling"])

    def shutdown(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stops the ranks, the router and (if this process started it) the private Ray
        instance, every wait within `timeout_s` in all."""
        deadline = time.monotonic() + timeout_s
        self._stopping.set()
        if self._watch is not None:
            self._watch.join(timeout=1.0)
        try:  # the ranks as they are now: a restarted rank is a new actor
            self.ranks = ray.get(self.router.rank_actors.remote(), timeout=_left(deadline)) or self.ranks
            self.spare = ray.get(self.router.spare_actor.remote(), timeout=_left(deadline))
        except (ray.exceptions.RayError, TimeoutError):
            pass
        try:
            ray.get(self.router.stop.remote(), timeout=_left(deadline))  # sends Shutdown to the ranks
        except (ray.exceptions.RayError, TimeoutError):
            logger.warning("the router actor did not stop cleanly")
        leaving = [r.stop.remote(_left(deadline)) for r in self.ranks]  # engine stopped, group destroyed
        ray.wait(leaving, num_returns=len(leaving), timeout=_left(deadline))
        actors = [*self.ranks, *(a for a in (self.spare, self._standby) if a is not None), self.router]
        for actor in actors:
            actor.__ray_terminate__.remote()  # a graceful exit, after the calls queued before it
        for actor in actors:
            _wait_for_exit(actor, deadline)
        remove_placement_group(self.pg)
        if self.owns_ray:
            instance = _private_instance_processes()
            ray.shutdown()
            _reap(instance, deadline)


def _private_instance_processes() -> list:
    """The processes of the Ray instance this process started: its descendants in a session
    of their own (ensure_ray's _own_session), the workers the raylet started included."""
    import psutil

    mine = os.getsid(0)
    found = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(proc.pid) != mine:
                found.append(proc)
    return found


def _reap(procs: list, deadline: float) -> None:
    """Waits for `procs` to end until `deadline` (at least half a second), then kills those left: a
    worker that Ray's shutdown left behind must not outlive the deployment."""
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=max(0.5, deadline - time.monotonic()))
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            logger.warning("killing %s (pid %d), still running after the Ray instance stopped", proc.name(),
                           proc.pid)
            proc.kill()
    psutil.wait_procs(alive, timeout=1.0)


def _left(deadline: float) -> float:
    return max(0.1, deadline - time.monotonic())


def _free_ports(host: str, count: int) -> tuple[int, ...]:
    """Free ports of `host` below the kernel's ephemeral range: a peer reconnecting to a port
    while nobody listens on it (a router restarting) can never be handed it as its own source
    port (a TCP self-connection, which would swallow its messages)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports: list[int] = []
    while len(ports) < count:
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return tuple(ports)


def _wait_for_exit(actor, deadline: float) -> None:
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=_left(deadline))
    except ray.exceptions.RayActorError:
        return  # it exited
    except (ray.exceptions.RayError, TimeoutError):
        pass
    ray.kill(actor, no_restart=True)  # still there: it did not exit in time
