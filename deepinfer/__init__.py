"""DeepInfer: bitwise-reproducible offline inference for DeepSeek-V4-architecture models.

`NUMERICS` names the numerics modes `LLM(numerics=...)` accepts (re-exported from kernels, so that
the harness and other callers of the engine need not import kernels themselves).
"""

from deepinfer.engine.config import EngineConfig
from deepinfer.engine.llm import LLM
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams
from kernels import NUMERICS

__version__ = "0.4.0"
__all__ = ["EngineConfig", "LLM", "NUMERICS", "RequestOutput", "SamplingParams", "__version__"]
