"""The same suite on this machine's CPU and on its GPU: every request classified (`audit crosscheck`),
and the largest drift and the first divergence of each pair bisected to the first op that differs
and to the first op whose difference passes a dtype's threshold (`audit capture` on both devices from
the prefill on, then `audit bisect` and `audit bisect --above`). For V4.1 presets the pair is also run
with the caches in full precision (`--no-cache-qdq`), the control for whether the release's cache
formats turn the devices' last-bit differences into large ones.

    python benchmarks/cross_device.py --out results.json
    python benchmarks/cross_device.py --presets tiny --dtypes float32 --out results.json

Both devices load one checkpoint folder (seeded random weights, written once), in the batch-invariant
mode. The JSON holds, per preset and dtype, the crosscheck's pair (classes, drift bounds, divergences,
what differed), the control pair where there is one, and each bisection's texts.
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
from deepinfer.checkpoint import preset_config
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


# a difference past this is no longer the devices' last bits: where it arises is what bisect --above names
ABOVE = {"float32": 1e-3, "bfloat16": 0.1}
VALUE_CAP = 1 << 20  # every op output of the smoke suite's prompts keeps its values


def _bisection(work: Path, model: Path, suite: str, dtype: str, request: str, position: int, tag: str,
               flags: list[str] = ()) -> dict:
    """Capture `request` (served with `flags`) from its prefill to output token `position` on both devices,
    then bisect the two captures to the first difference and to the first past ABOVE."""
    files = []
    for device in ("cpu", "cuda"):
        files.append(work / f"{tag}-{device}.safetensors")
        _checked(["audit", "capture", "--model", str(model), "--suite", suite, "--requests", request,
                  "--steps", str(position), "--value-cap", str(VALUE_CAP), "--dtype", dtype, "--device", device,
                  *flags, "--out", str(files[-1])])
    first = _run(["audit", "bisect", str(files[0]), str(files[1])])[1].strip()
    above = _run(["audit", "bisect", str(files[0]), str(files[1]), "--above", str(ABOVE[dtype])])[1].strip()
    for file in files:
        file.unlink()
    return {"text": first, "above": ABOVE[dtype], "text_above": above}


def _pair(work: Path, model: Path, preset: str, dtype: str, suite: str, flags: list[str], tag: str
          ) -> tuple[dict, dict[str, Path]]:
    """Run `suite` on both devices with `flags` and crosscheck the two runs: (the pair, the runs)."""
    runs = {}
    for device in ("cpu", "cuda"):
        runs[device] = work / f"{tag}-{device}"
        start = time.perf_counter()
        _checked(["audit", "run", "--model", str(model), "--suite", suite, "--dtype", dtype, "--device", device,
                  "--no-progress", *flags, "--out", str(runs[device])])
        print(f"{tag} {device}: {time.perf_counter() - start:.1f}s", flush=True)
    out = work / f"{tag}-crosscheck"
    printed = _checked(["audit", "crosscheck", f"cpu={runs['cpu']}", f"gpu={runs['cuda']}", "--out", str(out)])
    print(printed, flush=True)
    [pair] = load_crosscheck(out)["pairs"]
    return pair, runs


def _largest_drift(runs: dict[str, Path]) -> tuple[str, float, int] | None:
    """(request, its largest logprob difference, the token where it is) over the requests whose tokens
    agree on both devices; None when every such logprob is bitwise equal."""
    rows = {row["request_id"]: row for row in read_run(runs["cpu"]).streams.iter_rows(named=True)}
    other = {row["request_id"]: row for row in read_run(runs["cuda"]).streams.iter_rows(named=True)}
    drift = {rid: max(((abs(a - b), k) for k, (a, b) in enumerate(zip(row["logprobs"], other[rid]["logprobs"]))),
                      default=(0.0, 0))
             for rid, row in rows.items() if row["token_ids"] == other[rid]["token_ids"]}
    if not drift or max(drift.values())[0] == 0:
        return None
    worst = max(drift, key=drift.get)
    return worst, *drift[worst]


def crosscheck(work: Path, preset: str, dtype: str, suite: str) -> dict:
    model = work / preset
    if not model.exists():
        _checked(["checkpoint", "create", "--preset", preset, "--seed", "0", "--out", str(model), "--no-progress"])
    pair, runs = _pair(work, model, preset, dtype, suite, [], f"{preset}-{dtype}")
    result = {"pair": pair, "bisections": []}
    drifts = [([], runs, "")]
    if preset_config(preset).model_type == "deepseek_v41":
        control, control_runs = _pair(work, model, preset, dtype, suite, ["--no-cache-qdq"], f"{preset}-{dtype}-no-qdq")
        result["without_cache_formats"] = control
        if control["max_logprob_drift"] > ABOVE[dtype]:  # something besides the cache formats amplifies too
            drifts.append((["--no-cache-qdq"], control_runs, " with --no-cache-qdq"))
    for flags, pair_runs, label in drifts:
        found = _largest_drift(pair_runs)
        if found is not None:
            worst, size, position = found
            result["bisections"].append({"request": worst,
                                         "why": f"largest logprob drift{label} ({size:.3g}, token {position})",
                                         **_bisection(work, model, suite, dtype, worst, position,
                                                      f"{preset}-{dtype}-drift{len(flags)}", flags)})
    if pair["divergences"]:
        first = min(pair["divergences"], key=lambda d: d["position"])
        result["bisections"].append({"request": first["request_id"],
                                     "why": f"diverged at position {first['position']}",
                                     **_bisection(work, model, suite, dtype, first["request_id"], first["position"],
                                                  f"{preset}-{dtype}-divergence")})
    for bisection in result["bisections"]:
        print(bisection["request"], bisection["why"], "\n" + bisection["text"], "\n" + bisection["text_above"],
              flush=True)
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
