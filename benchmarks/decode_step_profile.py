"""What one decode step costs on a CUDA device: wall time, kernel launches and host syncs.

    python benchmarks/decode_step_profile.py --out results.json [--preset flash-4l] [--batches 1 64]
    python benchmarks/decode_step_profile.py --out results.json --preset v41-flash-5l --speculation off dspark

For each batch size B the engine gets B requests (64-token prompts, greedy, no stop), steps until
every one of them is decoding, then (reading each step's results before the next: no async
scheduling, so a step's costs are its own):
- times `--steps` decode steps one by one (synchronised; median and min reported);
- profiles one decode step with torch.profiler and counts what ran on the GPU (kernels, memcpy,
  memset) and the host-side launch calls;
- counts the device->host synchronisations of one decode step with
  `torch.cuda.set_sync_debug_mode("warn")` (each synchronising call warns once);
- times the model forward of one decode step eagerly and replayed as a CUDA graph
  (`deepinfer.engine.graph.StepGraph`), interleaved, to show what capture would buy the step;
- profiles that forward once more, eagerly, and credits each kernel to the innermost model module
  (by class) whose forward launched it: where the launches and the GPU time of a step go.
Weights are the preset's seeded random weights built on the GPU. With `--speculation` naming drafters,
each batch is profiled once per drafter, every step drafting `--draft-tokens` tokens and verifying them
all (`verify_policy="fixed"`): what a speculative step costs against a plain one (random weights: the
drafts fail, so each step keeps one token). The forward-only timings are of plain steps only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from deepinfer import LLM, NUMERICS, EngineConfig, SamplingParams
from deepinfer.engine.graph import StepGraph
from deepinfer.transfer import Download

PROMPT_TOKENS = 64
TOP_KERNELS = 15  # the kernels of one profiled step reported by total GPU time
# What each synchronising call warns (the mode's one-time "prototype feature" notice is not one).
SYNC_WARNING = "called a synchronizing CUDA operation"


def engine_config(dtype: str, numerics: str, batch: int, prompt_tokens: int = PROMPT_TOKENS, **settings) -> EngineConfig:
    """An engine for `batch` prompts of `prompt_tokens` (prefilled in steps of at most 16384 tokens)."""
    values = {"max_num_seqs": max(batch, 1), "max_model_len": max(1024, 2 * prompt_tokens),
              "max_num_batched_tokens": min(16384, max(512, batch * prompt_tokens)), **settings}
    return EngineConfig(device="cuda", dtype=dtype, numerics=numerics, **values)


def decoding_engine(model: LLM, batch: int, new_tokens: int, prompt_tokens: int = PROMPT_TOKENS,
                    **settings) -> LLM:
    """An engine over `model`'s weights (and `settings`) with `batch` requests, stepped until every one
    is decoding; each can then decode `new_tokens` more before any finishes. The prompts are prefilled
    a step budget at a time and the first ones decode while the last prefill, so each request may
    draw a token per prefill step on top of `new_tokens`: a request finishing early would shrink the
    batch (and its step shapes) while it is timed."""
    llm = model.with_engine(engine_config(model.engine_config.dtype, model.numerics, batch, prompt_tokens,
                                          **settings))
    prefill_steps = -(-batch * prompt_tokens // llm.max_num_batched_tokens)
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=new_tokens + prefill_steps, ignore_eos=True)
    for _ in range(batch):
        llm.add_request(torch.randint(16, 4000, (prompt_tokens,), generator=gen).tolist(), params)
    while any(len(seq.output_token_ids) == 0 for seq in llm.scheduler.running) or llm.scheduler.waiting:
        llm.step()
    return llm


def timed_steps(llm: LLM, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def profiled_step(llm: LLM) -> dict:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.step()
        torch.cuda.synchronize()
    kernels = memcpy = memset = launches = 0
    kernel_us: dict[str, list[float]] = {}
    for event in prof.events():
        name = event.name
        if event.device_type == torch.autograd.DeviceType.CUDA:
            if "memcpy" in name.lower():
                memcpy += 1
            elif "memset" in name.lower():
                memset += 1
            else:
                kernels += 1
                kernel_us.setdefault(name, []).append(event.time_range.elapsed_us())
        elif name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx"):
            launches += 1
    by_time = sorted(kernel_us.items(), key=lambda item: -sum(item[1]))
    top = [{"kernel": name[:120], "calls": len(us), "total_us": round(sum(us), 1)} for name, us in by_time[:TOP_KERNELS]]
    return {"gpu_kernels": kernels, "gpu_memcpy": memcpy, "gpu_memset": memset, "host_launch_calls": launches,
            "gpu_kernel_ms": round(sum(map(sum, kernel_us.values())) / 1e3, 3), "top_kernels": top}


def synced_step(llm: LLM) -> list[str]:
    """Where (file:line of the Python call) each synchronisation of one decode step happened: the
    synchronising calls torch warns of, and the wait for the step results' copy (an event, which
    torch does not report)."""
    torch.cuda.synchronize()
    waits, wait = [], Download.wait
    Download.wait = lambda download: waits.append("deepinfer/transfer.py:Download.wait") or wait(download)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            Download.wait = wait
    root = str(Path(__file__).resolve().parent.parent) + "/"
    return [f"{w.filename.replace(root, '')}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)] + waits


MODULE_SCOPE = "module::"
UNCREDITED = "(not credited: Triton launches)"


def module_census(models: list[torch.nn.Module], forward) -> list[dict]:
    """Kernels (count and GPU µs) of one eager `forward()` per innermost module class of `models`
    whose PyTorch ops launched them ("(model)" outside every module), and those no op launched
    (Triton's), largest GPU time first."""
    scopes: dict[torch.nn.Module, list] = {}

    def enter(module, _args):
        scopes.setdefault(module, []).append(record_function(MODULE_SCOPE + type(module).__name__).__enter__())

    def leave(module, _args, _out):
        scopes[module].pop().__exit__(None, None, None)

    hooks = [h for model in models for m in model.modules()
             for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            forward()
            torch.cuda.synchronize()
    finally:
        for hook in hooks:
            hook.remove()
    totals: dict[str, list[float]] = {}
    device = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for event in prof.events():
        if not event.kernels:
            continue
        owner = event
        while owner is not None and not owner.name.startswith(MODULE_SCOPE):
            owner = owner.cpu_parent
        name = owner.name[len(MODULE_SCOPE):] if owner is not None else "(model)"
        entry = totals.setdefault(name, [0, 0.0])
        entry[0] += len(event.kernels)
        entry[1] += sum(kernel.duration for kernel in event.kernels)
    credited = sum(count for count, _ in totals.values()), sum(us for _, us in totals.values())
    # Triton's launches are not linked to a PyTorch op, so their kernels are not credited to a module
    totals[UNCREDITED] = [len(device) - credited[0], sum(e.time_range.elapsed_us() for e in device) - credited[1]]
    rows = [{"module": name, "kernels": count, "gpu_us": round(us, 1)} for name, (count, us) in totals.items()]
    return sorted(rows, key=lambda row: -row["gpu_us"])


def forward_times(llm: LLM, repeats: int) -> dict:
    """Median ms of the next decode step's model forward, eager and replayed from a CUDA graph
    (interleaved; both rewrite the same cache rows with the same values)."""
    scheduled = llm.scheduler.schedule()
    batch, _ = llm.runner.build_batch(scheduled.chunks)[0].to(llm.runner.device)
    graph = StepGraph(llm.model, llm.cache.layer_views, batch)
    eager, replayed = [], []
    for _ in range(repeats):
        for times, run in ((eager, lambda: llm.model(batch, llm.cache.layer_views)), (replayed, lambda: graph.replay(batch))):
            torch.cuda.synchronize()
            start = time.perf_counter()
            run()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    census = module_census([llm.model], lambda: llm.model(batch, llm.cache.layer_views))
    llm.scheduler.update(scheduled, llm.runner.execute(scheduled).result(scheduled))
    return {"forward_ms_eager": round(1e3 * statistics.median(eager), 3),
            "forward_ms_graph": round(1e3 * statistics.median(replayed), 3), "kernels_by_module": census}


def step_census(llm: LLM) -> list[dict]:
    """`module_census` of one whole engine step run eagerly (no graph replay hides the modules), the
    device drafter's modules credited beside the target's: where a speculative step's time goes."""
    drafter = getattr(llm.runner.drafts, "draft", None) or getattr(llm.runner.drafts, "mtp", None)
    graphs, llm.runner.graphs = llm.runner.graphs, None
    try:
        return module_census([llm.model, *([drafter] if drafter is not None else [])], llm.step)
    finally:
        llm.runner.graphs = graphs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--preset", default="flash-4l")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--label", default="")
    parser.add_argument("--numerics", nargs="+", default=["batch_invariant"], choices=NUMERICS)
    parser.add_argument("--speculation", nargs="+", default=["off"], help="off and drafters, each profiled per batch")
    parser.add_argument("--draft-tokens", type=int, default=5)
    args = parser.parse_args()
    command = [arg if arg != args.out else Path(args.out).name for arg in sys.argv]
    report = {"command": " ".join(["python"] + command), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "preset": args.preset, "dtype": args.dtype, "label": args.label,
              "prompt_tokens": PROMPT_TOKENS, "runs": []}
    for numerics in args.numerics:
        model = LLM(f"preset:{args.preset}", engine_config(args.dtype, numerics, 1))  # built once per mode
        for batch, speculation in ((b, s) for b in args.batches for s in args.speculation):
            # a speculative step keeps up to 1 + draft_tokens tokens: room for that many in every step
            per_step = 1 if speculation == "off" else 1 + args.draft_tokens
            llm = decoding_engine(model, batch, new_tokens=(args.steps + 8) * per_step, async_scheduling=False,
                                  speculation=speculation, draft_tokens=args.draft_tokens, verify_policy="fixed")
            timed_steps(llm, 2)  # warm-up (autotuning, allocator)
            times = timed_steps(llm, args.steps)
            run = {"numerics": numerics, "batch": batch, "speculation": speculation,
                   "step_ms_median": round(1e3 * statistics.median(times), 3),
                   "step_ms_min": round(1e3 * min(times), 3), **profiled_step(llm)}
            sites = synced_step(llm)
            run.update(host_syncs=len(sites), host_sync_sites=sites)
            # fast mode's MoE reads expert counts on the host: not capturable
            if numerics == "batch_invariant" and speculation == "off":
                run.update(forward_times(llm, args.steps))
            elif speculation != "off":
                run["step_kernels_by_module"] = step_census(llm)
            report["runs"].append(run)
            Path(args.out).write_text(json.dumps(report, indent=2))  # after every run: a later failure keeps it
            print(json.dumps({key: value for key, value in run.items() if key not in ("top_kernels", "kernels_by_module", "step_kernels_by_module")}),
                  flush=True)
            for row in run.get("kernels_by_module", run.get("step_kernels_by_module", [])):
                print("   ", row, flush=True)
            for kernel in run["top_kernels"][:8]:
                print("   ", kernel, flush=True)
            del llm
            torch.cuda.empty_cache()
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
