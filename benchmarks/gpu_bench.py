"""How fast the engine runs on a CUDA device, next to that device's ceilings: one command, one process,
one JSON (with the command and the device).

    python benchmarks/gpu_bench.py --preset flash-4l --out results.json

- ceilings: a device-to-device copy (bytes read plus written) and a bf16 cuBLAS matmul, measured here;
- kernels: the invariant Triton matmul (`kernels.triton_ops.linear`) against cuBLAS at the preset's
  decode (M = 1, 16) and prefill (M = 2048) shapes, rotating over enough weight copies that L2 holds
  none of them, each replayed from a CUDA graph (GPU time, as inside the engine's graphs);
- decode: ms per decode step at each batch size after prompts of each `--contexts` length (larger
  contexts at the batch sizes whose prompts total at most `--context-tokens`), `--steps` steps run
  back to back as in serving, under each engine setup of `SETUPS` (batch-invariant with CUDA graphs
  and async scheduling, without async, eager; fast with graphs and async, and eager), with the fraction
  of that time the GPU sat idle between steps (CUDA events: from the end of a step's queued work to the
  first copy of the next),
  and, from one more step, the kernels, launches and host syncs per step; at batch 1 the HBM
  roofline: the bytes a step must read (every weight but the embedding table and the routed
  experts, the embedding rows, the expected routed experts, the caches) over the measured copy
  bandwidth;
- prefill: tokens/s of 8 prompts of 2048 tokens and of one 32768-token prompt, in steps of at most
  `--prefill-step-tokens` (16384), both numerics modes;
- transformers: its own eager model on the same weights (`transformers_bench.py`), decode at batch
  1 and 64 after prompts of the first context and the 8 x 2048 prefill, as ratios to ours.
The preset's seeded random weights are built on the device, once per numerics mode.

    python benchmarks/gpu_bench.py --merge invariant.json fast.json transformers.json --out results.json

merges reports of one preset and device made by separate runs (a device's time per command is
limited: `--modes`, `--skip`, and `transformers_bench.py` on its own), keeping each one's command,
and summarizes them together.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import triton
from torch.nn import functional as F

import transformers_bench
from decode_step_profile import decoding_engine, engine_config, profiled_step, synced_step
from deepinfer import LLM, NUMERICS, SamplingParams
from deepinfer.kernels import triton_ops
from deepinfer.kernels.quant import QuantizedWeight

PREFILLS = ((8, 2048), (1, 32768))
T = TypeVar("T")
# engine setups timed per numerics mode: name -> settings
SETUPS = {
    "batch_invariant": {"graphs+async": {}, "graphs": {"async_scheduling": False},
                        "eager+async": {"cuda_graphs": False}},
    "fast": {"graphs+async": {}, "eager+async": {"cuda_graphs": False}},
}


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


def stepped(llm: LLM, steps: int) -> dict:
    """`steps` decode steps run back to back (the host waits only for results, as in serving): ms per
    step, and the fraction of the GPU's time spent idle between steps, from CUDA events recorded
    after each step's work is queued and once the next step's batch is built, before its first copy."""
    built, ended = [], []
    build, execute = llm.runner.build_batch, llm.runner.execute

    def marked(fn, events):
        def call(*args, **kwargs):
            result = fn(*args, **kwargs)
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
            return result
        return call

    llm.runner.build_batch, llm.runner.execute = marked(build, built), marked(execute, ended)
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            llm.step()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    finally:
        del llm.runner.build_batch, llm.runner.execute
    gaps = [end.elapsed_time(begin) for end, begin in zip(ended, built[1:])]
    busy_span = built[0].elapsed_time(ended[-1])
    return {"step_ms": round(1e3 * seconds / steps, 3), "gpu_idle_between_steps": round(sum(gaps) / busy_span, 4),
            "gap_ms_median": round(statistics.median(gaps), 4)}


def release() -> None:
    """Give dropped engines' caches and graph pools back to the device before the next one is built."""
    gc.collect()
    torch.cuda.empty_cache()


def fitting(run: Callable[[int], T], step_tokens: int, what: str) -> tuple[T, int]:
    """`run(step_tokens)`, the step budget halved while the device runs out of memory (sparse
    attention gathers its keys per token): what it returned and the budget that ran."""
    while True:
        try:
            return run(step_tokens), step_tokens
        except torch.OutOfMemoryError:
            if step_tokens <= 1024:
                raise
        release()  # outside the handler: the failed run's frames (and its engine) are gone
        print(f"{what}: out of memory at {step_tokens}-token steps; halving", flush=True)
        step_tokens //= 2


