"""Speculative decoding on a CUDA device: outputs bitwise equal to plain decoding, and what it buys.

    python benchmarks/gpu_speculation.py --preset small --dtype bfloat16 --out results.json
    python benchmarks/gpu_speculation.py --preset flash-4l --speed-batches 1,16 --out results.json
    python benchmarks/gpu_speculation.py --preset v41-flash-5l --speed-only --speed-batches 1,16 --out results.json

Runs the standard request set (greedy and seeded sampling, logprobs) without speculation, then with
drafts taken from those outputs (`harness.invariance.ReferenceDrafter`: every `--wrong-every`-th
position wrong, so steps keep some drafts and reject others) at 1, 3 and 5 drafts per step, with
prompt-lookup drafts, with the preset's own draft model (MTP or DSpark; random weights: they
rarely hold), and with that draft model's pass followed by the same known continuations looked up on
the device (`ReferenceDrafts`: drafts that hold reach the step queued behind, under CUDA graphs and
async scheduling, without the host seeing them); each configuration runs twice in one engine, so the
second run takes its prompts from the prefix cache (cold, then hot). Per run: the requests whose token ids or logprob bits
differ from plain decoding (there must be none), drafts made and kept, engine steps and wall time.

With `--speed-batches`, decode speed with and without speculation: B greedy requests of
`--prompt-tokens` prompt tokens and 128 new tokens each, plain decoding (CUDA graphs and async
scheduling) against drafts from an oracle that
knows the outputs and is wrong at every `--wrong-every`-th position (and one that is never wrong):
generated tokens per second, steps, and the share of drafts kept; then the preset's own drafters
(prompt lookup, and its draft model where it has one), whose drafts rarely hold on random weights,
under each `verify_policy`: what speculation costs when drafts fail (its time over plain decoding's),
with the drafts the throughput-aware policy declined and the steps it speculated in. The
throughput-aware policy starts each timed run from nothing (no step times, the prior hold rates), its
engine warmed up first, so its figure includes what it costs to learn that drafts do not hold.
Each speed row also splits the device's time of a step (the runner's CUDA-event clock) into the
forward with sampling and the drafter's pass, by whether the drafter ran (`device_ms`). `--speed-only`
skips the bitwise runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import torch

from deepinfer import LLM, EngineConfig, SamplingParams
from deepinfer.checkpoint import preset_config
from deepinfer.engine.runner import RunnerOutput
from deepinfer.harness.invariance import ReferenceDrafter, ReferenceDrafts, signature, standard_requests
from deepinfer.harness.sweep import checkpoint_drafter


def synchronize(llm: LLM) -> None:
    if llm.device.type == "cuda":
        torch.cuda.synchronize(llm.device)


def run(llm: LLM, requests, step: Callable[[], list] | None = None) -> tuple[list, int, float]:
    """(signatures in request order, engine steps, seconds); `step` in place of `llm.step`."""
    ids = [llm.add_request(r.prompt, r.params) for r in requests]
    outputs, steps = {}, 0
    step = step or llm.step
    synchronize(llm)
    start = time.perf_counter()
    while llm.has_unfinished():
        outputs.update((out.request_id, out) for out in step())
        steps += 1
    synchronize(llm)
    return [signature(outputs[i]) for i in ids], steps, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--wrong-every", type=int, default=4, help="every n-th drafted position is wrong")
    parser.add_argument("--speed-batches", default="", help="comma-separated batch sizes for the speed runs")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt length of the speed runs")
    parser.add_argument("--speed-only", action="store_true", help="skip the bitwise runs")
    parser.add_argument("--no-oracle", dest="oracle", action="store_false",
                        help="speed runs without the oracle drafts (only the real drafters, e.g. where theirs fail)")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="each engine's context (its cache's size, with --max-num-seqs: one engine of plain "
                             "decoding and one speculating are held at once)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of the script on small presets")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    requests = standard_requests(preset_config(args.preset).vocab_size, count=args.requests)
    llm = LLM(f"preset:{args.preset}", EngineConfig(device=args.device, dtype=args.dtype,
                                                    max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs))
    command = " ".join(a if a != args.out else Path(args.out).name for a in sys.argv)
    device = torch.cuda.get_device_name() if llm.device.type == "cuda" else "cpu"
    report = {"command": f"python {command}", "device": device, "torch": torch.__version__,
              "preset": args.preset, "dtype": args.dtype, "requests": 0 if args.speed_only else len(requests),
              "runs": []}
    if not args.speed_only:
        bitwise(llm, f"preset:{args.preset}", requests, args.wrong_every, report)
    Path(args.out).write_text(json.dumps(report, indent=1))
    report["speed"] = []
    for batch in (int(b) for b in args.speed_batches.split(",") if b):
        report["speed"] += speed(llm, f"preset:{args.preset}", batch, args.wrong_every, args.prompt_tokens, args.oracle)
        Path(args.out).write_text(json.dumps(report, indent=1))  # after every batch: a later failure keeps it


def bitwise(llm: LLM, model: str, requests, wrong_every: int, report: dict) -> None:
    """The standard requests without speculation, then under each drafter (`model`'s own included),
    cold and hot prefix cache: the requests whose bits differ from plain decoding's go to `report`'s runs."""
    # every request seeded (greedy ones too: their bits do not depend on it), so the device's reference
    # drafts find each row's stream by its seed
    requests = [replace(r, params=replace(r.params, seed=7000 + i if r.params.seed is None else r.params.seed))
                for i, r in enumerate(requests)]
    cold, _, _ = run(llm, requests)  # warm-up: kernels compiled and decode graphs captured outside the timed runs
    reference, steps, seconds = run(llm, requests)
    streams = [r.prompt + list(sig[0]) for r, sig in zip(requests, reference)]
    by_seed = {r.params.seed: stream for r, stream in zip(requests, streams)}
    report["runs"] += [{"speculation": "off", "prefix_cache": "cold", "diverged":
                        [i for i, (a, b) in enumerate(zip(reference, cold)) if a != b]},
                       {"speculation": "off", "prefix_cache": "hot", "steps": steps, "seconds": round(seconds, 3)}]
    drafters = [(f"reference-{k}", "ngram", k, ReferenceDrafter(streams, wrong_every)) for k in (1, 3, 5)]
    drafters.append(("ngram-5", "ngram", 5, None))
    for name in [checkpoint_drafter(model)] if checkpoint_drafter(model) is not None else []:
        drafters += [(f"{name}-{k}", name, k, None) for k in (1, 3, 5)]
        drafters += [(f"{name}-reference-{k}", name, k, "on the device") for k in (1, 3, 5)]
    for name, speculation, k, drafter in drafters:
        spec = llm.with_engine(replace(llm.engine_config, speculation=speculation, draft_tokens=k))
        if drafter == "on the device":
            spec.runner.drafts = ReferenceDrafts(spec.runner.drafts, by_seed, wrong_every, spec.runner.device)
        elif drafter is not None:
            spec.scheduler.drafter = drafter
        for cache in ("cold", "hot"):  # the first run fills the prefix cache, the second reads it
            scheduler = spec.scheduler
            drafted, kept, hits = scheduler.num_drafted, scheduler.num_draft_kept, prefix_hits(scheduler)
            got, steps, seconds = run(spec, requests)
            diverged = [i for i, (a, b) in enumerate(zip(reference, got)) if a != b]
            report["runs"].append({"speculation": name, "draft_tokens": k, "prefix_cache": cache,
                                   "prefix_hit_tokens": prefix_hits(scheduler) - hits, "diverged": diverged,
                                   "steps": steps, "seconds": round(seconds, 3),
                                   "drafted": scheduler.num_drafted - drafted, "kept": scheduler.num_draft_kept - kept})
            print(json.dumps(report["runs"][-1]), flush=True)
    report["bitwise_equal"] = all(not r.get("diverged") for r in report["runs"])
    print("bitwise equal with speculation on and off:", report["bitwise_equal"], flush=True)


COUNTERS = {"drafted": "num_drafted", "kept": "num_draft_kept", "expected_kept": "num_drafts_expected",
            "declined": "num_drafts_declined", "speculating_steps": "num_speculating_steps",
            "verify_chunks": "num_verify_chunks", "probes": "num_probes"}


class PhaseClock:
    """Host seconds spent in each phase of an engine's steps while it is entered: scheduling, queueing the
    step (`execute`: metadata, uploads, launches or graph replays), reading its results back (`result`: the
    wait for the device, then the lists) and applying them (`update`); a step's wall time beyond them is
    the engine's own glue. It also keeps each step's wall time by kind (plain, or speculating: it verified
    drafts or ran the drafter) and counts the CUDA graphs captured meanwhile (a step of a shape not met
    before captures one, which costs far more than a replay). From the runner's own clock (`StepClock`,
    the device's: CUDA events) it keeps each step's forward with sampling and its drafter pass, by
    whether the drafter ran (prompt lookup's verify steps run none): what a speculative step's extra
    time is made of."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.seconds = {"schedule": 0.0, "execute": 0.0, "result": 0.0, "update": 0.0}
        self.targets = {"schedule": llm.scheduler, "execute": llm.runner, "result": RunnerOutput,
                        "update": llm.scheduler}
        self.originals: dict[str, object] = {}
        self.walls: dict[str, list[float]] = {"plain": [], "speculating": []}
        self.device: dict[str, list[tuple[float, float]]] = {"without_drafter": [], "with_drafter": []}
        self.graphs = self._graphs()

    def _graphs(self) -> int:
        runner = self.llm.runner
        return len(runner.graphs or {}) + len(runner.draft_graphs)

    def step(self) -> list:
        """`llm.step`, its wall time kept by kind."""
        speculated = self.llm.scheduler.num_speculating_steps
        start = time.perf_counter()
        finished = self.llm.step()
        kind = "speculating" if self.llm.scheduler.num_speculating_steps > speculated else "plain"
        self.walls[kind].append(time.perf_counter() - start)
        return finished

    def _timed(self, call, phase: str):
        def timed_call(*args, **kwargs):
            start = time.perf_counter()
            try:
                out = call(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start
            if phase == "result" and out.forward_seconds is not None:  # a step that captured no graph
                kind = "with_drafter" if out.draft_seconds else "without_drafter"
                self.device[kind].append((out.forward_seconds, out.draft_seconds))
            return out
        return timed_call

    def __enter__(self) -> PhaseClock:
        for phase, owner in self.targets.items():  # an instance's method, or RunnerOutput's for every step
            self.originals[phase] = getattr(owner, phase)
            setattr(owner, phase, self._timed(self.originals[phase], phase))
        return self

    def __exit__(self, *exc) -> None:
        for phase, owner in self.targets.items():
            if owner is RunnerOutput:
                owner.result = self.originals[phase]
            else:
                delattr(owner, phase)  # the class's method shows through again

    def report(self, steps: int) -> dict:
        """Host milliseconds per step by phase, step walls by kind (count, median, slowest), the device's
        median forward and drafter milliseconds by kind, and graphs captured."""
        walls = {kind: {"steps": len(w), "median_ms": round(1000 * statistics.median(w), 3),
                        "max_ms": round(1000 * max(w), 3)} for kind, w in self.walls.items() if w}
        device = {kind: {"steps": len(times),
                         "forward_median_ms": round(1000 * statistics.median(f for f, _ in times), 3),
                         "drafter_median_ms": round(1000 * statistics.median(d for _, d in times), 3)}
                  for kind, times in self.device.items() if times}
        return {"host_ms_per_step": {phase: round(1000 * seconds / max(steps, 1), 3)
                                     for phase, seconds in self.seconds.items()},
                "step_walls": walls, "device_ms": device, "graphs_captured": self._graphs() - self.graphs}


def clock_figures(counts: dict) -> dict:
    """A timed run's `PhaseClock` figures, out of its counters."""
    return {name: counts[name] for name in ("host_ms_per_step", "step_walls", "device_ms", "graphs_captured")}


def timed(llm: LLM, requests, drafter: ReferenceDrafter | None, **changes) -> tuple[list, int, float, dict]:
    """`run` in a fresh engine over `llm`'s model with `changes` to its config (and `drafter` in place of its
    own), after two warm-up runs in it (kernels compiled, graphs captured, prompts cached); the scheduler's
    counters over the timed run, its `verify_lengths` (drafts a chunk carried -> chunks) and its host
    milliseconds per step by phase, step walls and graph captures (`PhaseClock`). A
    throughput-aware policy starts each run from nothing, so the warm-ups meet the step shapes the timed
    run does. The engine is dropped on return, its cache freed before the next is made."""
    gc.collect()
    if llm.device.type == "cuda":
        torch.cuda.empty_cache()
    spec = llm.with_engine(replace(llm.engine_config, **changes))
    spec.runner.timed = True  # every step on the device's clock (`PhaseClock.device`); only a throughput plan reads it
    if drafter is not None:
        spec.scheduler.drafter = drafter
    scheduler = spec.scheduler
    for _ in range(2):  # warm-up, cold then hot prefix cache (the drafter's kernels compiled for both)
        scheduler.forget_verification()
        run(spec, requests)
    scheduler.forget_verification()
    before = {name: getattr(scheduler, counter) for name, counter in COUNTERS.items()}
    lengths = dict(scheduler.verify_lengths)
    with PhaseClock(spec) as clock:
        got, steps, seconds = run(spec, requests, clock.step)
    counts = {name: getattr(scheduler, counter) - before[name] for name, counter in COUNTERS.items()}
    counts["expected_kept"] = round(counts["expected_kept"], 2)
    counts.update(clock.report(steps))
    counts["verify_lengths"] = {str(k): n - lengths.get(k, 0) for k, n in sorted(scheduler.verify_lengths.items())
                                if n > lengths.get(k, 0)}
    return got, steps, seconds, counts


def prefix_hits(scheduler) -> int:
    return getattr(scheduler, "num_prefix_hit_tokens", 0)


def speed(llm: LLM, model: str, batch: int, wrong_every: int, prompt_tokens: int, oracle: bool = True) -> list[dict]:
    """Decode tokens per second of `batch` greedy requests, plain, with oracle drafts (unless not `oracle`),
    and with `model`'s own drafters under each verify policy. Every configuration runs in a fresh engine
    (`timed`), plain decoding first and again last: the two plain rows bound the drift between engines."""
    vocab = llm.config.vocab_size
    prompts = [[(31 * i + 7 * j) % (vocab - 2) + 1 for j in range(prompt_tokens)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    requests = [SimpleNamespace(prompt=prompt, params=params) for prompt in prompts]
    reference, steps, seconds, counts = timed(llm, requests, None)
    tokens = sum(len(sig[0]) for sig in reference)
    rows = [{"batch": batch, "speculation": "off", "steps": steps, "seconds": round(seconds, 3),
             "tokens_per_s": round(tokens / seconds, 1), **clock_figures(counts)}]
    streams = [prompt + list(sig[0]) for prompt, sig in zip(prompts, reference)]
    for k in (3, 5) if oracle else ():
        for every in (wrong_every, 10**9):
            got, steps, seconds, counts = timed(llm, requests, ReferenceDrafter(streams, every), speculation="ngram",
                                                draft_tokens=k)
            rows.append({"batch": batch, "speculation": f"oracle-{k}", "wrong_every": every if every < 10**9 else None,
                         "steps": steps, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1),
                         "drafts_kept": round(counts["kept"] / max(counts["drafted"], 1), 3),
                         "speedup": round(rows[0]["seconds"] / seconds, 3), "bitwise_equal": got == reference})
            print(json.dumps(rows[-1]), flush=True)
    for speculation in ["ngram"] + [name for name in [checkpoint_drafter(model)] if name is not None]:
        for policy in ("fixed", "throughput"):
            got, steps, seconds, counts = timed(llm, requests, None, speculation=speculation, draft_tokens=5,
                                                verify_policy=policy)
            rows.append({"batch": batch, "speculation": speculation, "verify_policy": policy, "steps": steps,
                         "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1), **counts,
                         "time_over_off": round(seconds / rows[0]["seconds"], 3), "bitwise_equal": got == reference})
            print(json.dumps(rows[-1]), flush=True)
    again, steps, seconds, counts = timed(llm, requests, None)
    rows.append({"batch": batch, "speculation": "off", "again": True, "steps": steps, "seconds": round(seconds, 3),
                 "tokens_per_s": round(tokens / seconds, 1), "time_over_off": round(seconds / rows[0]["seconds"], 3),
                 **clock_figures(counts), "bitwise_equal": again == reference})
    print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
