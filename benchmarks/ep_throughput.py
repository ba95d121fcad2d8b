"""How fast one launch of expert parallelism serves: prefill and decode tokens per second at each batch
size, in each numerics mode, and the share of a decode step spent in the expert exchange's all-to-alls
with the bytes a rank sends in them; rank 0 writes one JSON (command, device, layout, per-rank peak
GPU memory and peak host resident memory).

    torchrun --nproc-per-node 8 benchmarks/ep_throughput.py --preset flash --device cuda --dtype bfloat16 \
        --batches 64 256 1024 --out ep_throughput_flash_ep8_dp8.json
    torchrun --nproc-per-node 2 benchmarks/ep_throughput.py --preset tiny --device cpu --batches 4 8 \
        --context 64 --steps 8 --out ep_throughput_tiny_ep2_cpu.json

A batch is every rank's requests together: with data parallelism (the default) each rank serves 1/N
of them. Per configuration, B requests of `--context` prompt tokens (distinct per request and per run;
prefix caching off) generate one token (prefill tokens/s: B x context over that run), then B others
generate 1 + `--steps` tokens (decode tokens/s: B x steps over the difference of the two runs). Two
more runs like those time every all-to-all of the exchange (the rows out, their expert slots, the
outputs back), synchronising the device before and after each, and count the bytes a rank sends: the
difference of the two is the decode steps' (the exchange's share of their time, waiting for slower
ranks included, and MiB per step). Times are the slowest rank's; a warm-up run of the same batch
first (kernels compiled and tuned for its shapes).
Weights are the preset's seeded random ones, each rank generating only the routed experts it holds.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from deepinfer import LLM, NUMERICS, EngineConfig, SamplingParams
from deepinfer.parallel import experts as expert_exchange
from deepinfer.parallel import gather_objects


class ExchangeClock:
    """Wraps the exchange's all-to-all: seconds inside it and bytes this rank sends, while `on`."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.on = device, False
        self.seconds, self.sent_bytes = 0.0, 0
        self.inner = expert_exchange.all_to_all
        expert_exchange.all_to_all = self

    def __call__(self, tensor: torch.Tensor, send: list[int], receive: list[int], group=None) -> torch.Tensor:
        if not self.on:
            return self.inner(tensor, send, receive, group)
        self._sync()
        start = time.perf_counter()
        out = self.inner(tensor, send, receive, group)
        self._sync()
        self.seconds += time.perf_counter() - start
        self.sent_bytes += sum(send) * (tensor[0].numel() * tensor.element_size() if len(tensor) else 0)
        return out

    def take(self) -> tuple[float, int]:
        """Seconds and bytes since the last call."""
        taken = self.seconds, self.sent_bytes
        self.seconds, self.sent_bytes = 0.0, 0
        return taken

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def timed(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Wall seconds of every rank generating `max_tokens` after each prompt, the slowest rank's."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    dist.barrier()
    start = time.perf_counter()
    llm.generate(prompts, [params] * len(prompts))
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    return max(gather_objects(time.perf_counter() - start))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--data-parallel", type=int, default=None, help="1 or the world size (default: the world)")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024], help="requests over all ranks")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per configuration")
    parser.add_argument("--modes", nargs="+", default=list(NUMERICS), choices=NUMERICS)
    parser.add_argument("--engram-tables", default="device", choices=["device", "host"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        raise SystemExit("ep_throughput.py runs under torchrun with several processes (--nproc-per-node N)")
    base = EngineConfig(device=args.device, dtype=args.dtype, expert_parallel=world,
                        data_parallel=args.data_parallel or world, prefix_caching=False,
                        max_model_len=args.context + args.steps + 8, engram_tables=args.engram_tables)
    device = torch.device(args.device)
    clock = ExchangeClock(device)
    fresh = itertools.count()  # every run's prompts are new: no step reads another run's cache rows

    def prompts(batch: int) -> list[list[int]]:
        run = next(fresh)
        return [[(7919 * (run * batch + i) + 31 * j) % (vocab - 2) + 1 for j in range(args.context)]
                for i in range(batch)]

    rows = []
    for mode in args.modes:
        llm = LLM(f"preset:{args.preset}", replace(base, numerics=mode))  # numerics is fixed at load
        layout, vocab = llm.layout, llm.config.vocab_size
        for batch in args.batches:
            per_rank = -(-batch // layout.data_parallel)
            engine = llm.with_engine(replace(base, numerics=mode, max_num_seqs=per_rank))
            timed(engine, prompts(batch), 2)
            prefill = timed(engine, prompts(batch), 1)
            decode = timed(engine, prompts(batch), 1 + args.steps) - prefill
            clock.on = True
            traced = [(timed(engine, prompts(batch), tokens), *clock.take()) for tokens in (1, 1 + args.steps)]
            clock.on = False
            traced_decode, exchange_seconds, sent = (b - a for a, b in zip(*traced))
            shares = gather_objects((exchange_seconds, sent))
            rows.append({"numerics": mode, "batch": batch, "requests_per_rank": per_rank,
                         "prefill_tokens_per_s": round(batch * args.context / prefill, 1),
                         "decode_tokens_per_s": round(batch * args.steps / decode, 1),
                         "decode_step_ms": round(1000 * decode / args.steps, 3),
                         "exchange_share": round(max(s for s, _ in shares) / traced_decode, 3),
                         "exchange_mib_sent_per_rank_per_step": round(max(b for _, b in shares) / args.steps / 2**20,
                                                                      3)})
            if layout.rank == 0:
                print(json.dumps(rows[-1]), flush=True)
            del engine
        weight_storage = llm.engine_config.weight_storage
        del llm
    peaks = gather_objects(torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None)
    host_peaks = gather_objects(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)  # KiB on Linux
    if layout.rank == 0:
        invariant = {r["batch"]: r for r in rows if r["numerics"] == "batch_invariant"}
        ratios = {str(r["batch"]): round(r["decode_tokens_per_s"] / invariant[r["batch"]]["decode_tokens_per_s"], 3)
                  for r in rows if r["numerics"] == "fast" and r["batch"] in invariant}
        report = {"command": f"torchrun --nproc-per-node {layout.world} " + " ".join(
                      arg if arg != args.out else Path(args.out).name for arg in sys.argv),
                  "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (gloo processes)",
                  "torch": torch.__version__, "layout": layout.describe(), "preset": args.preset, "dtype": args.dtype,
                  "context": args.context, "steps": args.steps, "engram_tables": args.engram_tables,
                  "weight_storage": weight_storage, "rows": rows,
                  "decode_fast_over_invariant": ratios,
                  "peak_gib_per_rank": [None if p is None else round(p, 2) for p in peaks],
                  "host_peak_rss_gib_per_rank": [round(p, 2) for p in host_peaks]}
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
