"""Sharding: how the router picks a rank for a request. A policy sees the request's prompt
(its token ids, and a digest of each of its images), and the ranks that are up with their
in-flight counts, and returns one of those ranks."""

from __future__ import annotations

import itertools
import zlib
from collections import OrderedDict
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
    """The rank with the fewest requests in flight; ties go round, as round robin does (at
    light load the ranks are often all idle, and ties to the lowest rank put three quarters
    of the requests on rank 0 of two)."""

    def __init__(self) -> None:
        self._turns = itertools.count()

    def choose(self, prompt_token_ids: list[int], load: dict[int, int], images: tuple[int, ...] = ()) -> int:
        ranks, turn = sorted(load), next(self._turns)
        return min(ranks, key=lambda r: (load[r], (ranks.index(r) - turn) % len(ranks)))


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


class CacheAware:
    """Affinity weighed against load, after SGLang's cache-aware router: the router keeps its
    own picture of each rank's prefix cache (the chained hashes of the full `block_size`
    blocks of the prompts it sent there, least recently used dropped past `capacity_blocks`)
    and sends a request to the rank holding the longest cached prefix of its prompt when that
    prefix is at least `cache_threshold` of the prompt; a prompt no rank has goes to the least
    loaded rank (ties in turn, so that a burst of new prefixes spreads over the ranks; SGLang
    picks the rank caching the least instead).
    When the load is out of balance (the busiest rank more than `balance_abs_threshold`
    requests above the idlest and more than `balance_rel_threshold` times it), the least
    loaded rank gets the request whatever it caches. A rank missing from `load` is down: its
    picture is dropped, since a rank that returns starts with an empty cache."""

    def __init__(self, block_size: int = 16, cache_threshold: float = 0.3, balance_abs_threshold: int = 8,
                 balance_rel_threshold: float = 1.5, capacity_blocks: int = 1 << 14) -> None:
        self.block_size = block_size
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.capacity_blocks = capacity_blocks
        self._cached: dict[int, OrderedDict[int, None]] = {}  # rank -> block hashes, oldest first
        self._least = LeastLoaded()

    def choose(self, prompt_token_ids: list[int], load: dict[int, int], images: tuple[int, ...] = ()) -> int:
        for gone in set(self._cached) - set(load):
            del self._cached[gone]
        blocks = self._block_hashes(prompt_token_ids, hash(images) if images else 0)
        rank = self._pick(blocks, len(prompt_token_ids), load)
        self._remember(rank, blocks)
        return rank

    def _pick(self, blocks: list[int], prompt_len: int, load: dict[int, int]) -> int:
        lo, hi = min(load.values()), max(load.values())
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            return min(sorted(load), key=lambda r: load[r])
        matched = {r: self._matched_blocks(r, blocks) for r in sorted(load)}
        best = max(matched, key=lambda r: (matched[r], -load[r]))
        if prompt_len and matched[best] * self.block_size >= self.cache_threshold * prompt_len:
            return best
        return self._least.choose([], load)

    def _block_hashes(self, prompt_token_ids: list[int], seed: int = 0) -> list[int]:
        """One hash per full block, each chained to the ones before it (as the prefix cache's);
        `seed` is the images' digest, so the same text with other images matches nothing."""
        hashes, parent, size = [], seed, self.block_size
        for start in range(0, len(prompt_token_ids) - size + 1, size):
            parent = hash((parent, tuple(prompt_token_ids[start:start + size])))
            hashes.append(parent)
        return hashes

    def _matched_blocks(self, rank: int, blocks: list[int]) -> int:
        cached = self._cached.get(rank, {})
        n = 0
        while n < len(blocks) and blocks[n] in cached:
            n += 1
        return n

    def _remember(self, rank: int, blocks: list[int]) -> None:
        cached = self._cached.setdefault(rank, OrderedDict())
        for h in blocks:
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.capacity_blocks:
            cached.popitem(last=False)


POLICIES = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "prefix_affinity": PrefixAffinity,
            "cache_aware": CacheAware}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown router policy {name!r}; choose from {sorted(POLICIES)}")
    return POLICIES[name]()
