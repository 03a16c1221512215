"""What the benchmark scripts share: each side of a comparison runs in a child process of the
script itself (its own peak RSS, its own threads, nothing warm from the other side), which
prints its result as one `RESULT {json}` line; the parent runs the sides in turn over several
rounds, because this machine's speed drifts over minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

RESULT_MARK = "RESULT "
CHILD_TIMEOUT_S = 3600.0
# One thread per process unless a side sets its own; a private Ray instance needs no token.
ONE_THREAD_NO_RAY_AUTH = {"RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}


def emit(result: Any) -> None:
    """The child's answer to run_child: one line, the last of its kind wins."""
    print(RESULT_MARK + json.dumps(result), flush=True)


def self_command(script: str, *args: str, python: str = sys.executable) -> list[str]:
    """`python script args...`: a script's command line for running itself as a child."""
    return [python, str(Path(script).resolve()), *args]


def run_child(cmd: list[str], what: str, env: dict[str, str] | None = None,
              timeout_s: float = CHILD_TIMEOUT_S) -> Any:
    """Runs `cmd` and returns the JSON of its last RESULT line. A child that fails, runs past
    `timeout_s` or prints no RESULT line ends the benchmark with `what` and its stderr's tail."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})},
                             timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as e:
        raise SystemExit(f"{what} did not finish within {timeout_s:.0f} s:\n{_tail(e.stderr)}") from None
    lines = [line for line in res.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if res.returncode != 0 or not lines:
        why = f"exit status {res.returncode}" + ("" if lines else ", no RESULT line")
        raise SystemExit(f"{what} failed ({why}):\n{_tail(res.stderr)}")
    return json.loads(lines[-1][len(RESULT_MARK):])


def in_turn(sides: list, round_index: int) -> list:
    """The sides' order in one round: rotated by the round, so no side always goes first."""
    shift = round_index % len(sides)
    return sides[shift:] + sides[:shift]


def best_of_rounds(rounds: int, sides: Iterable, run: Callable[[Any], dict], key: str) -> dict:
    """Every side once per round, the sides one after the other; each side's run with the
    highest `key` (e.g. tokens/s), by side, in the order of `sides`."""
    sides = list(sides)
    best: dict = {}
    for _ in range(rounds):
        for side in sides:
            result = run(side)
            if side not in best or result[key] > best[side][key]:
                best[side] = result
    return {side: best[side] for side in sides if side in best}


def _tail(text: str | bytes | None, chars: int = 4000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-chars:]
