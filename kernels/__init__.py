"""The one dispatch point for the model's numerical primitives.

The model calls `kernels.<op>(...)` for every piece of arithmetic that reduces; the
implementation comes from the numerics mode in force (`with kernels.numerics(mode):`), so modes
can be swapped without touching the model. Modes:

- `batch_invariant` (default): a row's result never depends on the rest of the batch
  (`kernels/invariant.py`);
- `fast`: plain PyTorch ops, whose bits may change with batch shape (`kernels/fast.py`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from kernels import fast, invariant

NUMERICS = ("batch_invariant", "fast")
OPS = (
    "clamped_swiglu", "cos_sin", "grouped_linear", "indexer_scores", "linear", "log_softmax", "mix_streams",
    "moe_experts", "rms_norm", "rotary", "sigmoid", "sink_attention", "sinkhorn", "softmax", "softplus",
    "topk_indices", "unweighted_rms_norm", "window_pool",
)
_IMPLEMENTATIONS = {
    "batch_invariant": {name: getattr(invariant, name) for name in OPS},
    "fast": {name: getattr(fast, name) for name in OPS},
}
_mode: contextvars.ContextVar[str] = contextvars.ContextVar("deepinfer_numerics", default="batch_invariant")


@contextlib.contextmanager
def numerics(mode: str) -> Iterator[None]:
    """Run the enclosed model code with the given numerics mode."""
    if mode not in NUMERICS:
        raise ValueError(f"unknown numerics mode {mode!r} (expected one of {', '.join(NUMERICS)})")
    token = _mode.set(mode)
    try:
        yield
    finally:
        _mode.reset(token)


def current_numerics() -> str:
    return _mode.get()


def __getattr__(name: str):
    if name in OPS:
        return _IMPLEMENTATIONS[_mode.get()][name]
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
