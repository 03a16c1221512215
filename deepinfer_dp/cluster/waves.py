"""Waves: how the router gets every DP rank into the step loop together.

Idle ranks block on their sockets. When the router sends a request to one rank it also sends
Wake(wave) to the others (at most one per rank and wave), so they all enter the step loop
and vote together; they leave it together when the vote says no rank has work, and report
WaveDone. A rank woken by a request (not by a Wake) sends StartWave, and the router wakes every
other rank for that wave again: that closes the race where a request lands just after a
rank's last check of its socket while the others already used their wakes. See
docs/architecture.md, "Waves".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from deepinfer_dp.cluster import protocol as p


class Waves:
    def __init__(self) -> None:
        self.wave = 0  # the latest wave index any rank reported

    def wake_others(self, target: Any, ranks: Iterable[Any]) -> None:
        """`target` was just sent a request: wake the other ranks that are up for this wave.
        An optimization only: StartWave from the woken rank guarantees the wave."""
        for other in ranks:
            if other is not target and other.up and other.woken_wave < self.wave:
                other.woken_wave = self.wave
                other.send(p.Wake(self.wave))

    def start_wave(self, msg: p.StartWave, ranks: Iterable[Any]) -> None:
        # No de-duplication here: a rank may have dropped an earlier Wake(w) while it was
        # still finishing wave w-1.
        self.wave = max(self.wave, msg.wave)
        for r in ranks:
            if r.up and r.dp_rank != msg.dp_rank:
                r.woken_wave = max(r.woken_wave, msg.wave)
                r.send(p.Wake(msg.wave))

    def wave_done(self, msg: p.WaveDone) -> None:
        self.wave = max(self.wave, msg.wave + 1)

    def next_for_reform(self) -> int:
        """A re-formed group starts on a wave of its own, past anything a rank has seen."""
        self.wave += 1
        return self.wave
