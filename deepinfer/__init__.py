"""DeepInfer: bitwise-reproducible offline inference for DeepSeek-V4-architecture models.

The repo's `kernels/`, `audit/`, `harness/` and `reports/` folders are installed as subpackages of this
one (`deepinfer.kernels`, ...; pyproject.toml maps them). The engine's names below load on first use,
so that importing `deepinfer.audit` or `deepinfer.reports` (read a run, render a report) does not
load torch and the engine. `NUMERICS` names the numerics modes `LLM(numerics=...)` accepts.
"""

from __future__ import annotations

import importlib

__version__ = "0.4.0"

_EXPORTS = {
    "EngineConfig": "deepinfer.engine.config",
    "LLM": "deepinfer.engine.llm",
    "NUMERICS": "deepinfer.kernels",
    "RequestOutput": "deepinfer.outputs",
    "SamplingParams": "deepinfer.sampling_params",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups do not come back here
    return value