def decode(model: LLM, batches: list[int], contexts: list[int], context_tokens: int, steps: int,
           step_tokens: int, setups: list[str] | None, rows: list[dict], save: Callable[[], None]) -> None:
    """ms per decode step of `model` (its numerics) at each batch size and context, under each setup (of
    `setups`, or all; prompts prefilled in steps of at most `step_tokens`), appended to `rows` (and
    `save`d) one by one."""
    for context in contexts:
        for batch in batches:
            if context != contexts[0] and batch * context > context_tokens:
                continue
            for setup, settings in SETUPS[model.numerics].items():
                if setups and setup not in setups:
                    continue
                llm, prefilled_in = fitting(
                    lambda budget: decoding_engine(model, batch, 2 * steps + 16, prompt_tokens=context,
                                                   max_num_batched_tokens=budget, **settings),
                    min(step_tokens, batch * context), f"decode batch {batch} context {context}")
                stepped(llm, 4)  # captures, compiles and the allocator settle
                graphs = len(llm.runner.graphs or {})
                row = {"numerics": model.numerics, "setup": setup, "batch": batch, "context": context,
                       **stepped(llm, steps)}
                row["graphs_captured_while_timed"] = len(llm.runner.graphs or {}) - graphs
                row["prefill_step_tokens"] = prefilled_in
                profile = profiled_step(llm)
                row.update(gpu_kernels=profile["gpu_kernels"], host_launch_calls=profile["host_launch_calls"],
                           gpu_kernel_ms=profile["gpu_kernel_ms"], host_syncs=len(synced_step(llm)),
                           top_kernels=profile["top_kernels"][:6])
                if len(llm.scheduler.running) != batch:  # a smaller batch ran in some measured step
                    raise RuntimeError(f"decode batch {batch}: only {len(llm.scheduler.running)} sequences were "
                                       f"still decoding after the measured steps")
                row["gib_allocated"] = round(torch.cuda.memory_allocated() / 2**30, 1)
                rows.append(row)
                save()
                print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
                del llm
                release()


def prefill(model: LLM, count: int, length: int, step_tokens: int) -> dict:
    """Tokens/s of `count` prompts of `length` tokens, computed in as few steps of at most
    `step_tokens` tokens as fit (the second of two runs: the first compiles; `fitting` halves a
    budget that runs out of memory, and the row says which ran)."""
    return fitting(lambda budget: prefill_at(model, count, length, budget), step_tokens,
                   f"prefill {count}x{length}")[0]


