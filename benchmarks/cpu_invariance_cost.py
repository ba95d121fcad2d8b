"""What the fixed-shape CPU discipline costs: prefill and decode tokens/s of batch-invariant engines
built with the CPU primitives before it (variable row tiles up to 256 rows and key lists of any
width, the discipline of commit 92ea738, reproduced below) and with today's, side by side in one
process (all warmed up, repetitions interleaved, the median counts), with `fast` as the control.
Today's is measured twice: with every batch cut into ROW_TILE rows ("one tile") and as engines serve
it, cut into the row tiles the start self-test proved on this machine ("after"). Plus the row-tile
sweep that chose `kernels.invariant.ROW_TILE` (linear alone over the small preset's weight shapes at
several row counts, at each single tile and with the proven ones).

    .venv/bin/python -m benchmarks.cpu_invariance_cost [--presets tiny small v41-tiny] [--dtype float32] \\
        [--out benchmarks/results/cpu_invariance_cost.json]

The "before" engines run with DEEPINFER_ALLOW_VARIANT_CPU=1: on CPUs where the old discipline is not
batch-invariant (AMD EPYCs), the start self-test refuses them, as it should.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

from deepinfer import kernels
from benchmarks.throughput import checkpoint_for, measure, median_run
from deepinfer import LLM
from deepinfer.kernels import fast, invariant
from deepinfer.kernels.cpu_isa import cpu_model, cpu_vendor, mkl_path
from deepinfer.kernels.selftest import WAIVER_VARIABLE, proven_row_tiles

BATCHES = (1, 32)
TILES = (16, 24, 32, 48, 64)
TILE_ROWS = (1, 4, 16, 32, 64, 256, 1024)
SMALL_SHAPES = ((8192, 512), (512, 512), (1024, 256), (512, 256), (24, 2048), (2048, 512), (256, 512))
OLD_ROW_TILE, OLD_K_BLOCK, OLD_KV_BLOCK, OLD_MIN_KEYS = 256, 512, 64, 8


def _old_tile_linear(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype != torch.float32 or rows.shape[1] <= OLD_K_BLOCK:
        return F.linear(rows, weight)
    out = F.linear(rows[:, :OLD_K_BLOCK], weight[:, :OLD_K_BLOCK])
    for start in range(OLD_K_BLOCK, rows.shape[1], OLD_K_BLOCK):
        out += F.linear(rows[:, start:start + OLD_K_BLOCK], weight[:, start:start + OLD_K_BLOCK])
    return out


@kernels.quant.accepts_quantized
def old_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Tiles of at most 256 rows (a lone row paired with a copy of itself), MKL's sgemm."""
    weight = invariant.matmul_layout(weight)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.dtype != weight.dtype:
        rows = rows.to(weight.dtype)
    n = rows.shape[0]
    lone = n % OLD_ROW_TILE == 1
    if lone:
        rows = rows.expand(2, -1) if n == 1 else torch.cat([rows, rows[-1:]])
    if rows.shape[0] <= OLD_ROW_TILE:
        out = _old_tile_linear(rows, weight)
    else:
        out = torch.cat([_old_tile_linear(rows[i:i + OLD_ROW_TILE], weight)
                         for i in range(0, rows.shape[0], OLD_ROW_TILE)])
    if lone:
        out = out[:n]
    return out if x.dim() == 2 else out.view(*x.shape[:-1], weight.shape[0])


@kernels.quant.accepts_quantized
def old_grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    per_group = weight.view(groups, -1, weight.shape[-1])
    return torch.stack([old_linear(x[:, g], per_group[g]) for g in range(groups)], dim=1)


