"""deepinfer-dp: a data-parallel LLM serving engine with a C++ core.

The root imports nothing heavy: `LLM` (torch, transformers) is loaded the first time it is
used, so light modules (the router's policies, the wire protocol, the config) import fast,
and a process that never runs a model never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from deepinfer_dp.sampling_params import SamplingParams
from deepinfer_dp.structured_output.params import StructuredOutputsParams
from deepinfer_dp.version import __version__ as __version__

if TYPE_CHECKING:
    from deepinfer_dp.entrypoints.llm import LLM

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    # LLM lives in entrypoints/, the top layer: imported on first use so that `import deepinfer_dp`
    # (SamplingParams, the wire format) stays free of torch and transformers.
    if name == "LLM":
        from deepinfer_dp.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'deepinfer_dp' has no attribute {name!r}")
