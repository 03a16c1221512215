"""`speculative_config`: vLLM's keys, parsed once into a SpeculativeConfig when the engine
config is built; everything after reads the typed fields."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# Above this many requests (running or waiting) speculation turns itself off (vLLM's
# disable_by_batch_size): verifying K drafts per sequence stops being nearly free once the
# step is no longer bound by reading the weights, and a draft model, which runs K forwards of
# its own a step, stops paying sooner than prompt lookup (docs/speculative_decoding.md).
DEFAULT_DISABLE_BY_BATCH_SIZE = {"ngram": 2, "draft_model": 1, "mtp": 1}
# The acceptance back-off, per request (Scheduler::set_draft_backoff). Each draft is a row of
# the verification step whether kept or not, so a request drafts one more token than its last
# verification kept (all K after a run kept whole), and after this many verification steps in
# a row that kept nothing it pauses for DRAFT_PAUSE_TOKENS tokens, twice as long after each
# probe that fails again (up to 8x).
DEFAULT_DISABLE_BY_ACCEPTANCE = 4
DRAFT_PAUSE_TOKENS = 16


class SpeculativeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    method: Literal["ngram", "draft_model", "mtp"] = Field(
        description="ngram: prompt lookup, drafts from the sequence's own history; draft_model: a smaller "
                    "model of the same tokenizer drafts autoregressively; mtp: DeepSeek-V3's next-n layer "
                    "from the target's checkpoint drafts from the target's hidden states")
    model: str | None = Field(None, description="draft_model: the draft model (Hugging Face directory or .gguf)")
    num_speculative_tokens: int = Field(ge=1, le=16, description="draft tokens verified per step (K)")
    prompt_lookup_min: int = Field(2, ge=1, description="shortest suffix n-gram looked up")
    prompt_lookup_max: int = Field(4, ge=1, description="longest suffix n-gram looked up (tried first)")
    disable_by_batch_size: int | None = Field(
        1, ge=1, description="no drafting while more requests than this are running or waiting (None: never "
                             f"off; default per method: {DEFAULT_DISABLE_BY_BATCH_SIZE})")
    disable_by_acceptance: int | None = Field(
        DEFAULT_DISABLE_BY_ACCEPTANCE, ge=1,
        description="per request: each verification proposes one more draft than the last kept (all K after "
                    f"a run kept whole), and after this many verification steps in a row that kept no draft, "
                    f"drafting pauses for {DRAFT_PAUSE_TOKENS} tokens, then probes with one draft; each failed "
                    "probe doubles the pause, up to 8x (None: always K drafts, never paused)")

    @model_validator(mode="before")
    @classmethod
    def _refuse_unbuilt(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("method") == "eagle":
            raise ValueError("method: 'eagle' is not available yet; use 'ngram', 'draft_model' or 'mtp'")
        return data

    @model_validator(mode="before")
    @classmethod
    def _default_batch_size(cls, data: Any) -> Any:
        """The measured disable_by_batch_size of the method, unless the config names one (None too)."""
        if isinstance(data, dict) and "disable_by_batch_size" not in data \
                and data.get("method") in DEFAULT_DISABLE_BY_BATCH_SIZE:
            return {**data, "disable_by_batch_size": DEFAULT_DISABLE_BY_BATCH_SIZE[data["method"]]}
        return data

    @model_validator(mode="after")
    def _model_for_draft(self) -> SpeculativeConfig:
        if self.method == "draft_model" and not self.model:
            raise ValueError("model: method 'draft_model' needs the draft model's path")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"model: only method 'draft_model' takes a model (method is {self.method!r})")
        return self

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min: must be <= prompt_lookup_max={self.prompt_lookup_max} "
                             f"(got {self.prompt_lookup_min})")
        return self


def parse_speculative_config(value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
    """EngineConfig's validator, so the engine sees one parsed SpeculativeConfig: a mapping of
    vLLM's keys is checked here, once (ValueError with one line per problem, naming the key); a
    config already parsed (a copy of an EngineConfig, a rank's) passes as it is."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError('must be a mapping of vLLM\'s keys, e.g. {"method": "ngram", "num_speculative_tokens": 3}')
    try:
        return SpeculativeConfig(**value)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"]) or "speculative_config"
            msg = err["msg"].removeprefix("Value error, ")
            problems.append(msg if not err["loc"] and ":" in msg else f"{key}: {msg}")
        raise ValueError("; ".join(problems)) from None
