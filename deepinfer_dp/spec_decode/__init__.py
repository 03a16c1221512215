"""Speculative decoding: several tokens per step for latency-bound traffic.

config.py      SpeculativeConfig, the `speculative_config` option (vLLM's keys).
proposer.py    the Proposer interface and the n-gram (prompt lookup) proposer.
draft_model.py the draft-model proposer: its own paged KV cache on the target's block ids.
speculator.py  the engine's one object for it: auto-off by batch size, drafting before
               each schedule, and the counters for rank_stats() and Prometheus.

Verification and acceptance live in the C++ scheduler (csrc/engine/scheduler_spec.cpp);
drafts sampled from a distribution q are verified by the sampler (layers/rejection_sampler.py).
"""
