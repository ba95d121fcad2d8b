"""Run by torchrun for tests/test_parallel.py: serve the standard request set (its first `requests`, each
generating `max_tokens`) under each engine layout of a JSON spec, and (rank 0) write every case's output
signatures to a pickle.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/parallel_worker.py SPEC OUT

A case with "cp" runs steps split over the ranks and counts how many were; "engine" adds engine
settings; "model" names a checkpoint folder instead of the preset (every rank's count of the bytes it
read from it is recorded, in rank order; with "load_only" that count is all the case does). A case with "replace"
first serves the set, then re-places the experts by EPLB from the loads that
serving measured (one more slot per rank, so the heaviest experts get copies), and serves it again;
it also records, per MoE layer, the slots those loads counted and top_k times the tokens the ranks'
steps scheduled (each token dispatched by one rank of those sharing its requests).
A case with "cli" runs `deepinfer ARGV` on every rank instead: its exit code and every rank's stdout.
Every case records the steps its engine ran again after a fixed-capacity expert exchange overflowed
and the slots left out, and how many times the exchanges read a tensor back to the host (`tolist`,
`item`) on rank 0; a case with "repeat" serves the set again from a new engine of the same settings
over the same model, and records its outputs and redone steps.
"""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import sys

import torch
import torch.distributed as dist

from deepinfer import LLM
from deepinfer.parallel import balanced_placement, placement_digest
from deepinfer.harness.cli import main as cli_main
from deepinfer.harness.invariance import signature, standard_requests


def serve(llm: LLM, requests) -> list[tuple]:
    return [signature(o) for o in llm.generate([r.prompt for r in requests], [r.params for r in requests])]


def count_host_reads(llm: LLM) -> list[int]:
    """A counter of the `Tensor.tolist` / `Tensor.item` calls made inside `llm`'s expert exchanges, but
    not inside the experts they run (the CPU's expert kernel groups rows on the host; CUDA's does not)."""
    reads, inside = [0], [False]
    for name in ("tolist", "item"):
        method = getattr(torch.Tensor, name)

        def counted(tensor, *args, method=method):
            reads[0] += inside[0]
            return method(tensor, *args)
        setattr(torch.Tensor, name, counted)
    def within(call, flag: bool):
        def run(*args):
            was, inside[0] = inside[0], flag
            try:
                return call(*args)
            finally:
                inside[0] = was
        return run

    for exchange in llm.host.exchanges:
        exchange.routed = within(exchange.routed, True)
        exchange.experts.outputs = within(exchange.experts.outputs, False)
    return reads


def redos(llm: LLM) -> tuple[int, int]:
    return llm.core.num_exchange_redos, llm.core.num_exchange_overflow_slots


def run_cli(argv: list[str]) -> tuple[int, list[str]]:
    """`deepinfer ARGV` on this rank: its exit code and the stdout of every rank, in rank order."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = cli_main(argv)
    printed = [None] * dist.get_world_size()
    dist.all_gather_object(printed, stdout.getvalue())
    return code, printed


def main() -> None:
    spec, out = json.loads(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    results = {}
    for case in spec["cases"]:
        if "cli" in case:
            results[case["name"]] = run_cli(case["cli"])
            continue
        llm = LLM(case.get("model") or f"preset:{case['preset']}", dtype=case["dtype"], expert_parallel=case["ep"],
                  data_parallel=case["dp"], context_parallel=case.get("cp", 1), **case.get("engine", {}))
        requests = standard_requests(llm.config.vocab_size, count=spec["requests"], max_tokens=spec["max_tokens"])
        results[case["name"] + "-weights"] = sorted({type(e.experts.w13).__name__ for e in llm.host.exchanges})
        if "model" in case:
            read = [None] * dist.get_world_size()
            dist.all_gather_object(read, llm.host.bytes_read)
            results[case["name"] + "-read"] = read
            if case.get("load_only"):
                continue
        splits = []
        if llm.model.context is not None:  # count the steps that were split
            split = llm.model.context.split
            llm.model.context.split = lambda *args: splits.append(split(*args)) or splits[-1]
        scheduled = []
        schedule = llm.core.scheduler.schedule
        llm.core.scheduler.schedule = lambda: scheduled.append(schedule()) or scheduled[-1]
        reads = count_host_reads(llm)
        results[case["name"]] = serve(llm, requests)
        results[case["name"] + "-splits"] = sum(s is not None for s in splits)
        results[case["name"] + "-redos"], results[case["name"] + "-reads"] = redos(llm), reads[0]
        if case.get("repeat"):  # a second engine of the same settings over the model: the same steps
            again = llm.with_engine(llm.engine_config)
            results[case["name"] + "-again"] = serve(again, requests)
            results[case["name"] + "-redos-again"] = redos(again)
        if case.get("replace"):
            before = placement_digest([exchange.placement for exchange in llm.host.exchanges])
            per_rank = llm.host.exchanges[0].placement.per_rank + 1
            loads = llm.expert_loads()
            tokens = torch.tensor(sum(chunk.num_tokens for step in scheduled for chunk in step.chunks))
            dist.all_reduce(tokens)
            results[case["name"] + "-slots"] = ([sum(layer) for layer in loads], llm.config.num_experts_per_tok
                                                * int(tokens) // llm.layout.attention_ranks)
            placements = [balanced_placement(layer, llm.layout.world, per_rank) for layer in loads]
            llm.place_experts(placements)
            results[case["name"] + "-replaced"] = serve(llm, requests)
            results[case["name"] + "-digests"] = (before, placement_digest(placements))
    if dist.get_rank() == 0:
        with open(out, "wb") as file:
            pickle.dump(results, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
