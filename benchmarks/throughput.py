"""Engine throughput: prefill and decode tokens/s at batch 1 and 32, in both numerics modes side
by side (same run: both engines warmed up, repetitions interleaved, the median counts), with the
batch-invariant / fast time ratio.

    .venv/bin/python benchmarks/throughput.py [--presets tiny small] [--out results.json]
    python benchmarks/throughput.py --device cuda --dtype bfloat16 --presets small flash-4l --out results.json

On CPU each preset's checkpoint is created once under $DEEPINFER_HOME/bench; on CUDA the preset's
seeded random weights are built on the GPU (nothing on disk). A step whose chunks are all one-token
decodes counts as decode time; every other step counts as prefill time.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from deepinfer import LLM, NUMERICS, SamplingParams
from deepinfer.checkpoint import create_checkpoint
from deepinfer.checkpoint.files import deepinfer_home


BATCHES = (1, 32)


def checkpoint_for(preset: str, device: str = "cpu"):
    if device != "cpu":
        return f"preset:{preset}"
    folder = deepinfer_home() / "bench" / f"{preset}-seed0"
    if not (folder / "config.json").is_file():
        create_checkpoint(preset, folder, seed=0)
    return folder


def measure(llm: LLM, batch: int, prompt_len: int, new_tokens: int) -> dict:
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for _ in range(batch):
        llm.add_request(torch.randint(2, llm.config.vocab_size, (prompt_len,), generator=gen).tolist(), params)
    totals = {"prefill": [0, 0.0], "decode": [0, 0.0]}
    while llm.has_unfinished():
        start = time.perf_counter()
        pending = list(llm.scheduler.running) + list(llm.scheduler.waiting)
        decoding = all(seq.num_uncomputed == 1 for seq in pending) and not llm.scheduler.waiting
        before = sum(seq.num_computed for seq in pending)
        llm.step()
        elapsed = time.perf_counter() - start
        after = sum(seq.num_computed for seq in pending)
        kind = totals["decode" if decoding else "prefill"]
        kind[0] += after - before
        kind[1] += elapsed
    return {kind: {"tokens": n, "seconds": round(s, 3), "tokens_per_s": round(n / s, 1) if s else None}
            for kind, (n, s) in totals.items()}


def median_run(runs: list[dict]) -> dict:
    """Per phase, the repetition with the median throughput."""
    return {kind: sorted((run[kind] for run in runs), key=lambda r: r["tokens_per_s"])[len(runs) // 2]
            for kind in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repetitions per mode; the median counts")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    results = {"command": "python " + " ".join(sys.argv), "torch": torch.__version__, "threads": torch.get_num_threads(),
               "machine": platform.machine(), "device": args.device, "dtype": args.dtype,
               "accelerator": torch.cuda.get_device_name() if args.device == "cuda" else None,
               "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "repeats": args.repeats, "runs": []}
    for preset in args.presets:
        engines = {numerics: LLM(checkpoint_for(preset, args.device), max_num_seqs=max(BATCHES),
                                 max_num_batched_tokens=2048, numerics=numerics, device=args.device,
                                 dtype=args.dtype) for numerics in NUMERICS}
        for llm in engines.values():  # warm-up: first-call allocations and library initialisation
            measure(llm, 1, 16, 2)
        for batch in BATCHES:
            samples = {numerics: [] for numerics in NUMERICS}
            for rep in range(args.repeats):  # interleaved, alternating which mode goes first
                for numerics in (NUMERICS if rep % 2 == 0 else NUMERICS[::-1]):
                    samples[numerics].append(measure(engines[numerics], batch, args.prompt_len, args.new_tokens))
            modes = {numerics: median_run(runs) for numerics, runs in samples.items()}
            ratio = {kind: round(modes["fast"][kind]["tokens_per_s"] / modes["batch_invariant"][kind]["tokens_per_s"], 2)
                     for kind in ("prefill", "decode")}
            results["runs"].append({"preset": preset, "batch": batch, **modes, "invariant_slowdown": ratio})
            for numerics, run in modes.items():
                print(f"{preset:6} batch {batch:3} {numerics:15}: prefill {run['prefill']['tokens_per_s']:>9} tok/s   "
                      f"decode {run['decode']['tokens_per_s']:>8} tok/s", flush=True)
            print(f"{preset:6} batch {batch:3} slowdown (fast / invariant throughput): prefill {ratio['prefill']}x  "
                  f"decode {ratio['decode']}x", flush=True)
        del engines, llm  # one preset's two models at a time
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
