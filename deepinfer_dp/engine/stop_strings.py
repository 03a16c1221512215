"""Stop strings: found on the detokenized output, the same way by the engine (to end the
request) and by whoever turns tokens into the final text (to cut it)."""

from __future__ import annotations


def find_stop(text: str, stops: list[str], start: int = 0) -> tuple[int, str] | None:
    """Earliest (index, stop string) in text[start:], or None."""
    best: tuple[int, str] | None = None
    for stop in stops:
        i = text.find(stop, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    return best


def truncate_at_stop(text: str, stops: list[str], include_stop: bool) -> str:
    hit = find_stop(text, stops)
    if hit is None:
        return text
    index, stop = hit
    return text[: index + len(stop)] if include_stop else text[:index]


class StopStringChecker:
    """Incremental: re-decodes the output tokens, but searches only the new tail (a stop
    string can straddle the old text's end, so look back by the longest stop's length)."""

    def __init__(self, stops: list[str], tokenizer, skip_special_tokens: bool) -> None:
        self.stops = stops
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.searched = 0
        self.lookback = max(len(s) for s in stops)

    def append(self, token_ids: list[int]) -> bool:
        """Adds tokens; True when the text now holds a stop string."""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=self.skip_special_tokens)
        hit = find_stop(text, self.stops, max(0, self.searched - self.lookback))
        self.searched = len(text)
        return hit is not None
