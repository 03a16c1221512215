"""`eplb_config`: vLLM's keys, parsed once into an EPLBConfig when the engine config is built."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class EPLBConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    window_size: int = Field(1000, ge=1, description="steps of expert load the balancer looks back over")
    step_interval: int = Field(3000, ge=1, description="steps between two rebalances")
    num_redundant_experts: int = Field(0, ge=0, description="physical expert slots per MoE layer beyond the "
                                                            "logical experts (replicas of hot ones); the total "
                                                            "must divide evenly over the ranks")
    log_balancedness: bool = Field(False, description="log each layer's balancedness (mean / max tokens per "
                                                      "rank) at every rebalance")
    force_steps: list[Annotated[int, Field(ge=1)]] = Field(
        default_factory=list, description="steps (forward passes since the EP group formed, the balancer's clock) "
                                          "at which a rebalance starts besides every step_interval, moving any "
                                          "layer whose placement changes however small the gain: to put a "
                                          "rebalance at an exact step (tests, drills)")

    @field_validator("force_steps")
    @classmethod
    def _increasing(cls, steps: list[int]) -> list[int]:
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError("must be strictly increasing")
        return steps


def parse_eplb_config(value: EPLBConfig | dict[str, Any] | None) -> EPLBConfig:
    """EngineConfig's validator: a mapping of vLLM's keys is checked here, once (ValueError
    with one line per problem, naming the key); a parsed config passes as it is."""
    if value is None:
        return EPLBConfig()
    if isinstance(value, EPLBConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError('must be a mapping of vLLM\'s keys, e.g. {"window_size": 1000, "step_interval": 3000}')
    try:
        return EPLBConfig(**value)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "extra_forbidden":
                msg = f"unknown key; known: {', '.join(EPLBConfig.model_fields)}"
            problems.append(f"{key}: {msg}" + ("" if err["type"] == "extra_forbidden" else
                                                f" (got {err.get('input')!r})"))
        raise ValueError("; ".join(problems)) from None
