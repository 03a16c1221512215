"""Stop strings, applied by the server to the detokenized text of one choice.

The engine is sent no stop strings: the server sees the text anyway, so it watches for
them, cuts the text before the stop (after it, with include_stop_str_in_output), and closes
the request's stream (which aborts it on its rank). While streaming it holds back the last
len(longest stop) - 1 characters, so a client never receives the start of a stop string
that is then cut away.
"""

from __future__ import annotations

from deepinfer_dp.engine.stop_strings import find_stop


class StopWatch:
    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = stops
        self.include_stop = include_stop  # vLLM's include_stop_str_in_output
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0  # characters of self.text already released
        self.stopped = False

    def feed(self, new_text: str, finished: bool) -> str:
        """Adds text; returns what may be released now. After a stop string is found,
        `stopped` is True and the returned text ends right before it."""
        if self.stopped:
            return ""
        start = max(0, len(self.text) - self.holdback)
        self.text += new_text
        hit = find_stop(self.text, self.stops, start) if self.stops else None
        if hit is not None:
            self.stopped = True
            self.text = self.text[:hit[0] + (len(hit[1]) if self.include_stop else 0)]
            return self._release(len(self.text))
        end = len(self.text) if finished else max(self.sent, len(self.text) - self.holdback)
        return self._release(end)

    def _release(self, end: int) -> str:
        out = self.text[self.sent:end]
        self.sent = max(self.sent, end)
        return out
