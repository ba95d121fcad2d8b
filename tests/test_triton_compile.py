"""The Triton kernels compile for Hopper (sm_90) without a GPU: the matmuls in every weight format,
scale tile and K chunking, and the fused small ops without multiply-add contraction.

The interpreter runs kernels as Python and never sees what only the compiler does (a branch that
cannot be generated for some constexpr combination is invisible to it), so this compiles
`kernels.triton_ops`' matmul kernels to PTX in a fresh process with the interpreter off, and checks
that the bf16 ones use Hopper's wgmma. Triton's bundled ptxas does the work: no CUDA device needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import triton_target  # noqa: F401  (imports Triton as every kernel test module does: the interpreter is
# chosen at Triton's import, and Triton's own jit library functions keep that choice for the whole run)

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = [("plain", 1, 1), ("fp8", 32, 32), ("fp8", 128, 128), ("fp8", 16, 48), ("mxfp4", 1, 32)]

COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepinfer.kernels import triton_ops

def compile_kernel(fn, signature, constexprs, **options):
    names = fn.arg_names  # every parameter, in order
    source = ASTSource(fn=fn, signature={name: signature.get(name, "constexpr") for name in names},
                       constexprs={(names.index(name),): value for name, value in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

results = []
for fmt, tile_n, tile_k in json.loads(sys.argv[1]):
    weight = "*bf16" if fmt == "plain" else "*u8"
    layout = {"FORMAT": fmt, "TILE_N": tile_n, "TILE_K": tile_k, "BLOCK_K": triton_ops.BLOCK_K}
    for splits, separate in ((1, False), (4, True), (4, False)):
        signature = {"x_ptr": "*bf16", "w_ptr": weight, "s_ptr": weight, "out_ptr": "*fp32" if separate else "*bf16",
                     "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_om": "i32"}
        ptx = compile_kernel(triton_ops._matmul_kernel, signature,
                             {"BLOCK_M": 64, "BLOCK_N": 16, **layout, "SPLITS": splits, "K_CHUNK": triton_ops.K_CHUNK,
                              "SEPARATE": separate})
        results.append([fmt, tile_k, "matmul", [splits, separate], "wgmma" in ptx])
    signature = {"x_ptr": "*bf16", "rows_ptr": "*i64", "dest_ptr": "*i64", "offsets_ptr": "*i64",
                 "experts_ptr": "*i64", "w_ptr": weight, "s_ptr": weight, "out_ptr": "*bf16", "N": "i32", "K": "i32",
                 "stride_xm": "i32"}
    for moves in ((True, False), (False, True)):
        ptx = compile_kernel(triton_ops._expert_matmul_kernel, signature,
                             {"BLOCK_M": 64, "BLOCK_N": 64, **layout, "GATHER": moves[0], "SCATTER": moves[1]})
        results.append([fmt, tile_k, "experts", moves, "wgmma" in ptx])
print(json.dumps(results))
"""


def test_matmul_kernels_compile_for_hopper_in_every_format():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", COMPILE, json.dumps(LAYOUTS)], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(results) == len(LAYOUTS) * 5
    assert all(uses_wgmma for *_, uses_wgmma in results), [r for r in results if not r[-1]]