def prefill_at(model: LLM, count: int, length: int, step_tokens: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    seconds = []
    for _ in range(2):
        llm = model.with_engine(engine_config(model.engine_config.dtype, model.numerics, count, length,
                                              max_num_batched_tokens=min(step_tokens, count * length)))
        prompts = [torch.randint(16, 4000, (length,), generator=gen).tolist() for _ in range(count)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        del llm
        release()
    return {"numerics": model.numerics, "prompts": count, "prompt_tokens": length,
            "step_tokens": min(step_tokens, count * length), "tokens_per_s": round(count * length / seconds[-1], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="flash-4l")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4000, 32000],
                        help="prompt tokens before the timed decode steps")
    parser.add_argument("--context-tokens", type=int, default=300_000,
                        help="beyond the first context, the most prompt tokens one configuration prefills")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per configuration")
    parser.add_argument("--prefill-step-tokens", type=int, default=16384,
                        help="step budget of every prefill, timed or before decode (halved where it runs out of memory)")
    parser.add_argument("--skip", nargs="*", default=[], choices=["kernels", "decode", "prefill", "transformers"])
    parser.add_argument("--modes", nargs="+", default=list(NUMERICS), choices=NUMERICS)
    parser.add_argument("--setups", nargs="+", choices=sorted({s for mode in SETUPS.values() for s in mode}),
                        help="decode only under these engine setups (default: every one of SETUPS)")
    parser.add_argument("--merge", nargs="+", metavar="REPORT", help="merge these reports instead of measuring")
    args = parser.parse_args()
    out = Path(args.out)
    if args.merge:
        report = merged([json.loads(Path(path).read_text()) for path in args.merge])
        summarize(report)
        out.write_text(json.dumps(report, indent=1))
        return
    report = {"command": "python " + " ".join(a if a != args.out else out.name for a in sys.argv),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "preset": args.preset, "dtype": args.dtype, "ceilings": ceilings()}
    print(json.dumps(report["ceilings"]), flush=True)
    for numerics in args.modes:
        model = LLM(f"preset:{args.preset}", engine_config(args.dtype, numerics, 1))
        if numerics == "batch_invariant" and "kernels" not in args.skip:
            report["kernels"] = kernels(model.config)
        if "prefill" not in args.skip:  # first: its long steps need the most memory
            for count, length in PREFILLS:
                report.setdefault("prefill", []).append(prefill(model, count, length, args.prefill_step_tokens))
                print(json.dumps(report["prefill"][-1]), flush=True)
        if "decode" not in args.skip:
            decode(model, args.batches, args.contexts, args.context_tokens, args.steps, args.prefill_step_tokens,
                   args.setups, report.setdefault("decode", []), lambda: out.write_text(json.dumps(report, indent=1)))
        if numerics == "batch_invariant":
            step_bytes = decode_bytes(model.model, 1, args.contexts[0])
            report["roofline_batch1"] = {"bytes_per_step": step_bytes,
                                         "ms": round(step_bytes / report["ceilings"]["copy_tb_s"] / 1e9, 3)}
        del model
        release()
        out.write_text(json.dumps(report, indent=1))  # after each mode: a later failure keeps this one
    if "transformers" not in args.skip:
        report["transformers"] = transformers_bench.measure(args.preset, [1, 64], args.contexts[0], args.steps,
                                                            args.dtype)
    summarize(report)
    out.write_text(json.dumps(report, indent=1))


def merged(reports: list[dict]) -> dict:
    """One report of several runs on one preset and device (a `transformers_bench` report becomes the
    `transformers` section); measurements of the same thing in two runs are refused."""
    for key in ("preset", "device"):
        if len({r[key] for r in reports}) > 1:
            raise SystemExit(f"--merge: the reports differ in {key}: {sorted({r[key] for r in reports})}")
    report = {"commands": [r["command"] for r in reports]}
    for part in reports:
        if isinstance(part.get("transformers"), str):  # transformers_bench.py's own report
            part = {"transformers": {k: v for k, v in part.items() if k not in ("command", "device")}}
        for key, value in part.items():
            if key in ("command", "summary"):  # the summary is made again from the merged rows
                continue
            if key in ("decode", "prefill"):
                report.setdefault(key, []).extend(value)
            elif key not in report or key in ("ceilings", "roofline_batch1", "torch", "triton", "dtype", "device",
                                               "preset"):  # the device's and the preset's: the first run's
                report.setdefault(key, value)
            else:
                raise SystemExit(f"--merge: two reports have {key!r}")
    return report


def summarize(report: dict) -> None:
    """Ratios the issue asks for: invariant vs fast, async and graphs vs without, batch 1 against the
    roofline, per context."""
    steps = {(r["numerics"], r["setup"], r["batch"], r["context"]): r for r in report.get("decode", [])}
    summary = {}
    for (numerics, setup, batch, context), row in steps.items():
        if (numerics, setup) != ("batch_invariant", "graphs+async"):
            continue
        ms = row["step_ms"]
        entry = {"invariant_ms": ms, "gpu_idle_between_steps": row["gpu_idle_between_steps"]}
        if fast := steps.get(("fast", "graphs+async", batch, context)):
            entry.update(fast_ms=fast["step_ms"], invariant_over_fast=round(ms / fast["step_ms"], 3))
        for other, key in (("graphs", "sync_over_async"), ("eager+async", "eager_over_graphs")):
            if theirs := steps.get(("batch_invariant", other, batch, context)):
                entry[key] = round(theirs["step_ms"] / ms, 3)
        if other_idle := steps.get(("batch_invariant", "graphs", batch, context)):
            entry["gpu_idle_between_steps_sync"] = other_idle["gpu_idle_between_steps"]
        summary[f"batch {batch}, context {context}"] = entry
    first = f"batch 1, context {min((key[3] for key in steps), default=0)}"
    if "roofline_batch1" in report and first in summary:
        summary[first]["of_roofline"] = round(report["roofline_batch1"]["ms"] / summary[first]["invariant_ms"], 3)
    rates = {(r["numerics"], r["prompts"], r["prompt_tokens"]): r["tokens_per_s"] for r in report.get("prefill", [])}
    for count, length in PREFILLS:
        if ("fast", count, length) in rates and ("batch_invariant", count, length) in rates:
            summary[f"prefill {count}x{length} invariant_over_fast_time"] = round(
                rates[("fast", count, length)] / rates[("batch_invariant", count, length)], 3)
    theirs = report.get("transformers")
    if theirs:
        for row in theirs["decode"]:
            ours = steps.get(("batch_invariant", "graphs+async", row["batch"], theirs["context"]))
            if ours:
                summary[f"batch {row['batch']}, context {theirs['context']}"]["speedup_over_transformers"] = round(
                    row["step_ms"] / ours["step_ms"], 2)
        count, length = transformers_bench.PREFILL
        if ("batch_invariant", count, length) in rates:
            summary[f"prefill {count}x{length} invariant_over_transformers_speed"] = round(
                rates[("batch_invariant", count, length)] / theirs["prefill"]["tokens_per_s"], 2)
    report["summary"] = summary
    print(json.dumps(summary, indent=1), flush=True)


if __name__ == "__main__":
    main()
