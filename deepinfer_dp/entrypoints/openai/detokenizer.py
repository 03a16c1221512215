"""Incremental detokenization: turn a growing list of token ids into text deltas.

Decoding one token at a time is wrong in two ways: a multi-byte character (an emoji, CJK)
can be split over several byte-level tokens, and SentencePiece-style tokenizers drop or
add a leading space depending on what comes before. So each step decodes a small window
(a few tokens already shown, as context, plus the new ones) and emits only what the window
adds beyond the context; while the text ends in U+FFFD (an unfinished character) nothing is
emitted, and the tokens wait for the bytes that complete it.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
# Tokens of context kept before the new ones: enough for any leading-space rule.
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # tokens before this were already turned into text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """Appends tokens; returns the text they complete (may be empty)."""
        self.token_ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of the request: whatever is still held back, U+FFFD included,
        exactly as a one-shot decode of all the tokens would show it."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read_offset == len(self.token_ids):
            return ""
        context = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset:])
        if len(text) <= len(context) or (text.endswith(REPLACEMENT) and not final):
            return ""
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(0, self.read_offset - CONTEXT_TOKENS)
        return text[len(context):]
