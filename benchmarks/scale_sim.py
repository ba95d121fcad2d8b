"""What expert parallelism over 8, 64 and 128 GPUs would do with recorded router loads: per-rank
expert load (busiest rank over the mean) with experts placed in order and with the EPLB placement
(`deepinfer.parallel.balanced_placement`, one spare slot per rank), all-to-all bytes per rank per
decode step, and weight memory per rank. A simulation from counts, not a run.

    python benchmarks/scale_sim.py --loads benchmarks/results/expert_loads_flash-4l_h100.json \
        --out benchmarks/results/scale_sim_flash.json

Each measured layer's loads stand for the layers of its kind; the EPLB placement is fitted on one
suite's loads and scored on both (on the other suite it is out of sample: what a placement fitted
on yesterday's traffic does today).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from deepinfer.checkpoint import preset_config
from deepinfer.checkpoint.layout import parameter_counts
from deepinfer.parallel import ExpertPlacement, balanced_placement
from deepinfer.parallel.placement import rank_loads

MXFP4_BYTES = 4.25 / 8  # 4-bit values plus one 8-bit scale per 32
DENSE_BYTES = {"embedding + head": 2, "attention": 1, "shared experts + routers": 1, "norms + hyper-connections": 4}
GIB = 2 ** 30


def imbalance(placement: ExpertPlacement, loads: list[float]) -> float:
    per_rank = rank_loads(placement, loads)
    return max(per_rank) / statistics.fmean(per_rank)


def simulate(loads: dict[str, list[list[int]]], preset: str, gpus: int, tokens_per_rank: int,
             bytes_per_value: int) -> dict:
    config = preset_config(preset)
    experts, top_k, hidden = config.n_routed_experts, config.num_experts_per_tok, config.hidden_size
    per_rank = -(-experts // gpus)
    contiguous = ExpertPlacement.contiguous(experts, gpus)
    suites = sorted(loads)
    scores: dict[str, list[float]] = {"contiguous": [], "eplb_same_suite": [], "eplb_other_suite": []}
    for layer in range(len(loads[suites[0]])):
        fitted = {s: balanced_placement([float(v) for v in loads[s][layer]], gpus, per_rank + 1) for s in suites}
        for suite in suites:
            measured = [float(v) for v in loads[suite][layer]]
            scores["contiguous"].append(imbalance(contiguous, measured))
            scores["eplb_same_suite"].append(imbalance(fitted[suite], measured))
            for other in suites:
                if other != suite:
                    scores["eplb_other_suite"].append(imbalance(fitted[other], measured))
    remote = tokens_per_rank * top_k * (gpus - 1) / gpus  # slots a rank sends away per MoE layer
    layer_bytes = 2 * remote * hidden * bytes_per_value  # dispatched, then combined back
    counts = parameter_counts(config, include_mtp=False)
    dense = sum(counts[group] * DENSE_BYTES[group] for group in DENSE_BYTES if group in counts)
    expert_bytes = counts["routed experts"] / experts * MXFP4_BYTES  # one expert, all its layers
    return {
        "gpus": gpus,
        "experts_per_rank": {"contiguous": per_rank, "eplb": per_rank + 1},
        "busiest_rank_over_mean": {name: {"mean": round(statistics.fmean(v), 3), "max": round(max(v), 3)}
                                   for name, v in scores.items() if v},
        "all_to_all_mib_per_rank_per_step": round(layer_bytes * config.num_hidden_layers / 2 ** 20, 1),
        "weights_gib_per_rank": {"contiguous": round((dense + per_rank * expert_bytes) / GIB, 1),
                                 "eplb": round((dense + (per_rank + 1) * expert_bytes) / GIB, 1)},
    }


def table(rows: list[dict]) -> str:
    lines = ["| GPUs | experts/rank (EPLB) | busiest/mean, in order | EPLB, same suite | EPLB, other suite "
             "| all-to-all MiB/rank/step | weights GiB/rank (EPLB) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        load = row["busiest_rank_over_mean"]

        def cell(name: str) -> str:
            return f"{load[name]['mean']:.2f} (max {load[name]['max']:.2f})" if name in load else "–"

        lines.append(f"| {row['gpus']} | {row['experts_per_rank']['contiguous']} ({row['experts_per_rank']['eplb']}) "
                     f"| {cell('contiguous')} | {cell('eplb_same_suite')} | {cell('eplb_other_suite')} "
                     f"| {row['all_to_all_mib_per_rank_per_step']} | {row['weights_gib_per_rank']['contiguous']} "
                     f"({row['weights_gib_per_rank']['eplb']}) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", required=True, help="expert_loads.py output")
    parser.add_argument("--preset", default="flash", help="the full-size model the ranks would serve")
    parser.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 128])
    parser.add_argument("--tokens-per-rank", type=int, default=64, help="decode tokens per rank per step")
    parser.add_argument("--bytes-per-value", type=int, default=2, help="2: bf16 rows both ways, as the engine sends")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    recorded = json.loads(Path(args.loads).read_text())
    loads = {suite: entry["loads"] for suite, entry in recorded["suites"].items()}
    rows = [simulate(loads, args.preset, gpus, args.tokens_per_rank, args.bytes_per_value) for gpus in args.gpus]
    command = " ".join(arg if arg != args.out else Path(args.out).name for arg in sys.argv)
    report = {"command": f"python {command}", "loads_from": {"preset": recorded["preset"],
                                                            "device": recorded["device"],
                                                            "suites": list(recorded["suites"])},
              "preset": args.preset, "tokens_per_rank": args.tokens_per_rank, "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
