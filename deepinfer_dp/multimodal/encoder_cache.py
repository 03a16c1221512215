"""Vision-encoder outputs kept by image content key (ImageItem.key), least recently used
out first, bounded by the embedding rows it holds. The same image in a later chunk, a
preempted request's recompute or another request is not encoded again."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch


class EncoderCache:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
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
        # the newest entry stays even when alone it is over the bound: its request needs it now
        while self._tokens > self.max_tokens and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._tokens -= old.shape[0]
        return embeddings

    def start_step(self) -> None:
        self.step_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict:
        looked = self.hits + self.misses
        return {"encoder_cache_hits": self.hits, "encoder_cache_misses": self.misses,
                "encoder_cache_hit_rate": self.hits / looked if looked else 0.0,
                "encoder_cache_tokens": self._tokens, "encoder_time_s": self.encoder_time_s,
                "images_encoded": self.images_encoded, "encoder_tokens": self.tokens_encoded,
                "encoder_tokens_max_step": self.max_step_tokens}
