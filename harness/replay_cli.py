"""`deepinfer audit replay record|verify`: agent-trace replay from the command line.

`add_replay_commands` registers the `replay` group on the `deepinfer audit` subparsers (harness/cli.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deepinfer.engine.llm import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from harness.replay import MODES

EXIT_DIFFERENT = 1  # as `deepinfer audit diff`: the replay is not what was expected


def add_replay_commands(audit_commands: argparse._SubParsersAction) -> None:
    replay = audit_commands.add_parser(
        "replay", help="replay agent traces: record a cassette, or verify one",
        description="Replay agent traces (JSONL episodes in the OpenAI Chat Completions shape, or Anthropic / "
                    "OpenAI Responses lines) through the engine, teacher-forced or free-running.")
    sub = replay.add_subparsers(title="replay commands", metavar="ACTION", required=True)

    record = sub.add_parser(
        "record", help="replay a trace file and write a cassette",
        description="Replay every episode of --traces and write the cassette --out: the episodes plus the "
                    "engine's outputs per turn, their stream hashes and the run manifest. Prints, per episode, "
                    "how the replay compares with the trace. Exit 0, or 1 when some lines were malformed (they "
                    "are reported and recorded; every other episode is replayed).")
    record.add_argument("--traces", required=True, help="JSONL trace file, one episode per line")
    record.add_argument("--out", required=True, help="cassette file to create")
    record.add_argument("--mode", choices=MODES, default="teacher-forced",
                        help="teacher-forced: regenerate each turn from the recorded history; free-running: the "
                             "model's turns feed forward, tools answer from the trace (default: teacher-forced)")
    record.add_argument("--model", help="checkpoint folder (default: the embedded tiny checkpoint)")
    record.add_argument("--run-seed", type=int, default=0, help="seed from which unseeded turns derive theirs")
    record.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output (default: the model's, capped to fit memory; see LLM)")
    record.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                        help=f"sequences decoded together (default: {DEFAULT_MAX_NUM_SEQS})")
    record.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help=f"token budget per engine step (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS})")
    record.add_argument("--numerics", default="batch_invariant", choices=("batch_invariant", "fast"))
    record.add_argument("--dtype", default="float32")
    record.add_argument("--device", default="cpu")
    record.set_defaults(run=_cmd_record)

    verify = sub.add_parser(
        "verify", help="replay a cassette and compare it with its recording",
        description="Replay the cassette's episodes in its mode and report, per episode, identical or the first "
                    "turn, token and top-2 margin where the replay diverged. Exit 0 when every episode is "
                    "identical, 1 otherwise.")
    verify.add_argument("cassette", help="a cassette written by `replay record`")
    verify.add_argument("--model", help="checkpoint folder (default: the path the cassette records)")
    verify.add_argument("--device", help="replay on this device instead of the recorded one")
    verify.add_argument("--dtype", help="replay in this dtype instead of the recorded one")
    verify.add_argument("--numerics", choices=("batch_invariant", "fast"), help="override the recorded numerics")
    verify.set_defaults(run=_cmd_verify)


def _cmd_record(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from deepinfer import LLM
    from harness.cassette import record_cassette
    from harness.sweep import Variant, check_variant

    variant = check_variant(Variant(
        "replay", max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, numerics=args.numerics, dtype=args.dtype, device=args.device,
    ), "flags")
    llm = LLM(args.model, seed=args.run_seed, **variant.engine_kwargs())
    variant = replace(variant, max_model_len=llm.max_model_len)  # the cassette records the resolved length
    checkpoint_path = str(Path(args.model).resolve()) if args.model else None
    report = record_cassette(llm, Path(args.traces), Path(args.out), mode=args.mode, variant=variant,
                             run_seed=args.run_seed, checkpoint_path=checkpoint_path)
    for result in report.results:
        if result.status == "malformed":
            print(f"error: {result.detail}", file=sys.stderr)
        else:
            print(result.describe())
    print(report.summary())
    print(f"cassette: {args.out}")
    return EXIT_DIFFERENT if report.counts().get("malformed") else 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from harness.cassette import cassette_engine, read_cassette, verify_cassette

    cassette = read_cassette(Path(args.cassette))
    llm = cassette_engine(cassette, args.model, device=args.device, dtype=args.dtype, numerics=args.numerics)
    report = verify_cassette(llm, cassette)
    for result in report.results:
        print(result.describe())
    print(report.summary())
    failed = {status: n for status, n in report.counts().items() if status not in ("identical", "malformed")}
    return EXIT_DIFFERENT if failed else 0
