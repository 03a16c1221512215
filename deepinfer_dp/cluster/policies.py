"""Sharding: how the router picks a rank for a request. A policy sees the request's prompt
(its token ids, and a digest of each of its images), and the ranks that are up with their
in-flight counts, and returns one of those ranks."""

from __future__ import annotations

import itertools
import zlib
from typing import Protocol


class RoutingPolicy(Protocol):
    def choose(self, prompt_token_ids: list[int], load: dict[int, int], images: tuple[int, ...] = ()) -> int: ...


def image_digests(refs) -> tuple[int, ...]:
    """A digest of each image reference (its URL, or its encoded bytes) of a request: cheap
    (CRC-32), and the same in every router process, so a restarted router keeps the affinity."""
    return tuple(zlib.crc32(r.data) if r.data else zlib.crc32(r.url.encode()) for r in refs)


class RoundRobin:
    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, prompt_token_ids: list[int], load: dict[int, int], images: tuple[int, ...] = ()) -> int:
        ranks = sorted(load)
        return ranks[next(self._next) % len(ranks)]


class LeastLoaded:
    """The rank with the fewest requests in flight (ties: the lowest rank)."""

    def choose(self, prompt_token_ids: list[int], load: dict[int, int], images: tuple[int, ...] = ()) -> int:
        return min(sorted(load), key=lambda r: load[r])


class PrefixAffinity:
    """Requests sharing their first `prefix_len` tokens and their images go to the same rank,
    so that rank's prefix cache (and encoder cache) hits; the same text with other images is
    another key, since its image blocks would not be shared anyway. A rank more than `slack`
    requests above the least loaded one is skipped, so one hot prefix cannot starve the others."""

    def __init__(self, prefix_len: int = 64, slack: int = 8) -> None:
        self.prefix_len = prefix_len
        self.slack = slack
        self._fallback = LeastLoaded()

    def choose(self, prompt_token_ids: list[int], load: dict[int, int], images: tuple[int, ...] = ()) -> int:
        ranks = sorted(load)
        key = tuple(prompt_token_ids[: self.prefix_len])
        rank = ranks[hash((key, images) if images else key) % len(ranks)]
        if load[rank] > min(load.values()) + self.slack:
            return self._fallback.choose(prompt_token_ids, load)
        return rank


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix_affinity": PrefixAffinity}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown router policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name]()
