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

from deepinfer_dp.cluster.data_plane import ROUTER, ClusterKey
from deepinfer_dp.cluster.rank_actor import RankSpec
from deepinfer_dp.config_file import RouterSection

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0  # model load on a restarted rank, GGUF conversion on a cold cache included
STOP_TIMEOUT_S = 10.0  # a rank leaving a shrinking group: its engine stopped and group destroyed


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
            from deepinfer_dp.cluster.group_store import GroupStoreServer  # torch: not in a standby

            self.store = GroupStoreServer(host, key, ROUTER)
        self.actors: list = []
        self.infos: list[dict] = []
        self.spec: RankSpec | None = None
        self.spare = None  # a warm rank process that replaces the next dead rank (RankSpec.create_spare)
        self._spare_warm = None  # its RankActor.warm call: the process id once its imports are done
        self._spare_lock = threading.Lock()  # two ranks may die, and restart, at once
        self._scale_results: dict[int, dict] = {}  # each change's outcome by its id (start_scale)

    def addresses(self) -> dict:
        return {"frontend": self.router.frontend_address, "backend": self.router.backend_address,
                "store_port": self.store.port if self.store is not None else None, "pid": os.getpid(),
                "router_id": self.router.router_id}

    def attach_ranks(self, spec: RankSpec, infos: list[dict], actors: list) -> None:
        self.spec, self.infos, self.actors = spec, list(infos), list(actors)
        self.router.elastic.max_size = infos[0].get("max_group_size")
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
        self.router.elastic.max_size = next((i.get("max_group_size") for i in infos if i["pid"] >= 0), None)
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
        if dp_rank >= len(self.infos):
            return True  # the group shrank past it while the health check ran: not a failure
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
        if dp_rank < len(self.actors):  # else the group shrank past it and stopped it
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
                info = self._serving(dp_rank, spare, spare.take_over.remote(dp_rank, *args, len(self.actors)))
            except ray.exceptions.RayActorError:  # the spare itself died: a new process then
                logger.exception("DP rank %d: the spare rank process is gone; starting a new one", dp_rank)
        if info is None:
            actor = self.spec.create(dp_rank, len(self.actors))
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

    # ---- elastic scaling (cluster/elastic.py) ----------------------------------------------
    def start_scale(self, new_size: int, drain_timeout_s: float) -> dict:
        """Starts a change of the group's size on a thread of this process (a Ray call must not
        block the actor for minutes); {"status": 202, "id"}, or the refusal's status and
        message. scale_state(id) tells when it is done."""
        from deepinfer_dp.cluster.elastic import ScaleError

        try:
            self.router.elastic.begin(new_size)
        except ScaleError as e:
            return {"status": e.status, "message": str(e)}
        change = len(self._scale_results)  # an id per change: a later one must not answer for it
        self._scale_results[change] = {}
        threading.Thread(target=self._scale, args=(change, new_size, drain_timeout_s), name="elastic-scale",
                         daemon=True).start()
        return {"status": 202, "id": change}

    def _scale(self, change: int, new_size: int, drain_timeout_s: float) -> None:
        from deepinfer_dp.cluster.elastic import ScaleError

        try:
            self._scale_results[change] = {"status": 200, **self.router.elastic.run(new_size, drain_timeout_s)}
        except ScaleError as e:
            self._scale_results[change] = {"status": e.status, "message": str(e)}

    def scale_state(self, change: int | None = None) -> dict:
        """{"scaling": bool, "known": whether this router started change `change` (one that took
        over after a restart did not), "result": its outcome (None while it runs)}."""
        return {"scaling": self.router.elastic.scaling, "known": change in self._scale_results,
                "result": self._scale_results.get(change) or None}

    def start_ranks(self, dp_ranks: list[int], world_size: int) -> list[str]:
        """New ranks `dp_ranks` of a group growing to `world_size` (the warm spare first), each
        loaded and serving with no group; their addresses. On a failure the ones started are
        stopped and it raises."""
        with self._spare_lock:
            spare, self.spare = self.spare, None
        args = (self.router.backend_address, self.spec.timeout_s, self.spec.host)
        actors, calls = [], []
        for i in dp_ranks:
            actor = spare if spare is not None and not actors else self.spec.create(i, world_size)
            actors.append(actor)
            calls.append(actor.take_over.remote(i, *args, world_size))
        try:
            infos = ray.get(calls, timeout=START_TIMEOUT_S)
        except BaseException:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            raise
        finally:
            with self._spare_lock:
                if self.spare is None:
                    self._new_spare()
        self.actors += actors  # before the membership has them: alive() and kill() find them
        self.infos += infos
        return [info["address"] for info in infos]

    def stop_ranks(self, size: int) -> None:
        """Stops the rank processes from dp_rank `size` on (the membership already told them to
        shut down): each leaves its engine and group, then exits; a kill for one that does not."""
        gone, self.actors, self.infos = self.actors[size:], self.actors[:size], self.infos[:size]
        ray.wait([a.stop.remote(STOP_TIMEOUT_S) for a in gone], num_returns=len(gone), timeout=STOP_TIMEOUT_S)
        for actor in gone:
            actor.__ray_terminate__.remote()
        for actor in gone:
            try:
                ray.get(actor.__ray_ready__.remote(), timeout=STOP_TIMEOUT_S)
            except ray.exceptions.RayActorError:
                continue  # it exited
            except (ray.exceptions.RayError, TimeoutError):
                pass
            ray.kill(actor, no_restart=True)  # still there: it did not exit in time



def process_exists(pid: int) -> bool:
    """False once the process is gone or a zombie (killed, not yet reaped by the raylet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:  # no /proc: only Ray's answer counts
        return True