FUSED = """
import sys
sys.argv = sys.argv[:1]
exec(sys.stdin.read())  # compile_kernel
from deepinfer.kernels import triton_fused as f, triton_ops

bf16, fp32 = "*bf16", "*fp32"
kernels = {
    "route": (triton_ops._route_kernel, {**{name: "*i64" for name in ("experts_ptr", "rows_ptr", "order_ptr",
                                                                       "source_ptr", "offsets_ptr", "active_ptr")},
                                         "S": "i32", "E": "i32", "per_row": "i32", "listed": "i32"},
              {"BLOCK_S": 512, "BLOCK_E": 512, "CHUNK": 8, "HAS_ROWS": False}),
    "rotary": (f._rotary_kernel, {"x_ptr": bf16, "cos_ptr": fp32, "sin_ptr": fp32, "out_ptr": bf16, "rows": "i32",
                                  "per_token": "i32", "D": "i32", "HALF": "i32"},
               {"ROWS": 16, "BLOCK_D": 512, "BLOCK_HALF": 32, "INVERSE": True}),
    "rotary_table": (f._rotary_table_kernel, {"pos_ptr": "*i64", "inv_freq_ptr": fp32, "cos_ptr": fp32,
                                              "sin_ptr": fp32, "tokens": "i32", "HALF": "i32", "scale": "fp32"},
                     {"ROWS": 16, "BLOCK_HALF": 32}),
    "coefficients": (f._hyper_coefficients_kernel, {"mix_ptr": fp32, "base_ptr": fp32, "scale_ptr": fp32,
                                                    "pre_ptr": fp32, "post_ptr": fp32, "comb_ptr": fp32, "n": "i32",
                                                    "iters": "i32", "eps": "fp32"}, {"BLOCK": 4}),
    "rms_norm": (triton_ops._rms_norm_kernel, {"x_ptr": bf16, "w_ptr": fp32, "out_ptr": bf16, "N": "i32",
                                               "eps": "fp32"}, {"WEIGHTED": True, "BLOCK": triton_ops.ROW_BLOCK}),
    "collapsed_norm": (triton_ops._collapsed_norm_kernel, {"pre_ptr": fp32, "streams_ptr": bf16, "x_ptr": bf16,
                                                           "w_ptr": fp32, "out_ptr": bf16, "H": "i32", "eps": "fp32"},
                       {"N": 4, "LEVELS": 2, "COLLAPSE_BLOCK": f.BLOCK_H, "BLOCK": triton_ops.ROW_BLOCK}),
    "collapse": (f._hyper_collapse_kernel, {"pre_ptr": fp32, "streams_ptr": bf16, "out_ptr": bf16, "H": "i32"},
                 {"N": 4, "LEVELS": 2, "BLOCK": 256}),
    "expand": (f._hyper_expand_kernel, {"post_ptr": fp32, "comb_ptr": fp32, "block_ptr": bf16, "streams_ptr": bf16,
                                        "out_ptr": bf16, "H": "i32"}, {"N": 4, "BLOCK": 256}),
    "swiglu": (f._clamped_swiglu_kernel, {"gate_ptr": bf16, "up_ptr": bf16, "out_ptr": bf16, "width": "i32",
                                          "gate_stride": "i32", "up_stride": "i32", "limit": "fp32"}, {"BLOCK": 256}),
    "combine": (f._combine_kernel, {"slots_ptr": bf16, "weights_ptr": fp32, "shared_ptr": bf16, "out_ptr": bf16,
                                    "H": "i32"}, {"TOP_K": 6, "SHARED": True, "BLOCK": 256}),
    "ordered_sum": (f._ordered_sum_kernel, {"x_ptr": bf16, "out_ptr": bf16, "outputs": "i32", "inner": "i32",
                                            "n": "i32"}, {"LEVELS": 13, "ROWS": 1}),
    "engram_sums": (f._engram_sums_kernel, {"streams_ptr": bf16, "kv_ptr": bf16, "q_ptr": fp32, "k_ptr": fp32,
                                            "sums_ptr": fp32, "H": "i32", "N": "i32"}, {"LEVELS": 13}),
    "engram_out": (f._engram_out_kernel, {"streams_ptr": bf16, "kv_ptr": bf16, "sums_ptr": fp32, "out_ptr": bf16,
                                          "H": "i32", "inverse_h": "fp32", "eps": "fp32", "scale": "fp32",
                                          "floor": "fp32", "N": "i32"}, {"BLOCK": 1024}),
    "gate": (f._sqrtsoftplus_gate_kernel, {"logits_ptr": bf16, "bias_ptr": fp32, "chosen_ptr": "*i64",
                                            "indices_ptr": "*i64", "weights_ptr": bf16, "E": "i32", "scale": "fp32"},
             {"K": 6, "LEVELS": 3, "BLOCK_E": 512, "CHOSEN": False}),
    **{name: (f._argmax_kernel, {"values_ptr": fp32, "low_ptr": "*i64", "high_ptr": "*i64", "position_ptr": "*i64",
                                 "temperature_ptr": fp32, "out_ptr": "*i64", "V": "i32", "stride": "i32"},
              {"NOISE": noise, "TEMPERATURE": noise, "BLOCK": 2048})
       for name, noise in (("argmax", False), ("gumbel", True))},
    "paged_slots": (f._paged_slots_kernel, {**{name: "*i64" for name in ("table_ptr", "seq_ptr", "first_ptr", "limit_ptr",
                                                                          "slots_ptr")},
                                            "keep_ptr": "*i8", "valid_ptr": "*i8", "N": "i32", "W": "i32",
                                            "table_width": "i32", "block_size": "i32", "last_row": "i32",
                                            "offset": "i32", "null_slot": "i32"},
                    {"HAS_FIRST": True, "HAS_KEEP": True, "HAS_LIMIT": True, "ROWS": 16, "COLS": 64}),
    "paged_window_pool": (triton_ops._window_pool_kernel, {"kv_ptr": bf16, "gate_ptr": bf16, "bias_ptr": fp32,
                                                            "out_ptr": fp32, "slots_ptr": "*i64", "valid_ptr": "*i8",
                                                            "S": "i32", "D": "i32", "row_stride": "i32",
                                                            "bias_stride": "i32"},
                          {"PAGED": True, "OVERLAP": True, "HAS_BIAS": True, "BLOCK_D": 128}),
    "indexer": (triton_ops._indexer_kernel, {"q_ptr": bf16, "keys_ptr": bf16, "slots_ptr": "*i64", "w_ptr": fp32,
                                             "valid_ptr": "*i8", "out_ptr": fp32, "H": "i32", "S": "i32", "D": "i32",
                                             "key_stride": "i32", "scale": "fp32", "weight_scale": "fp32"},
                {"PAGED": True, "BLOCK_S": triton_ops.KV_BLOCK, "BLOCK_D": 128}),
    "ascending_topk": (f._ascending_topk_kernel, {"scores_ptr": fp32, "chosen_ptr": "*i64", "out_ptr": "*i64",
                                                  "good_ptr": "*i8", "W": "i32", "K": "i32", "stride": "i32"},
                       {"BLOCK": 512}),
    "engram_rows": (f._engram_rows_kernel, {**{name: "*i64" for name in ("compressed_ptr", "query_start_ptr",
                                                                        "lookback_ptr", "multipliers_ptr", "primes_ptr",
                                                                        "offsets_ptr", "out_ptr")},
                                            "T": "i32", "B": "i32", "H": "i32", "J": "i32"},
                    {"N": 3, "ROWS": 16, "BLOCK_B": 256, "BLOCK_J": 16}),
    "closing_tokens": (f._closing_tokens_kernel, {"pos_ptr": "*i64", "real_ptr": "*i8", "token_ptr": "*i64",
                                                  "used_ptr": "*i8", "window_ptr": "*i64", "T": "i32", "ratio": "i32",
                                                  "capacity": "i32"}, {"BLOCK": 1024}),
    **{fmt: (f._cache_qdq_kernel, {"x_ptr": bf16, "out_ptr": bf16, "width": "i32", "x_stride": "i32"},
             {"FORMAT": fmt, "GROUP": group, "BLOCK": f.QDQ_BLOCK}) for fmt, group in f.QDQ_FORMATS.items()},
}
for name, (fn, signature, constexprs) in kernels.items():
    contracted = {fusion: "fma.rn.f32" in compile_kernel(fn, signature, constexprs, enable_fp_fusion=fusion)
                  for fusion in (False, True)}
    print(name, contracted[False], contracted[True])
"""


