"""Speculative decoding: several tokens per step for latency-bound traffic.

config.py      SpeculativeConfig, the `speculative_config` option (vLLM's keys).
proposer.py    the proposer protocols, what a proposer is built with (ProposerContext,
               DraftTarget) and the n-gram (prompt lookup) proposer.
draft_model.py the draft-model proposer: its own paged KV cache on the target's block ids.
mtp.py         the MTP proposer: DeepSeek-V3's next-n layer, attached by the loader.
speculator.py  the engine's one object for it (build_speculator): auto-off by batch size,
               drafting before each schedule, who sees each target pass, and the counters
               for rank_stats() and Prometheus.

Verification and acceptance live in the C++ scheduler (csrc/engine/scheduler_spec.cpp);
drafts sampled from a distribution q are verified by the sampler (layers/rejection_sampler.py).
"""
