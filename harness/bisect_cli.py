"""`deepinfer audit capture` and `deepinfer audit bisect`: find the first op where two runs part.

`add_bisect_commands` registers both on the `deepinfer audit` subparsers (harness/cli.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.checkpoint import MODEL_HELP
from deepinfer.engine.config import add_engine_flags, config_from_flags
from deepinfer.errors import DeepInferError
from deepinfer.harness.capture import VALUE_CAP

EXIT_DIFFERENT = 1  # as `deepinfer audit diff`: the captures differ
DEFAULT_DECODE_STEPS = 4


def add_bisect_commands(audit_commands: argparse._SubParsersAction) -> None:
    capture = audit_commands.add_parser(
        "capture", help="re-run a few requests and record a digest of every op output",
        description="Re-run the --requests of --suite one at a time, eagerly, and write --out: per engine step "
                    "and per op output (by layer, e.g. model.layers.3.attn_norm, and op, e.g. rms_norm) the "
                    "SHA-256 of its bytes, its shape, dtype, max abs, mean and non-finite count, and the raw "
                    "values of outputs of at most --value-cap elements. Compare two captures (made on different "
                    "machines, dtypes or numerics) with `deepinfer audit bisect`.")
    capture.add_argument("--model", help=MODEL_HELP)
    capture.add_argument("--suite", required=True,
                         help="KIND:PATH, a JSONL file of requests, or a shipped suite name (smoke)")
    capture.add_argument("--requests", required=True, help="request ids of the suite, comma-separated")
    capture.add_argument("--run-seed", type=int, default=0, help="seed from which unseeded requests derive theirs")
    window = capture.add_mutually_exclusive_group()
    window.add_argument("--steps", type=int, default=DEFAULT_DECODE_STEPS,
                        help=f"capture the prefill and the first N decode steps (default: {DEFAULT_DECODE_STEPS})")
    window.add_argument("--around", type=int, metavar="POSITION",
                        help="capture only the steps producing output tokens POSITION-2 .. POSITION+2 (the first "
                             "divergent position `audit compare` reports)")
    capture.add_argument("--value-cap", type=int, default=VALUE_CAP, metavar="ELEMENTS",
                         help=f"store the values of op outputs of at most this many elements (default: {VALUE_CAP}); "
                              "bisect measures differences only where both captures stored them, so a prefill "
                              "of long prompts needs more")
    capture.add_argument("--out", required=True, help="capture file to create")
    add_engine_flags(capture, skip=("seed",))
    capture.set_defaults(run=_cmd_capture)

    bisect = audit_commands.add_parser(
        "bisect", help="the first op whose outputs differ between two captures",
        description="Name the first op output, in execution order (request, step, layer, op), whose digest "
                    "differs between two captures of the same model and requests, with its max abs and max "
                    "ulp differences, the ops of that step where the difference grew past 8x all before it, "
                    "then the max abs difference of each later layer's output in that step. "
                    "Exit 0 when every digest matches (or, with --above, none differs by more), 1 otherwise.")
    bisect.add_argument("capture_a", help="a file written by `deepinfer audit capture`")
    bisect.add_argument("capture_b", help="another, of the same model and requests")
    bisect.add_argument("--above", type=float, default=0.0, metavar="DIFF",
                        help="name instead the first op output whose max abs difference exceeds DIFF: where a "
                             "small difference (a 1-ulp cos/sin) became a large one, maybe steps later")
    bisect.set_defaults(run=_cmd_bisect)


def _cmd_capture(args: argparse.Namespace) -> int:
    from deepinfer import LLM
    from deepinfer.harness.capture import Window, capture
    from deepinfer.harness.suite_registry import load_suite

    if args.steps < 0 or (args.around is not None and args.around < 0):
        raise DeepInferError("flags: --steps and --around take a number >= 0")
    if args.value_cap < 0:
        raise DeepInferError("flags: --value-cap takes a number of elements >= 0")
    request_ids = [rid.strip() for rid in args.requests.split(",") if rid.strip()]
    if not request_ids:
        raise DeepInferError("flags: --requests names no request")
    try:
        engine = config_from_flags(args)
    except DeepInferError as err:
        raise DeepInferError(f"flags: {err}") from None
    suite = load_suite(args.suite)
    window = Window.around(args.around) if args.around is not None else Window.steps(args.steps)
    header = capture(LLM(args.model, engine), suite, request_ids, window, Path(args.out), run_seed=args.run_seed,
                     value_cap=args.value_cap)
    steps = len({(entry["request"], entry["step"]) for entry in header["entries"]})
    print(f"capture {args.out}: {len(header['entries'])} op outputs over {steps} steps of "
          f"{len(request_ids)} request(s), {header['dtype']} {header['numerics']} on {header['device']}")
    return 0


def _cmd_bisect(args: argparse.Namespace) -> int:
    from deepinfer.audit.bisect import bisect, format_bisection, read_capture

    if not args.above >= 0:
        raise DeepInferError("flags: --above takes a difference >= 0")
    a, b = read_capture(Path(args.capture_a)), read_capture(Path(args.capture_b))
    result = bisect(a, b, args.above)
    print(format_bisection(result, a, b, args.above))
    return 0 if result.first is None else EXIT_DIFFERENT
