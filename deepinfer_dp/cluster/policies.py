"""Sharding: how the router picks a rank for a request. A policy sees the request's prompt
and the ranks that are up with their in-flight counts, and returns one of those ranks."""

from __future__ import annotations

import itertools
from typing import Protocol


class RoutingPolicy(Protocol):
    def choose(self, prompt_token_ids: list[int], load: dict[int, int]) -> int: ...


class RoundRobin:
    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, prompt_token_ids: list[int], load: dict[int, int]) -> int:
        ranks = sorted(load)
        return ranks[next(self._next) % len(ranks)]


class LeastLoaded:
    """The rank with the fewest requests in flight (ties: the lowest rank)."""

    def choose(self, prompt_token_ids: list[int], load: dict[int, int]) -> int:
        return min(sorted(load), key=lambda r: load[r])


class PrefixAffinity:
    """Requests sharing their first `prefix_len` tokens go to the same rank, so that rank's
    prefix cache hits; a rank more than `slack` requests above the least loaded one is
    skipped, so one hot prefix cannot starve the others."""

    def __init__(self, prefix_len: int = 64, slack: int = 8) -> None:
        self.prefix_len = prefix_len
        self.slack = slack
        self._fallback = LeastLoaded()

    def choose(self, prompt_token_ids: list[int], load: dict[int, int]) -> int:
        ranks = sorted(load)
        rank = ranks[hash(tuple(prompt_token_ids[: self.prefix_len])) % len(ranks)]
        if load[rank] > min(load.values()) + self.slack:
            return self._fallback.choose(prompt_token_ids, load)
        return rank


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix_affinity": PrefixAffinity}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown router policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name]()
