"""Which CPU instruction-set caps give the same bits, and which keep batch 1 and batch 8 equal.

    python benchmarks/cpu_isa_pairs.py --out benchmarks/results/cpu_isa_pairs.json

For each cap a fresh Python process (oneDNN and MKL settle their code paths once per process) serves
the same requests with the engine (`LLM("preset:small")`, numerics="batch_invariant") in float32
and bfloat16, once with max_num_seqs=1 and once with max_num_seqs=8, and hashes every request's
token ids and logprob bits (audit.streams.stream_hashes). Caps:

- AVX2: ONEDNN_MAX_CPU_ISA=AVX2 plus MKL_ENABLE_INSTRUCTIONS=AVX2 and MKL_CBWR=AVX2,STRICT (MKL's
  AVX2 sgemm picks kernels by row count unless strict CBWR is on: see kernels/invariant.py);
- AVX512_CORE, AVX512_CORE_BF16 (deepinfer's default cap): ONEDNN_MAX_CPU_ISA alone;
- AMX: ONEDNN_MAX_CPU_ISA=AVX512_CORE_AMX, i.e. uncapped on a CPU with amx_bf16;
- AVX512_CORE_BF16+CBWR: deepinfer's default cap with MKL_CBWR=AVX2,STRICT, MKL's strict mode on its
  AVX2 code path with AVX-512 enabled otherwise (does fp32 then match the AVX2 column?).

Every process sets DEEPINFER_ALLOW_VARIANT_BF16=1, so that the engine serves bf16 even where
kernels.cpu_isa.check_cpu_isa would refuse it (AMX, or rows that depend on the batch); what the
check says without the waiver is recorded as `refusal`. Reported: (a) per cap and dtype, whether
batch 1 and batch 8 agree bitwise, (b) per dtype, which pairs of caps give identical bits. This
machine's results: benchmarks/results/cpu_isa_pairs.json, summarised in kernels/invariant.py.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

CAPS = {
    "AVX2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "MKL_CBWR": "AVX2,STRICT"},
    "AVX512_CORE": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"},
    "AVX512_CORE_BF16": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "AMX": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"},
    "AVX512_CORE_BF16+CBWR": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "MKL_CBWR": "AVX2,STRICT"},
}
CLEARED = ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR", "DEEPINFER_ALLOW_VARIANT_BF16")
DTYPES = ("float32", "bfloat16")
BATCHES = (1, 8)
REPO = Path(__file__).resolve().parent.parent


def requests(vocab_size: int, count: int, max_tokens: int) -> list[tuple[list[int], dict]]:
    """Seeded prompts of mixed lengths (1 to 130 tokens); every other request greedy, the rest sampled
    with their own seeds. (prompt ids, SamplingParams fields)"""
    rng = random.Random(0)
    lengths = [1, 5, 17, 33, 48, 64, 97, 130]
    made = []
    for i in range(count):
        prompt = [rng.randrange(2, vocab_size) for _ in range(lengths[i % len(lengths)])]
        sampled = {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i} if i % 2 else {"temperature": 0.0}
        made.append((prompt, {**sampled, "max_tokens": max_tokens, "ignore_eos": True}))
    return made


def worker(args: argparse.Namespace) -> dict:
    """Serve the requests under this process's caps; every request's hashes per (dtype, batch)."""
    import torch  # no matmul runs before deepinfer is imported below, so the caps apply

    from deepinfer.audit.streams import stream_hashes
    from deepinfer import LLM, SamplingParams
    from deepinfer.checkpoint import preset_config
    from deepinfer.kernels import cpu_isa

    torch.set_num_threads(args.threads)
    served = requests(preset_config(args.preset).vocab_size, args.requests, args.max_tokens)
    params = [SamplingParams(**fields) for _, fields in served]
    runs = {}
    for dtype in DTYPES:
        for batch in BATCHES:
            start = time.perf_counter()
            llm = LLM(f"preset:{args.preset}", dtype=dtype, numerics="batch_invariant", max_num_seqs=batch,
                      max_model_len=512)
            outputs = llm.generate([prompt for prompt, _ in served], params)
            hashes = [stream_hashes(prompt, p.to_dict(skip_defaults=True), o.token_ids, o.logprobs, o.finish_reason)
                      for (prompt, _), p, o in zip(served, params, outputs)]
            runs[f"{dtype}/batch-{batch}"] = {
                "seconds": round(time.perf_counter() - start, 1),
                "tokens": [h.token_hash for h in hashes],
                "logits": [h.logit_hash for h in hashes],
            }
            seconds = runs[f"{dtype}/batch-{batch}"]["seconds"]
            print(f"  {dtype} batch {batch}: {seconds} s", file=sys.stderr, flush=True)
    state = cpu_isa.onednn_state()
    return {"onednn": state, "refusal": cpu_isa.isa_problem(state), "threads": torch.get_num_threads(),
            "capability": torch.backends.cpu.get_cpu_capability(), "runs": runs}


def _differing(a: list[str], b: list[str]) -> list[int]:
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]


def _compare(a: dict, b: dict) -> dict:
    """Requests whose logprob bits (and whose token ids) differ between two runs."""
    return {"logit_differs": _differing(a["logits"], b["logits"]),
            "token_differs": _differing(a["tokens"], b["tokens"])}


def table(results: dict[str, dict]) -> dict:
    """(a) batch 1 vs batch 8 within each cap, (b) every pair of caps, per dtype (both batch sizes)."""
    within = {cap: {dtype: _compare(r["runs"][f"{dtype}/batch-1"], r["runs"][f"{dtype}/batch-8"]) for dtype in DTYPES}
              for cap, r in results.items()}
    pairs = {dtype: [] for dtype in DTYPES}
    for (a, ra), (b, rb) in itertools.combinations(results.items(), 2):
        for dtype in DTYPES:
            per_batch = {f"batch-{n}": _compare(ra["runs"][f"{dtype}/batch-{n}"], rb["runs"][f"{dtype}/batch-{n}"])
                         for n in BATCHES}
            identical = not any(c["logit_differs"] for c in per_batch.values())
            pairs[dtype].append({"caps": [a, b], "identical": identical, **per_batch})
    for cap, by_dtype in within.items():
        for comparison in by_dtype.values():
            comparison["batch_invariant"] = not comparison["logit_differs"]
    return {"batch_1_vs_8": within, "pairs": pairs}


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--caps", nargs="+", default=list(CAPS), choices=list(CAPS))
    parser.add_argument("--out")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return
    if not args.out:
        parser.error("--out is required")
    flags = " ".join(line.partition(":")[2] for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags")).split()
    report = {
        "command": "python " + " ".join(sys.argv),
        "cpu": _cpu_model(),
        "cpu_flags": sorted({f for f in flags if f.startswith(("avx", "amx"))}),
        "preset": args.preset, "requests": args.requests, "max_tokens": args.max_tokens, "threads": args.threads,
        "numerics": "batch_invariant",
        "caps": {},
    }
    results = {}
    for cap in args.caps:
        env = {k: v for k, v in os.environ.items() if k not in CLEARED}
        env.update(CAPS[cap], DEEPINFER_ALLOW_VARIANT_BF16="1")
        print(f"{cap}: {CAPS[cap]}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, __file__, "--worker", "--preset", args.preset, "--requests", str(args.requests),
             "--max-tokens", str(args.max_tokens), "--threads", str(args.threads)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, check=True,
        )
        results[cap] = json.loads(done.stdout.splitlines()[-1])
        report["caps"][cap] = {"environment": CAPS[cap], "seconds": round(time.perf_counter() - start, 1),
                               **{k: v for k, v in results[cap].items() if k != "runs"},
                               "roots": {name: _root(run) for name, run in results[cap]["runs"].items()}}
    report.update(table(results))
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    _print(report)


def _root(run: dict) -> dict:
    from deepinfer.audit.streams import merkle_root

    ids = [f"r{i}" for i in range(len(run["tokens"]))]
    return {"token_root": merkle_root(ids, run["tokens"]), "logit_root": merkle_root(ids, run["logits"])}


def _print(report: dict) -> None:
    for dtype in DTYPES:
        print(f"{dtype}: batch 1 vs 8 bitwise equal: " + ", ".join(
            f"{cap} {'yes' if r[dtype]['batch_invariant'] else 'NO ' + str(r[dtype]['logit_differs'])}"
            for cap, r in report["batch_1_vs_8"].items()))
        for pair in report["pairs"][dtype]:
            print(f"  {pair['caps'][0]} = {pair['caps'][1]}: {'identical' if pair['identical'] else 'differ'}")


if __name__ == "__main__":
    main()
