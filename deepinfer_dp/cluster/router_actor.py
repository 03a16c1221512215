"""The router process as a Ray actor (RouterActor): cluster/router.py plus the rank actors as
its Liveness. A second one waits as a standby (its imports done, no sockets bound); when the
router's process dies, RayDeployment's watch hands the standby the rank actors
(RouterActor.recover): it binds the same two ports, so the ranks' and the clients' sockets
reconnect by themselves, asks each rank for its address and wave, and serves on."""

from __future__ import annotations

import contextlib
import logging
import os
import threading

import ray

from deepinfer_dp.cluster.data_plane import ClusterKey
from deepinfer_dp.cluster.rank_actor import RankSpec
from deepinfer_dp.config_file import RouterSection

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0  # model load on a restarted rank, GGUF conversion on a cold cache included


class RouterActor:
    """The router process (cluster/router.py) as a Ray actor, with the rank actors as its
    Liveness: it checks them, kills them, and replaces a dead one: by the warm spare when there
    is one (a rank process with its imports done, most of a restart's time), else by a new
    actor in the dead rank's bundle. It also serves the store the first DP group forms on."""

    def __init__(self, settings: RouterSection, host: str, key: ClusterKey | None = None,
                 ports: tuple[int, int] = (0, 0), standby: bool = False) -> None:
        from deepinfer_dp.cluster.router import Router

        # `ports` (frontend, backend): fixed, so that a router taking over is where its peers
        # already reconnect to. A standby binds them only when it takes over (recover).
        self._make_router = lambda: Router(settings, host=host, key=key, ports=ports)
        self.router = None if standby else self._make_router()
        self.store = None  # the store the first DP group forms on (a standby's group has formed)
        if not standby:
            from deepinfer_dp.distributed.groups import serve_store  # torch: not in a standby

            self.store = serve_store(host, settings.collective_timeout_s)
        self.actors: list = []
        self.infos: list[dict] = []
        self.spec: RankSpec | None = None
        self.spare = None  # a warm rank process that replaces the next dead rank (RankSpec.create_spare)
        self._spare_warm = None  # its RankActor.warm call: the process id once its imports are done
        self._spare_lock = threading.Lock()  # two ranks may die, and restart, at once

    def addresses(self) -> dict:
        return {"frontend": self.router.frontend_address, "backend": self.router.backend_address,
                "store_port": self.store.port if self.store is not None else None, "pid": os.getpid(),
                "router_id": self.router.router_id}

    def attach_ranks(self, spec: RankSpec, infos: list[dict], actors: list) -> None:
        self.spec, self.infos, self.actors = spec, list(infos), list(actors)
        self.router.attach_ranks([i["address"] for i in infos], liveness=self)
        self.router.start()
        with self._spare_lock:
            self._new_spare()

    def recover(self, spec: RankSpec, actors: list, spare) -> list[bool]:
        """This standby replaces a router that died: it binds the ports, and the ranks (the actors the old one last
        had) are asked where they serve and which wave they are at; those that answer are up,
        the others are killed, marked down and restarted as any dead rank. Their in-flight
        requests are not known here: the clients fail them (they see a new router_id) and the
        ranks' deltas for them are answered with Abort. Returns which ranks are up."""
        infos = []
        for i, actor in enumerate(actors):
            try:
                info = ray.get(actor.info.remote(), timeout=10)
            except (ray.exceptions.RayError, TimeoutError):
                info = None
            if info is None or info["dp_rank"] != i:
                ray.kill(actor, no_restart=True)
                info = {"address": "", "pid": -1, "node_id": None, "wave": -1, "dp_rank": i}
            infos.append(info)
        self.router = self._make_router()
        self.spec, self.infos, self.actors = spec, infos, list(actors)
        with self._spare_lock:
            # The old router started the spare, so Ray ended it with its owner (as it does any
            # rank that router restarted): a new one now, or the next dead rank waits for a cold start.
            if spare is not None:
                with contextlib.suppress(ray.exceptions.RayError):
                    ray.kill(spare, no_restart=True)
            self._new_spare()
        up = [info["pid"] >= 0 for info in infos]
        logger.warning("router restarted: ranks up %s", up)
        self.router.attach_ranks([i["address"] for i in infos], liveness=self, up=up,
                                 wave=max(i["wave"] for i in infos))
        self.router.start()
        return up

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
        if info["pid"] < 0:
            return False  # lost while the router restarted
        if info.get("node_id") == ray.get_runtime_context().get_node_id() and not process_exists(info["pid"]):
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



def process_exists(pid: int) -> bool:
    """False once the process is gone or a zombie (killed, not yet reaped by the raylet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:  # no /proc: only Ray's answer counts
        return True
