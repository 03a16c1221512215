"""One DP rank serving online: its LLMEngine behind a ZeroMQ socket, stepping in waves.

Idle, the rank blocks on its socket (no CPU). A wave starts when a request or a Wake(w) for
the current wave arrives; inside it the rank drains its socket without blocking before each
step, votes, steps, and sends the step's TokenDeltas (one message per step). All ranks leave
a wave together, when the vote says no rank has work; then each reports WaveDone and counts
the wave. A rank woken by a request (not a Wake) sends StartWave so the router wakes every
rank: that closes the race of a request landing after a rank's last drain of a wave while
the others already consumed their wakes (docs/architecture.md, "Waves").

Inside a wave the rank runs the step loop (engine/step_loop.py), taking new messages between
steps. A request the engine refuses is answered with Rejected, and any other failure while
admitting one request fails that request only; a failure of the loop itself ends the rank's
thread, which the launcher's health check sees (the rank is then killed and marked down).
What a peer sends never does: a frame that does not decode, or that is not from the router,
is dropped and counted (cluster/inbox.py; `dropped_frames` in the rank's stats).

A Reform that arrives mid-wave (a restarted rank returns, the group grows back) is not a
failure: the rank asks its lockstep to regroup, every rank leaves the step loop after the same
step, and they join the new group with their requests intact. A restarted rank starts with no
group at all (`group_timeout_s` and `device` are then what its first Reform is joined with).
"""

from __future__ import annotations

import logging
import os
import time

import zmq

from deepinfer_dp.cluster import protocol as p
from deepinfer_dp.cluster.data_plane import RANK, ROUTER, ClusterKey, DataPlane
from deepinfer_dp.cluster.group_store import join_group
from deepinfer_dp.cluster.inbox import Inbox
from deepinfer_dp.distributed import LockstepError, RegroupRequested, destroy_dp_groups
from deepinfer_dp.engine.client import TokenDelta
from deepinfer_dp.engine.llm_engine import LLMEngine
from deepinfer_dp.engine.step_loop import StepLoop
from deepinfer_dp.multimodal.image_worker import MultiModalPrompt

logger = logging.getLogger(__name__)
PROGRESS_S = 1.0  # inside a wave, a rank whose steps send no outputs still reports a step this often


