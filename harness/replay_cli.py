"""`deepinfer audit replay record|verify`: agent-trace replay from the command line.

`add_replay_commands` registers the `replay` group on the `deepinfer audit` subparsers (harness/cli.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deepinfer import NUMERICS
from deepinfer.checkpoint import MODEL_HELP
from deepinfer.engine.config import add_engine_flags, config_from_flags
from deepinfer.engine.host import model_reference
from deepinfer.errors import DeepInferError
from deepinfer.harness.replay import MODES

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
                    "are reported and recorded; every other episode is replayed). Progress (turns, or "
                    "free-running episodes) goes to stderr: a bar on a terminal, a status line every 10 s when "
                    "piped.")
    record.add_argument("--traces", required=True, help="JSONL trace file, one episode per line")
    record.add_argument("--out", required=True, help="cassette file to create")
    record.add_argument("--mode", choices=MODES, default="teacher-forced",
                        help="teacher-forced: regenerate each turn from the recorded history; free-running: the "
                             "model's turns feed forward, tools answer from the trace (default: teacher-forced)")
    record.add_argument("--model", help=MODEL_HELP)
    add_engine_flags(record)
    record.set_defaults(run=_cmd_record)

    verify = sub.add_parser(
        "verify", help="replay a cassette and compare it with its recording",
        description="Replay the cassette's episodes in its mode and report, per episode, identical or the first "
                    "turn, token and top-2 margin where the replay diverged. The cassette's seal is checked "
                    "first: a header changed since recording refuses the cassette, a changed, added or missing "
                    "episode line is reported as altered (the intact episodes still verify). Exit 0 when every "
                    "episode is identical, 1 otherwise. Progress goes to stderr as for record.")
    verify.add_argument("cassette", help="a cassette written by `replay record`")
    verify.add_argument("--model", help="checkpoint folder (default: the path the cassette records)")
    verify.add_argument("--device", help="replay on this device instead of the recorded one")
    verify.add_argument("--dtype", help="replay in this dtype instead of the recorded one")
    verify.add_argument("--numerics", choices=NUMERICS, help="override the recorded numerics")
    verify.set_defaults(run=_cmd_verify)


def _cmd_record(args: argparse.Namespace) -> int:
    from deepinfer import LLM
    from deepinfer.harness.cassette import record_cassette
    from deepinfer.harness.sweep import Variant

    try:
        engine = config_from_flags(args)
    except DeepInferError as err:
        raise DeepInferError(f"flags: {err}") from None
    llm = LLM(args.model, engine)
    variant = Variant("replay", llm.engine_config)  # the cassette records the resolved max_model_len
    checkpoint_path = model_reference(args.model) if args.model else None
    report = record_cassette(llm, Path(args.traces), Path(args.out), mode=args.mode, variant=variant,
                             run_seed=engine.seed, checkpoint_path=checkpoint_path)
    for result in report.results:
        if result.status == "malformed":
            print(f"error: {result.detail}", file=sys.stderr)
        else:
            print(result.describe())
    print(report.summary())
    if report.counts().get("diverged"):
        print("note: record compares the model's turns with the trace's own, which only the model that wrote the "
              "trace reproduces (a random-weight checkpoint never does); replay verify checks the cassette itself")
    print(f"cassette: {args.out}")
    return EXIT_DIFFERENT if report.counts().get("malformed") else 0


def _cmd_verify(args: argparse.Namespace) -> int:
    from deepinfer.harness.cassette import AlteredCassette, cassette_engine, read_cassette, verify_cassette

    try:
        cassette = read_cassette(Path(args.cassette))
    except AlteredCassette as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_DIFFERENT
    llm = cassette_engine(cassette, args.model, device=args.device, dtype=args.dtype, numerics=args.numerics)
    report = verify_cassette(llm, cassette)
    for result in report.results:
        print(result.describe())
    print(report.summary())
    failed = {status: n for status, n in report.counts().items() if status not in ("identical", "malformed")}
    return EXIT_DIFFERENT if failed else 0
