"""DeepInfer: bitwise-reproducible offline inference for DeepSeek-V4-architecture models."""

from deepinfer.engine.llm import LLM
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

__version__ = "0.3.0"
__all__ = ["LLM", "RequestOutput", "SamplingParams", "__version__"]