class RankServer:
    def __init__(self, engine: LLMEngine, dp_rank: int, router_addr: str, host: str = "127.0.0.1",
                 group_timeout_s: float = 30.0, key: ClusterKey | None = None) -> None:
        self.engine = engine
        self.group_timeout_s = group_timeout_s
        self.loop = StepLoop(engine)
        self.dp_rank = dp_rank
        self.wave = 0
        self.waves_run = 0
        self._plane = DataPlane(key, RANK)  # `key`: peers by role (cluster/data_plane.py)
        # Only the router may send here; a frame that does not decode is dropped and counted.
        self._inbox = Inbox(self._plane, host, p.rank_decoder, p.TO_RANK_SENDERS, f"DP rank {dp_rank}")
        self.address = self._inbox.address
        # no high-water mark: never block a step on a slow router
        self._outbox = self._plane.connected(zmq.PUSH, router_addr, ROUTER, SNDHWM=0)
        self._stop = False
        self._reform: p.Reform | None = None
        self._last_report = 0.0  # when the router last heard of a step of this rank

    # ---- the outer loop ------------------------------------------------------------------
    def serve_or_exit(self) -> None:
        """serve(), and if the rank's loop fails, end the whole process: the router's health
        check then sees the rank gone instead of a process that is up but serves nothing."""
        try:
            self.serve()
        except BaseException:
            logger.exception("DP rank %d: the rank's loop failed; exiting", self.dp_rank)
            logging.shutdown()
            os._exit(1)

    def serve(self) -> None:
        """Until Shutdown: block for a message; enter a wave when it asks for one."""
        try:
            while not self._stop:
                got = self._inbox.recv()  # None: a frame dropped (malformed, wrong sender)
                reason = self._handle(got[0], idle=True) if got is not None else None
                if reason is not None:
                    self._run_wave(announce=reason == "request")
                if self._reform is not None and self._apply_reform() == "request":
                    self._run_wave(announce=True)  # a Reform that arrived mid-wave
        finally:
            lockstep = self.engine.lockstep
            if lockstep is not None:
                lockstep.close()
            self.engine.shutdown()
            destroy_dp_groups()  # now, not at interpreter teardown
            self._inbox.close()
            self._outbox.close(linger=1000)
            self._plane.close()

    def _run_wave(self, announce: bool) -> None:
        if announce:
            self._send(p.StartWave(self.dp_rank, self.wave))
        try:
            self._step_until_all_done()
        except LockstepError as e:
            logger.error("%s", e)
            # A MoE collective that failed mid-step lost that step's tokens: this rank's
            # requests are then failed with that cause (a failed vote loses nothing).
            lost, cause = self.engine.drop_lost_step()
            self._send(p.GroupBroken(self.dp_rank, self.wave, cause or str(e), lost))
            self._await_reform()
            return
        except RegroupRequested:
            self._await_reform()  # the group agreed to move; nothing was lost
            return
        self._send(p.WaveDone(self.dp_rank, self.wave))
        self.wave += 1
        self.waves_run += 1

    def _step_until_all_done(self) -> None:
        self.loop.run(self._send_outputs, take_work=self._between_steps)

    def _between_steps(self) -> None:
        """Before each step: the new messages, and an empty Deltas when no step's outputs went
        to the router for PROGRESS_S (a rank without requests of its own only steps the
        placeholder): the router reports a rank with no step for long as stalled."""
        if time.monotonic() - self._last_report >= PROGRESS_S:
            self._send_outputs([])
        self._drain()

    def _send_outputs(self, outputs: list) -> None:
        self._last_report = time.monotonic()
        self._send(p.Deltas(self.dp_rank, self.engine.to_deltas(outputs)))

    def _drain(self) -> None:
        while True:
            try:
                got = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if got is not None:
                self._handle(got[0], idle=False)

    # ---- messages ------------------------------------------------------------------------
    def _handle(self, msg, idle: bool) -> str | None:
        """Applies one message; returns why a wave should start ("request", "wake") or None."""
        if isinstance(msg, p.AddRequest):
            return "request" if self._add(msg) else None
        if isinstance(msg, p.Wake):
            return "wake" if idle and msg.wave >= self.wave else None  # older: stale, ignore
        if isinstance(msg, p.Abort):
            self._abort(msg.request_ids)
        elif isinstance(msg, p.StatsQuery):
            self._send(p.Stats(self.dp_rank, msg.query_id, self.stats()))
        elif isinstance(msg, p.Reform):
            self._reform = msg
            if idle:
                return self._apply_reform()
            if self.engine.lockstep is not None:
                self.engine.lockstep.request_regroup()  # mid-wave: leave at a step all agree on
        elif isinstance(msg, p.Shutdown):
            self._stop = True
        return None

    def _add(self, msg: p.AddRequest) -> bool:
        try:
            # Trusted, not validated again: only peers holding the data plane's key (the API
            # servers and the DP driver, which ran InputProcessor.process) can send AddRequest.
            self.engine.add_checked(msg.prompt_token_ids, p.params_from_wire(msg.params), msg.request_id,
                                    mm=_images(msg.mm))
        except ValueError as e:  # the request's own fault
            self._send(p.Rejected(self.dp_rank, msg.request_id, f"request {msg.request_id}: {e}"))
            return False
        except Exception as e:  # not the request's fault, but it must not end the rank either
            logger.exception("DP rank %d: admitting request %s failed", self.dp_rank, msg.request_id)
            delta = TokenDelta(msg.request_id, [], True, "error", dp_rank=self.dp_rank,
                               error=f"{type(e).__name__}: {e}")
            self._send(p.Deltas(self.dp_rank, [delta]))
            return False
        return True

    def _abort(self, request_ids: list[str]) -> None:
        for rid in self.engine.abort_request(request_ids):
            self._send(p.Deltas(self.dp_rank, [TokenDelta(rid, [], True, "abort", dp_rank=self.dp_rank)]))

    # ---- failure: wait for the router to re-form the group -------------------------------
    def _await_reform(self) -> None:
        while self._reform is None and not self._stop:
            got = self._inbox.recv()
            if got is not None:
                self._handle(got[0], idle=False)
        if self._reform is not None:
            if self._apply_reform() == "request":
                self._run_wave(announce=True)

    def _apply_reform(self) -> str | None:
        """Joins the fresh group; the engine's own requests survive (the failed collective
        was the vote, before any step), so a rank with work starts a wave right away."""
        r, self._reform = self._reform, None
        # The last step's forward may still run on the device thread (ZOS): it uses the old
        # group and, under expert parallelism, the experts the new group moves.
        self.engine.worker.drain()
        destroy_dp_groups()
        groups = join_group(r.group_rank, r.world_size, r.host, r.port, self._plane.key, ROUTER,
                            self.engine.device, self.group_timeout_s)
        self.engine.join_dp_group(groups)
        self.wave = r.wave
        self._send(p.Reformed(self.dp_rank, r.wave))
        logger.warning("DP rank %d re-formed as group rank %d of %d", self.dp_rank, r.group_rank,
                       r.world_size)
        return "request" if self.engine.has_local_unfinished_requests() else None

    def stats(self) -> dict:
        return {**self.loop.stats(), "dp_rank": self.dp_rank, "wave": self.wave, "waves_run": self.waves_run,
                "dropped_frames": self._inbox.total_dropped(), "refused_handshakes": self._plane.refused,
                "failed_handshakes": self._plane.failed_handshakes}

    def _send(self, msg) -> None:
        self._outbox.send(p.encoder.encode(msg))


def _images(mm: p.ImageInputs | None) -> MultiModalPrompt | None:
    """A request's images for this rank's image worker (it fetches and decodes them, as at dp 1)."""
    return None if mm is None else MultiModalPrompt(*p.images_from_wire(mm))
