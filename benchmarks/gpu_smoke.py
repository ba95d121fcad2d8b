"""The engine on a CUDA device: bf16 batched greedy generation on `small` and `flash-4l`.

    python benchmarks/gpu_smoke.py --out results.json

Weights are the presets' seeded random weights built straight on the GPU (nothing on disk).
Reports build time, memory, prefill/decode throughput, and for `small` how many greedy tokens
bf16 shares with fp32 on the same device.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from deepinfer import LLM, SamplingParams


def run(preset: str, dtype: str, prompts: list[list[int]], new_tokens: int, **engine) -> dict:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    llm = LLM(f"preset:{preset}", device="cuda", dtype=dtype, **engine)
    torch.cuda.synchronize()
    built = time.perf_counter() - start
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "preset": preset, "dtype": dtype, "batch": len(prompts), "prompt_tokens": prompt_tokens,
        "new_tokens_each": new_tokens, "build_s": round(built, 2), "generate_s": round(elapsed, 3),
        "tokens_per_s": round((prompt_tokens + len(prompts) * new_tokens) / elapsed, 1),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "outputs": [o.token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--skip-flash", action="store_true")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 17, 33, 64, 100, 129, 200, 300]
    small_prompts = [torch.randint(16, 4000, (n,), generator=gen).tolist() for n in lengths * 2]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
    bf16 = run("small", "bfloat16", small_prompts, 32, max_num_seqs=16)
    fp32 = run("small", "float32", small_prompts, 32, max_num_seqs=16)
    shared = [sum(1 for _ in itertools.takewhile(lambda ab: ab[0] == ab[1], zip(a, b)))
              for a, b in zip(bf16["outputs"], fp32["outputs"])]
    report["small_bf16_vs_fp32_common_prefix"] = shared
    report["runs"] += [bf16, fp32]
    print(json.dumps({k: v for k, v in bf16.items() if k != "outputs"}), flush=True)
    print(json.dumps({k: v for k, v in fp32.items() if k != "outputs"}), flush=True)
    print("bf16 vs fp32 greedy common prefix per request:", shared, flush=True)
    if not args.skip_flash:
        flash_prompts = [torch.randint(16, 4000, (n,), generator=gen).tolist() for n in lengths]
        flash = run("flash-4l", "bfloat16", flash_prompts, 16, max_num_seqs=8, max_model_len=1024)
        report["runs"].append(flash)
        print(json.dumps({k: v for k, v in flash.items() if k != "outputs"}), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
