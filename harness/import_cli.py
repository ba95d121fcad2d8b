"""`deepinfer audit import`: another engine's outputs of a suite as a run folder (harness/engine_import.py).

`add_import_command` registers it on the `deepinfer audit` subparsers (harness/cli.py).
"""

from __future__ import annotations

import argparse
import json

from deepinfer.errors import DeepInferError
from deepinfer.harness.engine_import import FORMATS


def add_import_command(audit_commands: argparse._SubParsersAction) -> None:
    """Add `import` to the `deepinfer audit` subcommands."""
    command = audit_commands.add_parser(
        "import", help="store another engine's outputs of a suite as a run folder",
        description="Read FILE, one output per line (vllm: RequestOutput as JSON; sglang: /generate responses; "
                    "jsonl: {request_id, prompt_token_ids?, token_ids, logprobs, top_logprobs?, finish_reason}), "
                    "match each output to the suite's request by request id (by line order where a line has "
                    "none), check the prompt token ids where the line has them, and write the run folder --out "
                    "as `audit run` would, its manifest naming the engine and --engine-settings. `audit compare`, "
                    "`audit diff` and certificates then work over it. Nothing is written when any line is refused.")
    command.add_argument("file", metavar="FILE", help="the engine's outputs, one JSON object per line")
    command.add_argument("--from", dest="source", required=True, metavar="FORMAT",
                         help=f"the shape of FILE: {', '.join(FORMATS)}")
    command.add_argument("--suite", required=True, help="the suite FILE answers: KIND:PATH, a JSONL file of "
                                                        "requests, or a shipped suite name")
    command.add_argument("--out", required=True, help="run folder to create (new or empty)")
    command.add_argument("--name", help="configuration name recorded in the manifest (default: the format)")
    command.add_argument("--engine-settings", default="{}", metavar="JSON",
                         help="the engine's settings as a JSON object, recorded as given "
                              "(e.g. '{\"max_num_seqs\": 8}')")
    command.set_defaults(run=_cmd_import)


def _cmd_import(args: argparse.Namespace) -> int:
    from deepinfer.harness.engine_import import check_format, import_run
    from deepinfer.harness.suite_registry import load_suite

    check_format(args.source)
    try:
        settings = json.loads(args.engine_settings)
    except json.JSONDecodeError as err:
        raise DeepInferError(f"--engine-settings: invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(settings, dict):
        raise DeepInferError(f"--engine-settings: expected a JSON object, got {type(settings).__name__}")
    root = import_run(args.source, args.file, load_suite(args.suite), args.out, name=args.name, settings=settings)
    print(f"run {args.out}: {root['count']} requests imported from {args.source} {args.file}, "
          f"logit root {root['logit_root']}")
    return 0