def test_fused_kernels_compile_for_hopper_without_contraction():
    """No fused multiply-add where the op chain rounds a product before adding (rotary, the collapse
    and mixing sums, Engram's sums, the combine, the cache formats) or where one kernel repeats another's
    bits (the norm's, inside the collapsed norm); in rotary and the expansion the compiler does fuse
    them when allowed, so the option is what keeps their bits. (The rotary table, the coefficients,
    SwiGLU, the router, Engram's gates and the Gumbel draw are left out: libdevice's exp, log, log1p,
    rsqrt, cos and sin use FMAs by design; they are compiled here all the same, with the experts'
    routing, the argmax and the caches' integer slot arithmetic, Engram's hashing, the indexer's
    reordering; and the compressors' pooling through state slots and the indexer's scores, `triton_ops`
    kernels whose bits are their own.) Engram's sums are compiled at V4.1-Flash's width: an 8192-leaf tree."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    helper = COMPILE.split("results = []")[0]
    done = subprocess.run([sys.executable, "-c", FUSED], input=helper, capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    contracted = {name: (off == "True", on == "True") for name, off, on in
                  (line.split() for line in done.stdout.strip().splitlines())}
    formats = ("fp8_ue8m0", "mxfp4", "nvfp4")
    assert set(contracted) == {"rotary", "rotary_table", "coefficients", "rms_norm", "collapsed_norm", "collapse",
                               "expand", "swiglu", "combine",
                               "ordered_sum", "gate", "route", "argmax", "gumbel", "paged_slots", "closing_tokens",
                               "paged_window_pool", "indexer", "ascending_topk", "engram_rows", "engram_sums",
                               "engram_out",
                               *formats}
    assert not any(contracted[name][0] for name in ("rotary", "rms_norm", "collapsed_norm", "collapse", "expand",
                                                    "combine", "ordered_sum", "engram_sums", "route", "argmax",
                                                    *formats)), contracted
    assert contracted["rotary"][1] and contracted["expand"][1], contracted
