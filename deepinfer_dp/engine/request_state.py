"""What the engine keeps per request beside the C++ sequence, and the small checks and
lookups admission needs (engine/llm_engine.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import GenerationConfig

from deepinfer_dp import _C
from deepinfer_dp.engine.input_processor import InvalidRequest
from deepinfer_dp.engine.stop_strings import StopStringChecker
from deepinfer_dp.sampling_params import SamplingParams


@dataclass
class RequestState:
    """What the engine keeps beside the C++ sequence: how to sample, when to stop on text."""

    params: SamplingParams
    generator: torch.Generator | None
    eos_token_id: int | None
    stop_checker: StopStringChecker | None


def sequence_limits(params: SamplingParams, eos_ids: list[int], allow_drafts: bool) -> _C.SequenceLimits:
    """The limits the C++ scheduler enforces for a request (stop ids: its own and the
    generation config's further EOS ids)."""
    eos = eos_ids[0] if eos_ids else None
    stop_ids = list(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids += eos_ids[1:]
    return _C.SequenceLimits(max_tokens=params.max_tokens, min_tokens=params.min_tokens, stop_token_ids=stop_ids,
                             eos_token_id=-1 if eos is None else eos, ignore_eos=params.ignore_eos,
                             read_prefix_cache=params.prompt_logprobs is None, allow_drafts=allow_drafts)


def check_fits(request_id: str, prompt_len: int, max_tokens: int, max_seq_len: int) -> None:
    """A request that may grow past the context is refused, not cut short later. (A prompt
    that alone fills the context is left to the scheduler's own message.)"""
    if prompt_len < max_seq_len < prompt_len + max_tokens:
        raise InvalidRequest(f"request '{request_id}': the prompt has {prompt_len} tokens and max_tokens is "
                             f"{max_tokens}, {prompt_len + max_tokens} in all, but the context length "
                             f"(max_model_len) is {max_seq_len}; lower max_tokens or shorten the prompt",
                             "max_tokens")


def is_special(state: RequestState) -> bool:
    p = state.params
    return (not p.is_greedy or p.logprobs is not None or p.needs_history or p.min_tokens > 0 or bool(p.logit_bias)
            or p.structured_outputs is not None)


def eos_token_ids(model_dir: str, tokenizer) -> list[int]:
    """EOS ids: the generation config's (possibly several) first, then the tokenizer's."""
    ids: list[int] = []
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    except OSError:
        pass
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
