"""Where a V4.1 decode step's stored-weight matmuls spend their time, and whether a cheaper in-kernel decode
of the stored codes buys any of it (issue 35, items 1 and 2). One command, one JSON, on a CUDA device:

    python benchmarks/stored_weight_decodes.py --out results.json

1. `v41-flash-5l` is built on the device with its seeded weights as the release stores them (FP8 E4M3
   dense weights in 32 x 32 tiles, MXFP4 experts, E8M0 scales). For batch 1 and 64, an engine steps the
   requests until all decode (`decode_step_profile.decoding_engine`), then runs one decode step eagerly
   while every call of the invariant matmul (`triton_ops._grouped_matmul`, which `linear` and
   `grouped_linear` call) is recorded with the module that made it and the attribute holding its weight.
2. Each distinct call (layers folded together: the first layer's weight stands for the others, its
   count for all) is replayed alone from a CUDA graph (`gpu_bench.timed_ms`) on that weight and an input
   of its shape, as shipped and under each of `VARIANTS`; a variant's output must have the shipped bits.
   One copy of the weight: one under the L2's size may be read partly from L2.
3. One expert layer (`expert_kernel`'s random MXFP4 stack and uniform routing) at 1, 64 and 256 tokens,
   the same way.

The variants are copies of kernels/triton_ops.py with a source edit each, imported as modules of their
own (their own jit functions), so all of them run in one process:
- `hw_e4m3`: E4M3 codes converted by Triton's fp8 cast (the GPU's conversion instruction) instead of
  `_e4m3`'s integer arithmetic, NaN codes still NaN;
- `scale_where`: where a K slice spans two scale tiles (BLOCK_K = 2 x TILE_K, V4.1's 32-wide tiles), each
  element's scale picked from the two tiles' by `tl.where` instead of a reshape that broadcasts them;
- `mx_dup`: MXFP4 nibbles decoded from each byte loaded once per column it feeds, instead of both
  nibbles of a byte interleaved by join / permute / reshape;
- `prefetch`: each K slice's scales, and MXFP4's packed codes, loaded in registers in the slice before.
  Compiled for sm_90 by Triton 3.6, those are the loads the pipeliner leaves synchronous in the shipped
  K loops, so every slice waits for them: 2 scale bytes a column are too few for an asynchronous copy,
  and MXFP4's bytes reach the dot through a join / permute / reshape (the FP8 codes, decoded
  elementwise, and the activations are copied asynchronously);
- their combinations.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch
import triton

import expert_kernel
from decode_step_profile import decoding_engine, engine_config
from deepinfer import LLM
from deepinfer.checkpoint import preset_config
from deepinfer.kernels import triton_ops
from gpu_bench import ceilings, timed_ms

PRESET = "v41-flash-5l"

E4M3_OLD = '''    bits = byte.to(tl.int32)
    magnitude = tl.where((bits & 0x7F) == 0x7F, 0x7FC00000, (bits & 0x7F) << 20)
    return (magnitude | ((bits & 0x80) << 24)).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120'''
E4M3_HW = '''    value = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return tl.where((byte & 0x7F) == 0x7F, float("nan"), value)'''

MX_OLD = '''            half = start // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_rows + half[:, None], mask=(2 * half < K)[:, None] & col_ok[None, :], other=0)
            packed = packed.to(tl.int32)
            pairs = tl.join(_e2m1(packed, 0), _e2m1(packed, 4))  # [BLOCK_K / 2, BLOCK_N, 2]
            values = tl.reshape(tl.permute(pairs, (0, 2, 1)), (BLOCK_K, BLOCK_N))'''
MX_DUP = '''            packed = tl.load(w_rows + (ks // 2)[:, None], mask=mask, other=0).to(tl.int32)
            values = _e2m1(packed >> ((ks % 2) * 4)[:, None], 0)'''

SCALE_OLD = '''        if BLOCK_K % TILE_K == 0:
            groups = start // TILE_K + tl.arange(0, BLOCK_K // TILE_K)'''
SCALE_WHERE = '''        if BLOCK_K == 2 * TILE_K:
            first = _e8m0(tl.load(s_rows + start // TILE_K, mask=col_ok[None, :], other=0))
            second_ok = col_ok[None, :] & (start + TILE_K + tl.zeros((1, BLOCK_N), dtype=tl.int32) < K)
            second = _e8m0(tl.load(s_rows + start // TILE_K + 1, mask=second_ok, other=0))
            scaled = values * tl.where((tl.arange(0, BLOCK_K) < TILE_K)[:, None], first, second)
        elif BLOCK_K % TILE_K == 0:
            groups = start // TILE_K + tl.arange(0, BLOCK_K // TILE_K)'''

# prefetch: each K slice's scales, and MXFP4's packed codes, loaded in registers one slice ahead (compiled
# for sm_90 by Triton 3.6, these are the loads of the K loop the pipeliner leaves synchronous: 2 scale
# bytes a column are too few for an asynchronous copy, and MXFP4's bytes reach the dot through a
# join / permute / reshape, not elementwise, so the pipeliner does not see them feed it)
TILE_OLD = '''@triton.jit
def _b_tile(w_rows, s_rows, start, K, col_ok, FORMAT: tl.constexpr, TILE_K: tl.constexpr, BLOCK_K: tl.constexpr,
            BLOCK_N: tl.constexpr):'''
TILE_NEW = '''@triton.jit
def _b_ahead(w_rows, s_rows, start, K, col_ok, FORMAT: tl.constexpr, TILE_K: tl.constexpr, BLOCK_K: tl.constexpr,
             BLOCK_N: tl.constexpr):
    if FORMAT == "mxfp4":
        half = start // 2 + tl.arange(0, BLOCK_K // 2)
        codes = tl.load(w_rows + half[:, None], mask=(2 * half < K)[:, None] & col_ok[None, :], other=0)
    else:
        codes = tl.zeros((1, BLOCK_N), dtype=tl.uint8)
    if FORMAT == "plain":
        scale = tl.zeros((1, BLOCK_N), dtype=tl.float32)
    elif BLOCK_K % TILE_K == 0:
        groups = start // TILE_K + tl.arange(0, BLOCK_K // TILE_K)
        scale_ok = (groups * TILE_K < K)[:, None] & col_ok[None, :]
        scale = _e8m0(tl.load(s_rows + groups[:, None], mask=scale_ok, other=0))
    elif TILE_K % BLOCK_K == 0:
        scale_ok = col_ok[None, :] & (start + tl.zeros((1, BLOCK_N), dtype=tl.int32) < K)
        scale = _e8m0(tl.load(s_rows + start // TILE_K, mask=scale_ok, other=0))
    else:
        ks = start + tl.arange(0, BLOCK_K)
        scale = _e8m0(tl.load(s_rows + (ks // TILE_K)[:, None], mask=(ks < K)[:, None] & col_ok[None, :], other=0))
    return codes, scale


@triton.jit
def _b_tile(w_rows, codes, scale, start, K, col_ok, FORMAT: tl.constexpr, TILE_K: tl.constexpr,
            BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):'''
CODES_OLD = '''            half = start // 2 + tl.arange(0, BLOCK_K // 2)
            packed = tl.load(w_rows + half[:, None], mask=(2 * half < K)[:, None] & col_ok[None, :], other=0)
            packed = packed.to(tl.int32)'''
CODES_NEW = '''            packed = codes.to(tl.int32)'''
SCALES_OLD = '''        if BLOCK_K % TILE_K == 0:
            groups = start // TILE_K + tl.arange(0, BLOCK_K // TILE_K)
            scale_ok = (groups * TILE_K < K)[:, None] & col_ok[None, :]
            scale = _e8m0(tl.load(s_rows + groups[:, None], mask=scale_ok, other=0))
            tiles = tl.reshape(values, (BLOCK_K // TILE_K, TILE_K, BLOCK_N)) * scale[:, None, :]
            scaled = tl.reshape(tiles, (BLOCK_K, BLOCK_N))
        elif TILE_K % BLOCK_K == 0:  # the slice lies inside one scale tile
            scaled = values * _e8m0(tl.load(s_rows + start // TILE_K, mask=col_ok[None, :], other=0))
        else:  # tiles that do not nest with slices: each element's scale read for it
            scaled = values * _e8m0(tl.load(s_rows + (ks // TILE_K)[:, None], mask=mask, other=0))'''
SCALES_NEW = '''        if BLOCK_K % TILE_K == 0:
            tiles = tl.reshape(values, (BLOCK_K // TILE_K, TILE_K, BLOCK_N)) * scale[:, None, :]
            scaled = tl.reshape(tiles, (BLOCK_K, BLOCK_N))
        else:
            scaled = values * scale'''
LOOP_OLD = '''    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for start in range(k_first, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = _b_tile(w_rows, s_rows, start, K, col_ok, FORMAT, TILE_K, BLOCK_K, BLOCK_N)'''
LOOP_NEW = '''    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    codes, scale = _b_ahead(w_rows, s_rows, k_first, K, col_ok, FORMAT, TILE_K, BLOCK_K, BLOCK_N)
    for start in range(k_first, K, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        next_codes, next_scale = _b_ahead(w_rows, s_rows, start + BLOCK_K, K, col_ok, FORMAT, TILE_K, BLOCK_K, BLOCK_N)
        b = _b_tile(w_rows, codes, scale, start, K, col_ok, FORMAT, TILE_K, BLOCK_K, BLOCK_N)
        codes, scale = next_codes, next_scale'''
PREFETCH = [(TILE_OLD, TILE_NEW), (CODES_OLD, CODES_NEW), (SCALES_OLD, SCALES_NEW), (LOOP_OLD, LOOP_NEW)]

VARIANTS = {
    "hw_e4m3": [(E4M3_OLD, E4M3_HW)],
    "mx_dup": [(MX_OLD, MX_DUP)],
    "hw_e4m3+scale_where": [(E4M3_OLD, E4M3_HW), (SCALE_OLD, SCALE_WHERE)],
    "all": [(E4M3_OLD, E4M3_HW), (SCALE_OLD, SCALE_WHERE), (MX_OLD, MX_DUP)],
    "prefetch": PREFETCH,
    "prefetch+hw_e4m3": [*PREFETCH, (E4M3_OLD, E4M3_HW)],
}


def variant_module(name: str, edits: list[tuple[str, str]], folder: Path):
    """kernels/triton_ops.py with `edits` applied, imported as a module of its own."""
    source = Path(triton_ops.__file__).read_text()
    for old, new in edits:
        if source.count(old) != 1:
            raise SystemExit(f"error: variant {name}: the text it replaces is not in kernels/triton_ops.py once")
        source = source.replace(old, new)
    module_name = "triton_ops_" + name.replace("+", "_")
    path = folder / f"{module_name}.py"  # Triton reads a jit function's source from its file
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"deepinfer.kernels.{module_name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def holder(module: torch.nn.Module, name: str, weight) -> str:
    """`name.attr` for the attribute of `module` (or a parameter of a child) that is `weight`; `name.?`
    where none is (a view of a weight made inside the forward, as the grouped output projection's)."""
    for attr, value in [*vars(module).items(), *module.named_parameters()]:
        if value is weight:
            return f"{name}.{attr}"
    return f"{name}.?"


def recorded_calls(llm: LLM) -> list[dict]:
    """The `_grouped_matmul` calls of one eager step of `llm`, in order: the weight's holder, the input's
    shape and dtype, the weight and the groups."""
    stack, calls, hooks = ["(model)"], [], []
    modules = dict(llm.model.named_modules())

    def leave(*_) -> None:  # a forward hook's return value would replace the module's output
        stack.pop()

    for name, module in modules.items():
        hooks.append(module.register_forward_pre_hook(lambda _m, _a, name=name: stack.append(name) and None))
        hooks.append(module.register_forward_hook(leave))
    shipped = triton_ops._grouped_matmul

    def recording(x, weight, groups):
        where = stack[-1]
        calls.append({"call": holder(modules.get(where, llm.model), where, weight), "x": (tuple(x.shape), x.dtype),
                      "weight": weight, "groups": groups})
        return shipped(x, weight, groups)

    triton_ops._grouped_matmul = recording
    try:
        llm.step()
        torch.cuda.synchronize()
    finally:
        triton_ops._grouped_matmul = shipped
        for hook in hooks:
            hook.remove()
    return calls


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return torch.equal(a.view(view), b.view(view))


def dense_rows(llm: LLM, batch: int, modules: dict) -> list[dict]:
    engine = decoding_engine(llm, batch, new_tokens=4, cuda_graphs=False, async_scheduling=False)
    calls: dict[tuple, list[dict]] = {}
    for call in recorded_calls(engine):
        (m, g, k), _ = call["x"]
        name = call["call"].split(".", 2)[-1] if call["call"].startswith("layers.") else call["call"]
        calls.setdefault((name, m, g, k), []).append(call)
    rows, totals = [], dict.fromkeys(modules, 0.0)
    for (name, m, g, k), group in calls.items():
        weight, groups = group[0]["weight"], group[0]["groups"]
        x = torch.randn(m, g, k, device="cuda", dtype=group[0]["x"][1])
        reference = triton_ops._grouped_matmul(x, weight, groups)
        row = {"batch": batch, "call": name, "count": len(group), "rows": m, "groups": g, "K": k,
               "N": weight.shape[0] // groups, "format": getattr(weight, "fmt", str(weight.dtype))}
        for label, module in modules.items():
            got = module._grouped_matmul(x, weight, groups)
            ms = timed_ms(lambda a, w, module=module: module._grouped_matmul(a, w, groups), [(x, weight)])
            row[label], row[label + "_same"] = round(ms, 4), same_bits(got, reference)
            totals[label] += ms * len(group)
        rows.append(row)
        print(json.dumps(row), flush=True)
    rows.append({"batch": batch, "totals_ms": {label: round(ms, 3) for label, ms in totals.items()}})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def expert_rows(modules: dict) -> list[dict]:
    config = preset_config(PRESET)
    h, i, k, experts = config.hidden_size, config.moe_intermediate_size, config.num_experts_per_tok, config.n_routed_experts
    w13, w2 = expert_kernel.mxfp4_stack(experts, 2 * i, h, seed=1), expert_kernel.mxfp4_stack(experts, h, i, seed=2)
    rows = []
    for tokens in (1, 64, 256):
        indices, weights = expert_kernel.routing(tokens, experts, k, seed=tokens)
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        reference = triton_ops.moe_experts(x, indices, weights, w13, w2, expert_kernel.LIMIT)
        row = {"tokens": tokens}
        for label, module in modules.items():
            got = module.moe_experts(x, indices, weights, w13, w2, expert_kernel.LIMIT)
            ms = timed_ms(lambda *a, module=module: module.moe_experts(*a, w13, w2, expert_kernel.LIMIT),
                          [(x, indices, weights)])
            row[label], row[label + "_same"] = round(ms, 4), same_bits(got, reference)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: stored_weight_decodes.py needs a CUDA device", file=sys.stderr)
        return 2
    out = Path(args.out)
    record = {"command": "python benchmarks/stored_weight_decodes.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "preset": PRESET, "ceilings": ceilings(), "dense": [], "experts": []}
    with tempfile.TemporaryDirectory() as folder:
        modules = {"shipped": triton_ops,
                   **{name: variant_module(name, edits, Path(folder)) for name, edits in VARIANTS.items()}}
        llm = LLM(f"preset:{PRESET}", engine_config("bfloat16", "batch_invariant", 1))
        for batch in (1, 64):
            record["dense"] += dense_rows(llm, batch, modules)
            out.write_text(json.dumps(record, indent=1) + "\n")
        del llm
        record["experts"] = expert_rows(modules)
        out.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
