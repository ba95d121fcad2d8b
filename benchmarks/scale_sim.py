"""What expert parallelism over 8, 64 and 128 GPUs would do with recorded router loads: per-rank
expert load (busiest rank over the mean) with experts placed in order and with the EPLB placement
(`deepinfer.parallel.balanced_placement`, one spare slot per rank), all-to-all bytes per rank per
decode step, and weight memory per rank. A simulation from counts, not a run.

    python benchmarks/scale_sim.py --loads benchmarks/results/expert_loads_flash-4l_h100.json \
        --out benchmarks/results/scale_sim_flash.json

Each measured layer's loads stand for the layers of its kind; the EPLB placement is fitted on one
suite's loads and scored on both (on the other suite it is out of sample: what a placement fitted
on yesterday's traffic does today).

    python benchmarks/scale_sim.py --loads ... --rank-bench benchmarks/results/gpu_bench_v41-flash-ep8-rank_h100.json \
        --rank-model v41-flash --out benchmarks/results/scale_sim_flash.json

also predicts decode tokens/s from one measured rank at full depth (`gpu_bench.py --preset
v41-flash-ep8-rank`: the experts a rank of EP `--rank-ep` holds, the exchange left out). A step at N
GPUs (EP = DP = N, B tokens a rank) is modelled as: the measured step minus its routed-expert kernel
(the rank's dense work, the same at any N), plus that kernel's time scaled by its weight-decoding passes
at N over those measured (the kernel is bound by decoding weights: one pass per expert with work and
row tile, `expert_passes`) and by the busiest rank over the mean (the step waits for it), plus the
all-to-all: the bytes a rank sends
and receives, over NVLink inside a machine of `GPUS_PER_MACHINE` and over InfiniBand across machines
(`NVLINK_GB_S`, `INFINIBAND_GB_S`, per direction, at their full rates), without overlap with compute.
The busiest-rank factors are the simulation's above (the loads' model, `--preset`); expert counts,
widths and depth are `--rank-model`'s. A measured batch whose timed steps captured CUDA graphs is left
out of the prediction (its time includes the captures' eager runs) and listed as left out. An estimate,
not a run: no contention, no kernel launch cost for the exchange, loads from another model's router.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from deepinfer.checkpoint import preset_config
from deepinfer.checkpoint.layout import parameter_counts
from deepinfer.kernels import triton_ops
from deepinfer.parallel import ExpertPlacement, balanced_placement
from deepinfer.parallel.placement import rank_loads

MXFP4_BYTES = 4.25 / 8  # 4-bit values plus one 8-bit scale per 32
GPUS_PER_MACHINE = 8
# per direction per GPU: NVLink 4 on H100 / H200 SXM, 900 GB/s both ways (NVIDIA's H100 and H200 datasheets);
# one ConnectX-7 NDR port of 400 Gb/s per GPU, as in DGX H100 / H200 systems (NVIDIA DGX H100 user guide)
NVLINK_GB_S = 450
INFINIBAND_GB_S = 50
EXPERT_KERNEL = "_expert_matmul_kernel"
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


def expert_passes(experts: int, slots: int, width: int) -> float:
    """Expected weight-decoding passes of the expert kernel when `slots` slots fall uniformly on `experts`
    experts: each expert with work decodes its weight once per row tile of its slots
    (`kernels.triton_ops.expert_tiles` picks the tile)."""
    active = experts * (1 - (1 - 1 / experts) ** slots)
    rows = triton_ops.expert_tiles(slots, experts, width, torch.bfloat16).block_m
    return active * math.ceil(slots / active / rows)


def exchange_ms(config, gpus: int, tokens_per_rank: int, bytes_per_value: int) -> float:
    """One decode step's all-to-all time for a rank: its remote slots' rows out and back in every MoE
    layer, the share bound for other machines over InfiniBand, the rest over NVLink (the slower sets
    the pace; uniform routing)."""
    remote = tokens_per_rank * config.num_experts_per_tok * (gpus - 1) / gpus
    step_bytes = 2 * remote * config.hidden_size * bytes_per_value * config.num_hidden_layers
    off_machine = max(gpus - GPUS_PER_MACHINE, 0) / (gpus - 1)
    return 1e3 * max(step_bytes * (1 - off_machine) / (NVLINK_GB_S * 1e9),
                     step_bytes * off_machine / (INFINIBAND_GB_S * 1e9))


def timed_steps(rank_bench: dict) -> list[dict]:
    """The rank's decode rows measured as served (batch-invariant numerics, CUDA graphs and async scheduling)."""
    return [r for r in rank_bench["decode"] if r["setup"] == "graphs+async" and r["numerics"] == "batch_invariant"]


