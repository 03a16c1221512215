"""The acceptance back-off (`disable_by_acceptance`): a request whose drafts are mostly
rejected stops drafting for a while and probes again, one whose drafts are accepted keeps
drafting, and neither changes a token; on tiny random models."""

from __future__ import annotations

from model_utils import prompts_of_lengths, token_ids

from deepinfer_dp import LLM, SamplingParams
from deepinfer_dp.spec_decode.config import DRAFT_PAUSE_TOKENS

MAX_TOKENS = 48
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def drafting(model_dir: str, prompts, **spec) -> tuple[list, dict]:
    config = {"num_speculative_tokens": 3, "disable_by_batch_size": None, **spec}
    llm = LLM(model_dir, decode_sequence=False, speculative_config=config)
    try:
        out = token_ids(llm.generate(prompt_token_ids=prompts, sampling_params=PARAMS, use_tqdm=False))
        return out, llm.rank_stats()[0]
    finally:
        llm.shutdown()


def test_rejected_drafts_pause_drafting_and_keep_every_token(tiny_model_dir):
    # Prompt lookup with 1-grams on a random model: drafts are found everywhere, mostly wrong.
    prompts = prompts_of_lengths([9, 14], offset=3)
    ngram = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 1}
    always, stats_always = drafting(tiny_model_dir, prompts, **ngram, disable_by_acceptance=None)
    backoff, stats_backoff = drafting(tiny_model_dir, prompts, **ngram, disable_by_acceptance=1.0)
    assert backoff == always
    assert stats_always["spec_decode_num_accepted_tokens"] < stats_always["spec_decode_num_drafts"]  # mostly wrong
    # Each poor verification pauses the request, for DRAFT_PAUSE_TOKENS tokens and twice as
    # long after each probe that fails again: at most one probe per pause (plus the first),
    # far fewer than drafting on every step, and fewer than with pauses of a fixed length.
    probes = len(prompts) * max_probes(MAX_TOKENS)
    assert max_probes(MAX_TOKENS) < 1 + MAX_TOKENS // DRAFT_PAUSE_TOKENS
    assert 0 < stats_backoff["spec_decode_num_drafts"] <= probes < stats_always["spec_decode_num_drafts"]


def max_probes(tokens: int) -> int:
    """Probes of a request whose every probe fails: pauses of 16, 32, 64, 128, 128, ... tokens."""
    probes, used, pause = 1, 0, DRAFT_PAUSE_TOKENS
    while used + pause < tokens:
        probes, used, pause = probes + 1, used + pause, min(2 * pause, 8 * DRAFT_PAUSE_TOKENS)
    return probes


def test_accepted_drafts_keep_drafting(tiny_model_dir):
    # The target drafting for itself: every draft accepted, the back-off never triggers.
    prompts = prompts_of_lengths([9, 14], offset=3)
    same = {"method": "draft_model", "model": str(tiny_model_dir)}
    always, stats_always = drafting(tiny_model_dir, prompts, **same, disable_by_acceptance=None)
    backoff, stats_backoff = drafting(tiny_model_dir, prompts, **same, disable_by_acceptance=1.0)
    assert backoff == always
    assert stats_backoff["spec_decode_num_drafts"] == stats_always["spec_decode_num_drafts"] > 0
    assert stats_backoff["spec_decode_num_accepted_tokens"] == stats_backoff["spec_decode_num_draft_tokens"]
