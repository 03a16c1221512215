"""The encoder cache on its own: least recently used out down to its bound, the newest entry
kept even when alone over it, and a pinned entry (an image whose rows a request is in the
middle of computing) never evicted until every request that pinned it lets go."""

from __future__ import annotations

import torch

from deepinfer_dp.multimodal.encoder_cache import EncoderCache


def rows(n: int):
    return lambda: torch.zeros(n, 4)


def test_lru_eviction_down_to_the_bound():
    cache = EncoderCache(max_tokens=32)
    for key in "abc":
        cache.get(key, rows(16))
    assert len(cache) == 2 and cache.stats()["encoder_cache_misses"] == 3
    cache.get("b", rows(16))  # a hit: "b" is now the most recent
    cache.get("d", rows(16))  # evicts "c", the least recently used
    cache.get("b", rows(16))
    assert cache.stats()["encoder_cache_hits"] == 2 and cache.stats()["encoder_tokens"] == 64
    cache.get("e", rows(64))  # alone over the bound: kept, everything else out
    assert len(cache) == 1


def test_a_pinned_image_is_not_evicted_until_every_pin_is_released():
    cache = EncoderCache(max_tokens=16)
    cache.get("x", rows(16))
    cache.pin("x", "req-1")
    cache.pin("x", "req-2")
    cache.get("y", rows(16))  # over the bound, but "x" is pinned
    assert len(cache) == 2 and cache.stats()["encoder_cache_pinned"] == 1
    cache.unpin("x", "req-1")
    cache.get("z", rows(16))  # "y" goes; "x" is still pinned by req-2
    cache.get("x", rows(16))
    assert cache.stats()["encoder_cache_misses"] == 3
    cache.unpin("x", "req-2")
    cache.unpin("x", "req-2")  # twice: harmless
    cache.get("w", rows(16))
    assert len(cache) == 1 and cache.stats()["encoder_cache_pinned"] == 0