def steady_steps(rank_bench: dict) -> list[dict]:
    """Of `timed_steps`, those whose timed steps captured no CUDA graph: a capture runs the step's kernels
    eagerly besides, so its step time and kernel totals are not a replayed step's."""
    return [r for r in timed_steps(rank_bench) if not r.get("graphs_captured_while_timed")]


def predict(rank_bench: dict, rank_ep: int, model: str, rows: list[dict], bytes_per_value: int) -> list[dict]:
    """Decode tokens/s of `model` at each simulated GPU count and each batch the rank was measured at (see
    the module docstring), with experts placed in order and with EPLB fitted on the same traffic."""
    config = preset_config(model)
    width, top_k = 2 * config.moe_intermediate_size, config.num_experts_per_tok
    held_measured = -(-config.n_routed_experts // rank_ep)
    measured = sorted(steady_steps(rank_bench), key=lambda r: r["batch"])
    out = []
    for row in rows:
        held = -(-config.n_routed_experts // row["gpus"])
        for step in measured:
            slots = step["batch"] * top_k  # a balanced exchange brings a rank as many slots as its tokens make
            scale = expert_passes(held, slots, width) / expert_passes(held_measured, slots, width)
            experts_ms = next(k["total_us"] for k in step["top_kernels"] if k["kernel"] == EXPERT_KERNEL) / 1e3
            dense_ms = step["step_ms"] - experts_ms
            a2a_ms = exchange_ms(config, row["gpus"], step["batch"], bytes_per_value)
            entry = {"gpus": row["gpus"], "tokens_per_rank": step["batch"], "rank_dense_ms": round(dense_ms, 2),
                     "rank_experts_ms": round(experts_ms * scale, 2), "all_to_all_ms": round(a2a_ms, 2)}
            for placement in ("contiguous", "eplb_same_suite"):
                imbalance = row["busiest_rank_over_mean"][placement]["mean"]
                ms = dense_ms + experts_ms * scale * imbalance + a2a_ms
                entry[placement] = {"step_ms": round(ms, 1),
                                    "tokens_per_s": round(row["gpus"] * step["batch"] / ms * 1e3)}
            out.append(entry)
    return out


def prediction_table(rows: list[dict]) -> str:
    lines = ["| GPUs | tokens a rank | dense ms | experts ms (balanced) | all-to-all ms | step ms, in order (EPLB) "
             "| tokens/s, in order (EPLB) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in rows:
        order, eplb = row["contiguous"], row["eplb_same_suite"]
        lines.append(f"| {row['gpus']} | {row['tokens_per_rank']} | {row['rank_dense_ms']} | {row['rank_experts_ms']} "
                     f"| {row['all_to_all_ms']} "
                     f"| {order['step_ms']} ({eplb['step_ms']}) | {order['tokens_per_s']:,} ({eplb['tokens_per_s']:,}) |")
    return "\n".join(lines)


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
    parser.add_argument("--rank-bench", help="gpu_bench.py output for one rank at full depth: predict tokens/s")
    parser.add_argument("--rank-ep", type=int, default=8, help="the EP degree whose share that rank held")
    parser.add_argument("--rank-model", default="v41-flash", help="the full-size model that rank belongs to")
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
    if args.rank_bench:
        bench = json.loads(Path(args.rank_bench).read_text())
        steady = steady_steps(bench)
        report["prediction"] = {"model": args.rank_model,
                                "rank_bench": {"file": Path(args.rank_bench).name, "preset": bench["preset"],
                                               "device": bench["device"], "rank_ep": args.rank_ep},
                                "links_gb_s": {"nvlink": NVLINK_GB_S, "infiniband": INFINIBAND_GB_S,
                                               "gpus_per_machine": GPUS_PER_MACHINE},
                                "rows": predict(bench, args.rank_ep, args.rank_model, rows, args.bytes_per_value),
                                "left_out": [{"tokens_per_rank": r["batch"], "step_ms": r["step_ms"],
                                              "graphs_captured_while_timed": r["graphs_captured_while_timed"]}
                                             for r in timed_steps(bench) if r not in steady]}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(table(rows))
    if args.rank_bench:
        print(prediction_table(report["prediction"]["rows"]))


if __name__ == "__main__":
    main()
