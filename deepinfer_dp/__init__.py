"""deepinfer-dp: a data-parallel LLM serving engine with a C++ core."""

from deepinfer_dp.entrypoints.llm import LLM
from deepinfer_dp.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
