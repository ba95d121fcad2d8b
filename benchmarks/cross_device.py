"""The same suite on this machine's CPU and on its GPU: every request classified (`audit crosscheck`),
and the largest drift and the first divergence of each pair bisected to the first op that differs
(`audit capture` on both devices, then `audit bisect`).

    python benchmarks/cross_device.py --out results.json
    python benchmarks/cross_device.py --presets tiny --dtypes float32 --out results.json

Both devices load one checkpoint folder (seeded random weights, written once), in the batch-invariant
mode. The JSON holds, per preset and dtype, the crosscheck's pair (classes, drift bounds, divergences,
what differed) and each bisection's text.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from deepinfer.audit.crosscheck import load_crosscheck
from deepinfer.audit.store import read_run
from deepinfer.harness.cli import main as deepinfer


def _run(argv: list[str]) -> tuple[int, str]:
    """`deepinfer ARGV` in this process: its exit code and what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = deepinfer(argv)
    return code, printed.getvalue()


def _checked(argv: list[str]) -> str:
    code, printed = _run(argv)
    if code not in (0, 1):
        raise SystemExit(f"deepinfer {' '.join(argv)} exited {code}")
    return printed


def _bisection(work: Path, model: Path, suite: str, dtype: str, request: str, window: list[str], tag: str) -> str:
    """Capture `request` over `window` on both devices and bisect the two captures."""
    files = []
    for device in ("cpu", "cuda"):
        files.append(work / f"{tag}-{device}.safetensors")
        _checked(["audit", "capture", "--model", str(model), "--suite", suite, "--requests", request, *window,
                  "--dtype", dtype, "--device", device, "--out", str(files[-1])])
    return _run(["audit", "bisect", str(files[0]), str(files[1])])[1].strip()


def crosscheck(work: Path, preset: str, dtype: str, suite: str) -> dict:
    model = work / preset
    if not model.exists():
        _checked(["checkpoint", "create", "--preset", preset, "--seed", "0", "--out", str(model), "--no-progress"])
    runs = {}
    for device in ("cpu", "cuda"):
        runs[device] = work / f"{preset}-{dtype}-{device}"
        start = time.perf_counter()
        _checked(["audit", "run", "--model", str(model), "--suite", suite, "--dtype", dtype, "--device", device,
                  "--no-progress", "--out", str(runs[device])])
        print(f"{preset} {dtype} {device}: {time.perf_counter() - start:.1f}s", flush=True)
    out = work / f"{preset}-{dtype}-crosscheck"
    printed = _checked(["audit", "crosscheck", f"cpu={runs['cpu']}", f"gpu={runs['cuda']}", "--out", str(out)])
    print(printed, flush=True)
    [pair] = load_crosscheck(out)["pairs"]
    result = {"pair": pair, "bisections": []}
    rows = {row["request_id"]: row for row in read_run(runs["cpu"]).streams.iter_rows(named=True)}
    other = {row["request_id"]: row for row in read_run(runs["cuda"]).streams.iter_rows(named=True)}
    drift = {rid: max(((abs(a - b), k) for k, (a, b) in enumerate(zip(row["logprobs"], other[rid]["logprobs"]))),
                      default=(0.0, 0))
             for rid, row in rows.items() if row["token_ids"] == other[rid]["token_ids"]}
    if drift and max(drift.values())[0] > 0:
        worst = max(drift, key=drift.get)
        size, position = drift[worst]
        # decode steps only (the prefill produces token 0): their outputs are small enough to be stored
        # whole, so the ops where the difference grew can be named
        result["bisections"].append({"request": worst, "why": f"largest logprob drift ({size:.3g}, token {position})",
                                     "text": _bisection(work, model, suite, dtype, worst,
                                                        ["--around", str(max(position, 3))],
                                                        f"{preset}-{dtype}-drift")})
    if pair["divergences"]:
        first = min(pair["divergences"], key=lambda d: d["position"])
        result["bisections"].append({"request": first["request_id"],
                                     "why": f"diverged at position {first['position']}",
                                     "text": _bisection(work, model, suite, dtype, first["request_id"],
                                                        ["--around", str(first["position"])],
                                                        f"{preset}-{dtype}-divergence")})
    for bisection in result["bisections"]:
        print(bisection["request"], bisection["why"], "\n" + bisection["text"], flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["tiny", "v41-tiny"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--suite", default="smoke")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    command = " ".join(arg if arg != args.out else Path(args.out).name for arg in sys.argv)  # no machine paths
    report = {"command": f"python {command}", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "suite": args.suite, "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            for dtype in args.dtypes:
                report["results"][f"{preset}/{dtype}"] = crosscheck(Path(tmp), preset, dtype, args.suite)
                Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
