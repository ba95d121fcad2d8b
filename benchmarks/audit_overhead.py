"""What hashing and storing cost inside a recorded run.

    python benchmarks/audit_overhead.py --out benchmarks/results/audit_overhead.json

Records the smoke suite into a scratch run folder under a few configurations and times, inside the
same run, every call that exists only for the audit: building rows (stream hashes), appending part
files (parquet + fsync + rename) and finalising (concatenate, re-check, Merkle roots). Reports
their share of the run's wall time.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

import deepinfer.harness.record as record
from deepinfer.checkpoint import MODEL_HELP
from deepinfer.audit.store import RunStore
from deepinfer.harness.suite_registry import load_suite
from deepinfer.harness.sweep import default_sweep


class Stopwatch:
    """Accumulates the time spent in the wrapped callables."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def measure(suite, variant, model) -> dict:
    watch = Stopwatch()
    originals = (record.make_row, RunStore.append, RunStore.finalize)
    record.make_row = watch.wrap(originals[0])
    RunStore.append = watch.wrap(originals[1])
    RunStore.finalize = watch.wrap(originals[2])
    try:
        with tempfile.TemporaryDirectory() as scratch:
            start = time.perf_counter()
            root = record.record_run(model, suite, variant, Path(scratch) / "run", progress=False)
            wall = time.perf_counter() - start
    finally:
        record.make_row, RunStore.append, RunStore.finalize = originals
    return {"configuration": variant.name, "requests": root["count"], "wall_s": round(wall, 3),
            "audit_s": round(watch.seconds, 4), "audit_share": round(watch.seconds / wall, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="smoke")
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    suite = load_suite(args.suite)
    sweep = default_sweep()
    configurations = [sweep.reference, *[v for v in sweep.variants if v.name in ("batch-1", "chunk-16")]]
    measure(suite, replace(sweep.reference, name="warmup"), args.model)
    runs = [measure(suite, variant, args.model) for variant in configurations]
    for run in runs:
        print(f"{run['configuration']:>10}: wall {run['wall_s']:.2f} s, hashing + storing {run['audit_s']:.3f} s "
              f"({100 * run['audit_share']:.2f} %)")
    result = {
        "command": f"python benchmarks/audit_overhead.py --suite {args.suite} --out {args.out}",
        "torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
        "suite": suite.describe() | {"path": args.suite}, "runs": runs,
        "max_audit_share": max(run["audit_share"] for run in runs),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
