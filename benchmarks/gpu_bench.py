"""How fast the engine runs on a CUDA device, next to that device's ceilings: one command, one process,
one JSON (with the command and the device).

    python benchmarks/gpu_bench.py --preset flash-4l --out results.json

- ceilings: a device-to-device copy (bytes read plus written) and a bf16 cuBLAS matmul, measured here;
- kernels: the invariant Triton matmul (`kernels.triton_ops.linear`) against cuBLAS at the preset's
  decode (M = 1, 16) and prefill (M = 2048) shapes, rotating over enough weight copies that L2 holds
  none of them, each replayed from a CUDA graph (GPU time, as inside the engine's graphs);
- decode: ms per decode step at each batch size after `--context`-token prompts, batch-invariant with
  CUDA graphs, batch-invariant eager and fast (ratios to the first), with kernel launches and host
  syncs per step; at batch 1 the HBM roofline: the bytes a step must read (every weight but the
  embedding table and the routed experts, the embedding rows, the expected routed experts, the
  caches) over the measured copy bandwidth;
- prefill: tokens/s of 8 prompts of 2048 tokens in one step, both numerics modes.
The preset's seeded random weights are built on the device, once per numerics mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
from torch.nn import functional as F

from decode_step_profile import decoding_engine, engine_config, profiled_step, synced_step, timed_steps
from deepinfer import LLM, NUMERICS, SamplingParams
from kernels import triton_ops
from kernels.quant import QuantizedWeight

PREFILL = (8, 2048)


def timed_ms(fn, inputs: list[tuple]) -> float:
    """Median ms per call of fn(*inputs[i]), the inputs in turn: the calls are captured in one CUDA graph
    and its replays timed with CUDA events (triton's do_bench), so launch gaps do not count."""
    for args in inputs:  # compile and autotune outside the capture
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in inputs:
            fn(*args)
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median") / len(inputs)


def ceilings() -> dict:
    """Timed directly (a captured copy becomes a copy-engine node, slower than the copy kernel)."""
    src = torch.randn(2**29 // 2, device="cuda")  # 1 GiB of fp32 (random: never time on zeros)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    matmul_ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=100, return_mode="median")
    return {"copy_tb_s": round(2 * src.numel() * 4 / copy_ms / 1e9, 3),
            "bf16_matmul_tflop_s": round(2 * 8192**3 / matmul_ms / 1e9, 1)}


def kernel_shapes(config) -> dict[str, tuple[int, int, torch.dtype]]:
    """(N, K, dtype) of the preset's matmuls, by name."""
    h, heads, d, groups = config.hidden_size, config.num_attention_heads, config.head_dim, config.o_groups
    mix = (2 + config.hc_mult) * config.hc_mult
    return {
        "wq_a": (config.q_lora_rank, h, torch.bfloat16),
        "wq_b": (heads * d, config.q_lora_rank, torch.bfloat16),
        "wo_b": (h, groups * config.o_lora_rank, torch.bfloat16),
        "expert w13": (2 * config.moe_intermediate_size, h, torch.bfloat16),
        "hc_fn (fp32)": (mix, config.hc_mult * h, torch.float32),
        "head": (config.vocab_size, h, torch.bfloat16),
    }


def kernels(config) -> list[dict]:
    rows = []
    for name, (n, k, dtype) in kernel_shapes(config).items():
        weight_bytes = n * k * dtype.itemsize
        copies = max(2, min(8, int(256e6 // weight_bytes) + 1))
        for m in (1, 16, 2048):
            inputs = [(torch.randn(m, k, device="cuda", dtype=dtype), torch.randn(n, k, device="cuda", dtype=dtype))
                      for _ in range(copies)]
            ours, cublas = timed_ms(triton_ops.linear, inputs), timed_ms(F.linear, inputs)
            moved = weight_bytes + (m * k + m * n) * dtype.itemsize
            rows.append({"matmul": name, "M": m, "N": n, "K": k, "dtype": str(dtype).removeprefix("torch."),
                         "ours_ms": round(ours, 4), "cublas_ms": round(cublas, 4), "vs_cublas": round(cublas / ours, 3),
                         "ours_tb_s": round(moved / ours / 1e9, 3), "ours_tflop_s": round(2 * m * n * k / ours / 1e9, 1)})
            print(json.dumps(rows[-1]), flush=True)
            del inputs
    return rows


def decode_bytes(model, batch: int, context: int) -> int:
    """Bytes a decode step of `batch` sequences at `context` tokens must read at least: every weight
    except the embedding tables (the token embedding, V4.1's Engram tables) and the routed experts,
    the table rows the tokens look up, each routed expert that some token is expected to pick
    (uniform routing), and the cache rows attention reads (window and compressed entries, at most
    one per token of context)."""
    config = model.config
    lookups = (getattr(config, "engram_max_ngram_size", 2) - 1) * getattr(config, "engram_n_heads", 1)
    dense = routed = rows = 0
    for name, module in model.named_modules():
        tensors = list(module.named_parameters(recurse=False))
        tensors += [(attr, value) for attr, value in vars(module).items() if isinstance(value, QuantizedWeight)]
        for attr, value in tensors:
            parts = (value.data, value.scale) if isinstance(value, QuantizedWeight) else (value,)
            size = sum(t.numel() * t.element_size() for t in parts)
            if name.endswith("experts") and attr in ("w13", "w2"):
                routed += size
            elif name.split(".")[-1] in ("embed", "embed_tokens"):  # tables: only the looked-up rows
                per_token = 1 if name in ("embed", "model.embed_tokens") else lookups
                rows += size / value.shape[0] * per_token * batch
            else:
                dense += size
    experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    expected = experts * (1 - (1 - top_k / experts) ** batch)
    cache = batch * context * config.num_hidden_layers * config.head_dim * 2
    return int(dense + rows + routed * expected / experts + cache)


def decode(model: LLM, batches: list[int], context: int, steps: int) -> list[dict]:
    """ms per decode step of `model` (its numerics) at each batch size, graphs on and (invariant) off."""
    rows = []
    graph_modes = (True, False) if model.numerics == "batch_invariant" else (False,)
    for batch in batches:
        for graphs in graph_modes:
            llm = decoding_engine(model, batch, steps + 8, prompt_tokens=context, cuda_graphs=graphs)
            timed_steps(llm, 2)
            times = timed_steps(llm, steps)
            row = {"numerics": model.numerics, "cuda_graphs": graphs, "batch": batch, "context": context,
                   "step_ms": round(1e3 * statistics.median(times), 3)}
            profile = profiled_step(llm)
            row.update(gpu_kernels=profile["gpu_kernels"], host_launch_calls=profile["host_launch_calls"],
                       gpu_kernel_ms=profile["gpu_kernel_ms"], host_syncs=len(synced_step(llm)),
                       top_kernels=profile["top_kernels"][:6])
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
            del llm
            torch.cuda.empty_cache()
    return rows


def prefill(model: LLM) -> dict:
    """Tokens/s of PREFILL prompts computed in one step (the second of two runs: the first compiles)."""
    count, length = PREFILL
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    seconds = []
    for _ in range(2):
        llm = model.with_engine(engine_config(model.engine_config.dtype, model.numerics, count, length,
                                              max_num_batched_tokens=count * length))
        prompts = [torch.randint(16, 4000, (length,), generator=gen).tolist() for _ in range(count)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        del llm
    return {"numerics": model.numerics, "prompts": count, "prompt_tokens": length,
            "tokens_per_s": round(count * length / seconds[-1], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="flash-4l")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--context", type=int, default=512, help="prompt tokens before the timed decode steps")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps per configuration")
    parser.add_argument("--skip", nargs="*", default=[], choices=["kernels", "decode", "prefill"])
    parser.add_argument("--modes", nargs="+", default=list(NUMERICS), choices=NUMERICS)
    args = parser.parse_args()
    out = Path(args.out)
    report = {"command": "python " + " ".join(a if a != args.out else out.name for a in sys.argv),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "preset": args.preset, "dtype": args.dtype, "ceilings": ceilings()}
    print(json.dumps(report["ceilings"]), flush=True)
    for numerics in args.modes:
        model = LLM(f"preset:{args.preset}", engine_config(args.dtype, numerics, 1))
        if numerics == "batch_invariant" and "kernels" not in args.skip:
            report["kernels"] = kernels(model.config)
        if "decode" not in args.skip:
            report.setdefault("decode", []).extend(decode(model, args.batches, args.context, args.steps))
        if "prefill" not in args.skip:
            report.setdefault("prefill", []).append(prefill(model))
            print(json.dumps(report["prefill"][-1]), flush=True)
        if numerics == "batch_invariant":
            step_bytes = decode_bytes(model.model, 1, args.context)
            report["roofline_batch1"] = {"bytes_per_step": step_bytes,
                                         "ms": round(step_bytes / report["ceilings"]["copy_tb_s"] / 1e9, 3)}
        del model
        torch.cuda.empty_cache()
        out.write_text(json.dumps(report, indent=1))  # after each mode: a later failure keeps this one
    summarize(report)
    out.write_text(json.dumps(report, indent=1))


def summarize(report: dict) -> None:
    """Ratios the issue asks for: invariant vs fast, graphs vs eager, batch 1 against the roofline."""
    steps = {(r["numerics"], r["cuda_graphs"], r["batch"]): r["step_ms"] for r in report.get("decode", [])}
    summary = {}
    for batch in sorted({b for _, _, b in steps}):
        graphs = steps.get(("batch_invariant", True, batch))
        if graphs is None:
            continue
        summary[f"batch {batch}"] = {
            "invariant_graphs_ms": graphs,
            "invariant_over_fast": round(graphs / steps[("fast", False, batch)], 3) if ("fast", False, batch) in steps else None,
            "eager_over_graphs": round(steps[("batch_invariant", False, batch)] / graphs, 3),
        }
    if "roofline_batch1" in report and "batch 1" in summary:
        summary["batch 1"]["of_roofline"] = round(report["roofline_batch1"]["ms"] / summary["batch 1"]["invariant_graphs_ms"], 3)
    prefill_rates = {r["numerics"]: r["tokens_per_s"] for r in report.get("prefill", [])}
    if len(prefill_rates) == 2:
        summary["prefill_invariant_over_fast_time"] = round(prefill_rates["fast"] / prefill_rates["batch_invariant"], 3)
    report["summary"] = summary
    print(json.dumps(summary, indent=1), flush=True)


if __name__ == "__main__":
    main()
