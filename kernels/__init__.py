"""The one dispatch point for the model's numerical primitives.

The model calls `kernels.<op>(...)` for every piece of arithmetic that reduces; the
implementation comes from the numerics mode and device type in force
(`with kernels.numerics(mode, device_type):`), so implementations can be swapped without
touching the model. Modes:

- `batch_invariant` (default): a row's result never depends on the rest of the batch
  (`kernels/invariant.py` in PyTorch; on CUDA, the Triton kernels of `kernels/triton_ops.py`
  replace the ops they cover);
- `fast`: plain PyTorch ops, whose bits may change with batch shape (`kernels/fast.py`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from functools import partial

from kernels import fast, invariant

NUMERICS = ("batch_invariant", "fast")
OPS = (
    "clamped_swiglu", "cos_sin", "grouped_linear", "indexer_scores", "linear", "log_softmax", "matmul_layout",
    "mix_streams", "moe_experts", "ordered_sum", "rms_norm", "rotary", "sigmoid", "sink_attention", "sinkhorn", "softmax", "softplus",
    "topk_indices", "unweighted_rms_norm", "window_pool",
)


def _complete(ops: dict) -> dict:
    """Add the composite ops, built from the table's own primitives (so the routed experts use
    whichever matmul the table has, Triton's included)."""
    ops["moe_experts"] = partial(fast.routed_experts, matmul=ops["linear"], swiglu=ops["clamped_swiglu"])
    return ops


_PRIMITIVES = tuple(name for name in OPS if name != "moe_experts")
_tables: dict[tuple[str, str], dict] = {
    ("batch_invariant", "cpu"): _complete({name: getattr(invariant, name) for name in _PRIMITIVES}),
    ("fast", "cpu"): _complete({name: getattr(fast, name) for name in _PRIMITIVES}),
}
_current: contextvars.ContextVar[dict] = contextvars.ContextVar(
    "deepinfer_kernels", default=_tables[("batch_invariant", "cpu")]
)


def table(mode: str, device_type: str) -> dict:
    """The implementation of every op for a numerics mode on a device type."""
    if mode not in NUMERICS:
        raise ValueError(f"unknown numerics mode {mode!r} (expected one of {', '.join(NUMERICS)})")
    key = (mode, "cuda" if device_type == "cuda" else "cpu")
    if key not in _tables:
        overrides = {}
        if mode == "batch_invariant":  # Triton is imported only when CUDA first needs it
            from kernels import triton_ops

            overrides = triton_ops.OPS
        _tables[key] = _complete({**_tables[(mode, "cpu")], **overrides})
    return _tables[key]


@contextlib.contextmanager
def numerics(mode: str, device_type: str = "cpu") -> Iterator[None]:
    """Run the enclosed model code with the given numerics mode's kernels for `device_type`."""
    token = _current.set(table(mode, device_type))
    try:
        yield
    finally:
        _current.reset(token)


def __getattr__(name: str):
    if name in OPS:
        return _current.get()[name]
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
