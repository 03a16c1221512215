"""Process-level helpers that know nothing of models or requests (the lowest layer with _C)."""
