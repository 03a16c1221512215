"""Vision-encoder outputs kept by image content key (ImageItem.key), least recently used
out first, bounded by the embedding rows it holds. The same image in a later chunk, a
preempted request's recompute or another request is not encoded again.

An image whose rows a request has begun but not finished computing (chunked prefill) is
pinned (`pin`, by the engine's thread): it is not evicted until its last rows are computed, so
it is never encoded twice for one prefill, and the scheduler's per-step encoder budget, which
counts an image once when a chunk first reaches it, holds exactly. Pinned entries may hold the
cache above its bound for a while."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch


class EncoderCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._pins: dict[str, set[str]] = {}  # image key -> requests in the middle of its rows
        self._tokens = 0
        self.hits = 0
        self.misses = 0
        self.encoder_time_s = 0.0  # in the vision encoder, for the misses
        self.images_encoded = 0
        self.tokens_encoded = 0
        self.step_tokens = 0  # encoded in the current step (start_step)
        self.max_step_tokens = 0  # the most any one step encoded: within max_num_encoder_input_tokens

    def get(self, key: str, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The embeddings [tokens, hidden] of image `key`, from `encode()` on a miss."""
        cached = self._entries.get(key)
        if cached is not None:
            self._entries.move_to_end(key)
            self.hits += 1
            return cached
        self.misses += 1
        start = time.perf_counter()
        embeddings = encode()
        self.encoder_time_s += time.perf_counter() - start
        self.images_encoded += 1
        self.tokens_encoded += embeddings.shape[0]
        self.step_tokens += embeddings.shape[0]
        self.max_step_tokens = max(self.max_step_tokens, self.step_tokens)
        self._entries[key] = embeddings
        self._tokens += embeddings.shape[0]
        self._evict(keep=key)
        return embeddings

    def _evict(self, keep: str) -> None:
        """Least recently used first, down to the bound; never `keep` (the newest entry, its
        request needs it now, even when alone it is over the bound) nor a pinned entry."""
        for old in [k for k in self._entries if k != keep and not self._pins.get(k)]:
            if self._tokens <= self.max_tokens:
                return
            self._tokens -= self._entries.pop(old).shape[0]

    def pin(self, key: str, request_id: str) -> None:
        self._pins.setdefault(key, set()).add(request_id)

    def unpin(self, key: str, request_id: str) -> None:
        owners = self._pins.get(key)
        if owners is not None:
            owners.discard(request_id)
            if not owners:
                del self._pins[key]

    def start_step(self) -> None:
        self.step_tokens = 0

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        looked = self.hits + self.misses
        return {"encoder_cache_hits": self.hits, "encoder_cache_misses": self.misses,
                "encoder_cache_hit_rate": self.hits / looked if looked else 0.0,
                "encoder_cache_tokens": self._tokens, "encoder_time_s": self.encoder_time_s,
                "images_encoded": self.images_encoded, "encoder_tokens": self.tokens_encoded,
                "encoder_tokens_max_step": self.max_step_tokens, "encoder_cache_pinned": len(self._pins)}
