"""One layer's routed experts on a CUDA device, against the bandwidth it takes to read them: the
invariant Triton path (`kernels.triton_ops.moe_experts`: w13, clamped SwiGLU, w2, weighted combine)
over a preset's expert stack in the release's expert format (MXFP4, E8M0 scales per 32 columns).

    python benchmarks/expert_kernel.py --preset v41-flash-5l --out results.json [--tokens 1 64 256 2048]

For each token count T, each token picks top-k distinct experts uniformly (seeded), so the experts
that have work are those a balanced router would give (~E * (1 - (1 - k/E)^T)); the layer's calls are
captured in a CUDA graph and replayed (GPU time, as in the engine's graphs). Reported per T: ms, the
experts with work, the bytes of their weights and scales, and that over the measured copy bandwidth
(the layer's HBM floor at decode sizes, where every active expert's weight is read once). Random
codes and scales near 1, so no value is inf or NaN.

    python benchmarks/expert_kernel.py --sweep --out results.json

also times each of `CANDIDATES` launch shapes at each T (`kernels.triton_ops.expert_tiles` picks one
from the slot and expert counts, for speed alone), and checks that each gives the shipped pick's bits.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton

from gpu_bench import ceilings, timed_ms
from deepinfer.checkpoint.presets import preset_config
from deepinfer.kernels import triton_ops
from deepinfer.kernels.quant import MXFP4_GROUP, QuantizedWeight
from deepinfer.kernels.triton_ops import Tiles

LIMIT = 10.0  # the presets' swiglu_limit
CANDIDATES = [Tiles(16, 16, 4, 4), Tiles(16, 32, 4, 4), Tiles(16, 32, 2, 4), Tiles(16, 64, 4, 3),
              Tiles(16, 64, 4, 4), Tiles(16, 64, 2, 4), Tiles(16, 64, 8, 4), Tiles(16, 128, 4, 3),
              Tiles(16, 128, 8, 3), Tiles(32, 64, 4, 3), Tiles(64, 64, 4, 3), Tiles(64, 16, 4, 4)]


def mxfp4_stack(experts: int, rows: int, cols: int, seed: int) -> QuantizedWeight:
    """Random MXFP4 weights [experts, rows, cols] for bf16 inputs, scales 2^-4 .. 2^4."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    data = torch.randint(0, 256, (experts, rows, cols // 2), generator=gen, device="cuda", dtype=torch.uint8)
    scale = torch.randint(123, 132, (experts, rows, cols // MXFP4_GROUP), generator=gen, device="cuda",
                          dtype=torch.uint8)
    return QuantizedWeight(data, scale.view(torch.float8_e8m0fnu), "mxfp4", (1, MXFP4_GROUP), torch.bfloat16)


def routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return indices.cuda(), weights.cuda()


def experts_as(tiles: Tiles | None):
    """`triton_ops.moe_experts` launched as `tiles` (None: as shipped)."""
    def run(*args) -> torch.Tensor:
        shipped = triton_ops.expert_tiles
        if tiles is not None:
            triton_ops.expert_tiles = lambda *_: tiles
        try:
            return triton_ops.moe_experts(*args)
        finally:
            triton_ops.expert_tiles = shipped
    return run


def label(tiles: Tiles) -> str:
    return f"{tiles.block_m}x{tiles.block_n} w{tiles.warps} s{tiles.stages}"


def measure(preset: str, experts: int | None, token_counts: list[int], copy_tb_s: float, sweep: bool,
            rows: list[dict], save: Callable[[], None]) -> None:
    """Appends a row per token count and launch shape to `rows`, `save`d after each (a run cut short
    keeps what it measured)."""
    config = preset_config(preset)
    experts = experts or config.n_routed_experts
    h, i, k = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok
    w13, w2 = mxfp4_stack(experts, 2 * i, h, seed=1), mxfp4_stack(experts, h, i, seed=2)
    per_expert = sum(w.data[0].numel() + w.scale[0].numel() for w in (w13, w2))
    for tokens in token_counts:
        indices, weights = routing(tokens, experts, k, seed=tokens)
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        active = int(indices.unique().numel())
        floor_ms = active * per_expert / copy_tb_s / 1e9
        shipped = experts_as(None)(x, indices, weights, w13, w2, LIMIT)
        for tiles in [None] + (CANDIDATES if sweep else []):
            run = experts_as(tiles)
            ms = timed_ms(lambda *args: run(*args, w13, w2, LIMIT), [(x, indices, weights)])
            same = torch.equal(run(x, indices, weights, w13, w2, LIMIT).view(torch.int16), shipped.view(torch.int16))
            rows.append({"tokens": tokens, "slots": tokens * k, "active_experts": active,
                         "tiles": "shipped" if tiles is None else label(tiles), "ms": round(ms, 4),
                         "weight_bytes": active * per_expert, "floor_ms": round(floor_ms, 4),
                         "of_floor": round(floor_ms / ms, 3), "shipped_bits": same})
            print(json.dumps(rows[-1]), flush=True)
            save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="v41-flash-5l")
    parser.add_argument("--experts", type=int, help="experts in the stack (default: the preset's routed experts)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 2048])
    parser.add_argument("--label", default="", help="what this run measures (e.g. the commit)")
    parser.add_argument("--sweep", action="store_true", help="also time every launch shape of CANDIDATES")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("expert_kernel.py: needs a CUDA device")
    out = Path(args.out)
    report = {"command": "python " + " ".join(a if a != args.out else out.name for a in sys.argv),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "preset": args.preset, "label": args.label, "ceilings": ceilings()}
    measure(args.preset, args.experts, args.tokens, report["ceilings"]["copy_tb_s"], args.sweep,
            report.setdefault("layers", []), lambda: out.write_text(json.dumps(report, indent=1)))


if __name__ == "__main__":
    main()
