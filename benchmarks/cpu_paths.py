"""Which library code paths give the same bits: the reports of harness/cpu_paths.py for every path
(self-test, batch 1 against batch 8 on the tiny preset, a hash of the batch's token ids and logprob
bits), grouped by equal bits, per dtype.

    .venv/bin/python -m benchmarks.cpu_paths [--out benchmarks/results/cpu_invariance_paths.json]

Run it on an Intel and on an AMD machine and compare the `bits` hashes: equal hashes are equal bits.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from deepinfer.harness.cpu_paths import THREADS, run_paths
from deepinfer.kernels.cpu_isa import cpu_flags, cpu_model, cpu_vendor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    args = parser.parse_args()
    reports = run_paths()
    groups = {}
    for dtype in ("float32", "bfloat16"):
        same: dict[str, list[str]] = {}
        for name, report in reports.items():
            bits = report["dtypes"][dtype].get("bits")
            if bits:
                same.setdefault(bits, []).append(name)
        groups[dtype] = list(same.values())
        print(f"{dtype}: paths with equal bits: {groups[dtype]}", flush=True)
    result = {"command": "python -m benchmarks.cpu_paths " + " ".join(sys.argv[1:]), "torch": torch.__version__,
              "cpu": cpu_model(), "cpu_vendor": cpu_vendor(), "avx512_bf16": "avx512_bf16" in (cpu_flags() or []),
              "threads": THREADS, "paths": reports, "equal_bits": groups}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
