"""The one dispatch point for the model's numerical primitives.

`kernels.bind(numerics, device)` returns the `Ops` of a numerics mode on a device type: one
attribute per primitive (`ops.linear(...)`, `ops.sink_attention(...)`, ...). The engine binds
once and hands the `Ops` to the model when it builds it, so implementations can be swapped
without touching the model and no call pays for a lookup. Modes:

- `batch_invariant` (default): a row's result never depends on the rest of the batch
  (`kernels/invariant.py` in PyTorch; on CUDA, the Triton kernels of `kernels/triton_ops.py` and
  the fused ones of `kernels/triton_fused.py` replace the ops they cover);
- `fast`: plain PyTorch ops, whose bits may change with batch shape (`kernels/fast.py`); on CUDA,
  grouped GEMMs for the routed experts and in-place decoding kernels for stored weights
  (`kernels/fast_cuda.py`), so that nothing reads the host and steps are captured in CUDA graphs.

The integer ops, `paged_slots` and `closing_tokens` (kernels/paging.py: the paged caches' slot
arithmetic) and `engram_rows` (kernels/ngram.py: V4.1's n-gram hashing), have one implementation shared
by every table, one Triton launch each on CUDA in both modes. The cache formats (`fp8_ue8m0_qdq`,
`nvfp4_qdq`, `mxfp4_qdq`: kernels/quant.py) are one implementation shared by every table; they are ops
so that what a model does to its caches is seen where its other numerics are (`audit capture` names them).

Composite ops (`kernels/composite.py`, and the routed experts) are built from each table's own
primitives unless the table brings a kernel of its own for them.

In every table `linear`, `grouped_linear` and `moe_experts` also take weights kept quantized
(`kernels.quant.QuantizedWeight`), with the bits of their decoded values: the Triton kernels decode
them tile by tile, the PyTorch ops decode them first (`quant.accepts_quantized`), and
`matmul_layout` leaves them as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from deepinfer.kernels import composite, fast, invariant, ngram, paging, quant, sampling

NUMERICS = ("batch_invariant", "fast")
OPS = (
    "ascending_topk", "clamped_swiglu", "closing_tokens", "collapsed_norm", "cos_sin", "engram_mix", "engram_rows",
    "expert_outputs", "first_argmax", "fp8_ue8m0_qdq", "grouped_linear", "gumbel_argmax", "hyper_coefficients",
    "hyper_collapse", "hyper_expand", "indexer_scores", "linear", "log", "log_softmax", "matmul_layout",
    "mix_streams", "moe_experts", "moe_gate", "mxfp4_qdq", "nvfp4_qdq", "ordered_sum", "paged_indexer_scores",
    "paged_sink_attention", "paged_slots", "paged_window_pool", "rms_norm", "rotary", "rotary_table", "sigmoid",
    "sink_attention", "sinkhorn", "softmax", "softplus", "topk_indices", "unweighted_rms_norm", "weighted_combine",
    "window_pool",
)
_COMPOSITES = (
    "ascending_topk", "collapsed_norm", "engram_mix", "expert_outputs", "first_argmax", "gumbel_argmax",
    "hyper_coefficients", "hyper_collapse", "hyper_expand", "moe_experts", "moe_gate", "paged_indexer_scores",
    "paged_sink_attention", "paged_window_pool", "rotary_table",
)
# the release's cache formats (kernels/quant.py): one implementation, the same bits in every table
_CACHE_FORMATS = ("fp8_ue8m0_qdq", "mxfp4_qdq", "nvfp4_qdq")
_SAMPLING = ("first_argmax", "gumbel_argmax")  # the sampler's, the same in both modes (`kernels.sampling`)
# integer ops (the caches' slot arithmetic, Engram's hashing): one chain, the same in both modes
_INTEGER = {"paged_slots": paging.paged_slots, "closing_tokens": paging.closing_tokens,
            "engram_rows": ngram.engram_rows}
_PRIMITIVES = tuple(name for name in OPS if name not in _COMPOSITES + _CACHE_FORMATS + tuple(_INTEGER))


class Ops:
    """Every primitive of one numerics mode on one device type, as attributes (read-only)."""

    def __init__(self, numerics: str, device_type: str, table: dict[str, Callable],
                 row_tiles: invariant.RowTiles = invariant.CANONICAL) -> None:
        self.__dict__.update(table, numerics=numerics, device_type=device_type, row_tiles=row_tiles)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError("Ops are read-only: bind another numerics mode instead")

    def __repr__(self) -> str:
        return f"Ops({self.numerics!r}, {self.device_type!r})"


def _complete(table: dict) -> dict:
    """Add the cache formats and the composite ops, built from the table's own primitives (so the
    routed experts use whichever matmul the table has), unless the table brings its own (fused) version."""
    for name in _CACHE_FORMATS:
        table.setdefault(name, getattr(quant, name))
    for name, chain in _INTEGER.items():
        table.setdefault(name, chain)
    table.setdefault("moe_experts", partial(fast.routed_experts, matmul=table["linear"],
                                            swiglu=table["clamped_swiglu"]))
    table.setdefault("expert_outputs", partial(fast.expert_outputs, matmul=table["linear"],
                                               swiglu=table["clamped_swiglu"]))
    table.setdefault("paged_sink_attention", partial(composite.paged_sink_attention,
                                                     sink_attention=table["sink_attention"]))
    table.setdefault("paged_indexer_scores", partial(composite.paged_indexer_scores,
                                                     indexer_scores=table["indexer_scores"]))
    table.setdefault("paged_window_pool", partial(composite.paged_window_pool, window_pool=table["window_pool"]))
    table.setdefault("ascending_topk", partial(composite.ascending_topk, topk_indices=table["topk_indices"]))
    table.setdefault("rotary_table", partial(composite.rotary_table, cos_sin=table["cos_sin"]))
    table.setdefault("hyper_coefficients", partial(composite.hyper_coefficients, sigmoid=table["sigmoid"],
                                                   sinkhorn=table["sinkhorn"]))
    table.setdefault("hyper_collapse", partial(composite.hyper_collapse, ordered_sum=table["ordered_sum"]))
    table.setdefault("hyper_expand", partial(composite.hyper_expand, mix_streams=table["mix_streams"]))
    table.setdefault("collapsed_norm", partial(composite.collapsed_norm, hyper_collapse=table["hyper_collapse"],
                                               rms_norm=table["rms_norm"]))
    table.setdefault("moe_gate", _composite_gate(table))
    table.setdefault("engram_mix", partial(composite.engram_mix, ordered_sum=table["ordered_sum"],
                                           sigmoid=table["sigmoid"]))
    table.setdefault("first_argmax", sampling.first_argmax)
    table.setdefault("gumbel_argmax", partial(sampling.gumbel_argmax, log=table["log"]))
    return table


def _composite_gate(table: dict) -> Callable:
    return partial(composite.moe_gate, softplus=table["softplus"], softmax=table["softmax"], sigmoid=table["sigmoid"],
                   topk_indices=table["topk_indices"], ordered_sum=table["ordered_sum"])


def _table(numerics: str, device_type: str, row_tiles: invariant.RowTiles) -> dict:
    base = fast if numerics == "fast" else invariant
    table = {name: getattr(base, name) for name in _PRIMITIVES}
    if row_tiles is not invariant.CANONICAL:
        table.update(linear=partial(invariant.linear, row_tiles=row_tiles),
                     grouped_linear=partial(invariant.grouped_linear, row_tiles=row_tiles))
    if numerics == "batch_invariant" and device_type == "cuda":  # Triton is imported only when CUDA needs it
        from deepinfer.kernels import triton_fused, triton_ops

        table.update(triton_ops.OPS, **triton_fused.OPS, moe_experts=triton_ops.moe_experts,
                     expert_outputs=triton_ops.expert_outputs, weighted_combine=triton_fused.weighted_combine)
        table["moe_gate"] = partial(triton_fused.moe_gate, composed=_composite_gate(table))
    elif device_type == "cuda":
        from deepinfer.kernels import fast_cuda, triton_fused

        # the cache formats', the sampler's and the integer ops' one-launch kernels give their chains' bits:
        # the fast mode takes them too, so the invariance tax is not measured against launches the
        # invariant mode does not pay (and sampling stays the same in both modes)
        one_launch = (*_CACHE_FORMATS, *_SAMPLING, *_INTEGER)
        table.update(fast_cuda.OPS, **{name: triton_fused.OPS[name] for name in one_launch})
    return _complete(table)


_bound: dict[tuple[str, str, invariant.RowTiles], Ops] = {}


def bind(numerics: str, device: torch.device | str, row_tiles: invariant.RowTiles = invariant.CANONICAL) -> Ops:
    """The primitives of a numerics mode on `device`'s type (CUDA, or CPU for anything else).

    `row_tiles` (batch-invariant CPU tables only) are the row tiles the start self-test proved on this
    machine (`kernels.selftest.proven_row_tiles`): `linear` may cut a batch into those of them proven
    again on each weight."""
    if numerics not in NUMERICS:
        raise ValueError(f"unknown numerics mode {numerics!r} (expected one of {', '.join(NUMERICS)})")
    device_type = "cuda" if torch.device(device).type == "cuda" else "cpu"
    if row_tiles is not invariant.CANONICAL and (numerics, device_type) != ("batch_invariant", "cpu"):
        raise ValueError(f"row tiles are a batch-invariant CPU setting, not one of {numerics} on {device_type}")
    key = (numerics, device_type, row_tiles)
    if key not in _bound:
        _bound[key] = Ops(numerics, device_type, _table(numerics, device_type, row_tiles), row_tiles)
    return _bound[key]