def _at_least(keys: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    pad = OLD_MIN_KEYS - keys.shape[1]
    if pad <= 0:
        return keys, valid
    return F.pad(keys, (0, 0, 0, pad)), F.pad(valid, (0, pad), value=False)


def old_sink_attention(q, kv, valid, sinks, scale):
    """One score matmul per token over all its keys, whatever the batch's widest list."""
    tokens, heads, _ = q.shape
    keys, valid = _at_least(kv.float(), valid)
    keys = keys.masked_fill(~valid.unsqueeze(-1), 0)
    width = keys.shape[1]
    blocks = -(-width // OLD_KV_BLOCK)
    scores = torch.bmm(q.float(), keys.transpose(1, 2)) * scale
    scores = scores.masked_fill_(~valid.unsqueeze(1), float("-inf"))
    if blocks * OLD_KV_BLOCK != width:
        scores = F.pad(scores, (0, blocks * OLD_KV_BLOCK - width), value=float("-inf"))
    sinks = sinks.float()
    top = torch.maximum(scores.amax(dim=-1), sinks)
    probs = invariant.pointwise(torch.exp, scores - top.unsqueeze(-1))
    block_sums = probs.view(tokens, heads, blocks, OLD_KV_BLOCK).sum(dim=-1)
    total = invariant.pointwise(torch.exp, sinks - top)
    acc = None
    for block in range(blocks):
        start, stop = block * OLD_KV_BLOCK, min((block + 1) * OLD_KV_BLOCK, width)
        total = total + block_sums[..., block]
        part = torch.bmm(probs[..., start:stop], keys[:, start:stop])
        acc = part if acc is None else acc + part
    return (acc / total.unsqueeze(-1)).to(q.dtype)


def old_indexer_scores(q, keys, head_weights, valid, scale):
    width = keys.shape[1]
    keys, _ = _at_least(keys.float(), valid)
    weighted = torch.relu(torch.bmm(q.float(), keys.transpose(1, 2))) * scale * head_weights.unsqueeze(-1)
    summed = weighted[:, 0]
    for h in range(1, weighted.shape[1]):
        summed = summed + weighted[:, h]
    return summed[:, :width].masked_fill(~valid, float("-inf"))


def old_ops() -> kernels.Ops:
    """The batch-invariant CPU table with the primitives the discipline changed put back as they were."""
    table = {name: getattr(invariant, name) for name in kernels._PRIMITIVES}
    table.update(linear=old_linear, grouped_linear=old_grouped_linear, sink_attention=old_sink_attention,
                 indexer_scores=old_indexer_scores, mix_streams=fast.mix_streams)
    return kernels.Ops("batch_invariant", "cpu", kernels._complete(table))


@contextlib.contextmanager
def engines_built_with(ops: kernels.Ops):
    """LLM(...) inside builds its model on `ops` (the self-test's refusal waived)."""
    bind, waiver = kernels.bind, os.environ.get(WAIVER_VARIABLE)
    kernels.bind = lambda numerics, device, row_tiles=None: ops
    os.environ[WAIVER_VARIABLE] = "1"
    try:
        yield
    finally:
        kernels.bind = bind
        if waiver is None:
            os.environ.pop(WAIVER_VARIABLE)
        else:
            os.environ[WAIVER_VARIABLE] = waiver


def tile_sweep(dtype: torch.dtype, repeats: int = 7) -> list[dict]:
    """ms per pass over SMALL_SHAPES' weights: the old linear and the new one at each row tile."""
    rows_out = []
    for rows in TILE_ROWS:
        weights = [invariant.matmul_layout(torch.randn(n, k).to(dtype)) for n, k in SMALL_SHAPES]
        inputs = [torch.randn(rows, k).to(dtype) for _, k in SMALL_SHAPES]
        candidates = {"before": old_linear, **{f"tile {t}": partial(_linear_at_tile, t) for t in TILES},
                      "proven tiles": partial(invariant.linear, row_tiles=proven_row_tiles((dtype,)))}
        times: dict[str, list[float]] = {name: [] for name in candidates}
        calls = max(1, 64 // rows)
        for _ in range(repeats):
            for name, fn in candidates.items():
                start = time.perf_counter()
                for _ in range(calls):
                    for x, w in zip(inputs, weights):
                        fn(x, w)
                times[name].append((time.perf_counter() - start) / calls)
        rows_out.append({"rows": rows, "ms": {name: round(statistics.median(v) * 1e3, 3) for name, v in times.items()}})
        print(f"tiles {str(dtype):14} rows {rows:5}: {rows_out[-1]['ms']}", flush=True)
    return rows_out


def _linear_at_tile(tile: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Today's linear with every batch cut into `tile` rows (on the weight's library)."""
    return invariant._cut_linear(x, weight, (tile,), invariant.library_for(weight))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small", "v41-tiny"])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    results = {"command": "python -m benchmarks.cpu_invariance_cost " + " ".join(sys.argv[1:]),
               "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
               "cpu": cpu_model(), "cpu_vendor": cpu_vendor(), "mkl": mkl_path(), "dtype": args.dtype,
               "row_tile": invariant.ROW_TILE,
               "proven_row_tiles": list(proven_row_tiles((getattr(torch, args.dtype),)).candidates[getattr(torch, args.dtype)]),
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
               "repeats": args.repeats, "tiles": tile_sweep(getattr(torch, args.dtype)), "runs": []}
    settings = dict(max_num_seqs=max(BATCHES), max_num_batched_tokens=2048, dtype=args.dtype)
    for preset in args.presets:
        folder = checkpoint_for(preset)
        with engines_built_with(old_ops()):
            engines = {"before": LLM(folder, **settings)}
        with engines_built_with(kernels.bind("batch_invariant", "cpu")):
            engines["one tile"] = LLM(folder, **settings)
        engines["after"] = LLM(folder, **settings)
        engines["fast"] = LLM(folder, numerics="fast", **settings)
        for llm in engines.values():
            measure(llm, 1, 16, 2)
        for batch in BATCHES:
            samples = {name: [] for name in engines}
            for rep in range(args.repeats):
                order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
                for name in order:
                    samples[name].append(measure(engines[name], batch, args.prompt_len, args.new_tokens))
            modes = {name: median_run(runs) for name, runs in samples.items()}
            cost = {kind: round(modes["before"][kind]["tokens_per_s"] / modes["after"][kind]["tokens_per_s"], 2)
                    for kind in ("prefill", "decode")}
            one_tile = {kind: round(modes["before"][kind]["tokens_per_s"] / modes["one tile"][kind]["tokens_per_s"], 2)
                        for kind in ("prefill", "decode")}
            results["runs"].append({"preset": preset, "batch": batch, **modes, "after_time_over_before": cost,
                                    "one_tile_time_over_before": one_tile})
            print(f"{preset:8} batch {batch:3}: " + "  ".join(
                f"{name} prefill {run['prefill']['tokens_per_s']} decode {run['decode']['tokens_per_s']}"
                for name, run in modes.items()) + f"  after/before time: {cost}", flush=True)
        del engines
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
