"""`deepinfer audit eval`: lm-eval tasks at several batch sizes, certified BITWISE_REPRODUCIBLE (or not).

Registered by `add_eval_command(audit_subcommands)`; lm-eval is imported only when the command runs,
so the rest of the CLI works without the `eval` extra.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from deepinfer.checkpoint import MODEL_HELP
from deepinfer.engine.config import add_engine_flags, config_from_flags
from deepinfer.harness.lm_eval_cli import needs_lm_eval

EXIT_DIFFERENT = 1


def add_eval_command(commands: argparse._SubParsersAction) -> None:
    """Add `eval` to the `deepinfer audit` subcommands."""
    command = commands.add_parser(
        "eval", help="run lm-eval tasks offline at several batch sizes and certify identical results",
        description="Run lm-eval tasks offline through the engine once per batch size, record every request "
                    "into a run, and certify that the metrics and every request's stream hashes are identical "
                    "across batch sizes. Writes OUT/summary.json, OUT/runs/batch-N and OUT/lm_eval/batch-N.json. "
                    "Verdicts, in `audit certify`'s words: BITWISE_REPRODUCIBLE (metrics and every stream "
                    "hash), TOKEN_REPRODUCIBLE (same metrics and tokens, some logprob bits moved), "
                    "METRICS_REPRODUCIBLE (same metrics, some tokens moved), DIVERGENT (a metric moved). "
                    "Exit 0 when BITWISE_REPRODUCIBLE, 1 when anything moved.",
    )
    command.add_argument("--tasks", required=True,
                         help="comma-separated tasks of harness/suites/lm_eval (deepinfer_mc, deepinfer_gen, "
                              "deepinfer_ppl, or the tag deepinfer for all three) or of --include-path")
    command.add_argument("--include-path", help="a folder of your own lm-eval task YAMLs (lm-eval's --include_path); "
                                                "its files are hashed into the runs' manifests")
    command.add_argument("--batch-sizes", default="1,8,64", help="engine batch sizes to compare (default: 1,8,64)")
    command.add_argument("--out", required=True, help="output folder (new or empty)")
    command.add_argument("--model", help=MODEL_HELP)
    command.add_argument("--limit", type=int, help="evaluate only the first N documents of each task")
    command.add_argument("--threads", type=int, help="PyTorch CPU threads (default: the process's)")
    add_engine_flags(command, skip=("max_num_seqs",))  # --batch-sizes gives it, one run each
    command.set_defaults(run=_cmd_eval)


def _cmd_eval(args: argparse.Namespace) -> int:
    from deepinfer.audit.certificate import BITWISE

    with needs_lm_eval("audit eval"):
        from deepinfer.harness.evaluate import evaluate, parse_batch_sizes

    summary = evaluate(args.tasks.split(","), parse_batch_sizes(args.batch_sizes), Path(args.out), model=args.model,
                       engine=config_from_flags(args), limit=args.limit, include_path=args.include_path,
                       threads=args.threads)
    for run in summary["runs"]:
        print(f"{run['name']}: {run['count']} requests, logit root {run['logit_root']}")
    for comparison in summary["comparisons"]:
        counts = ", ".join(f"{status} {n}" for status, n in comparison["streams"].items() if n)
        metrics = "identical" if comparison["metrics_identical"] else f"{len(comparison['metric_differences'])} moved"
        print(f"{comparison['name']} vs {summary['reference']}: {comparison['verdict']}, metrics {metrics}; "
              f"streams {counts}")
    print(f"verdict: {summary['verdict']} ({summary['engine']['numerics']}, {summary['engine']['dtype']})")
    print(f"summary: {Path(args.out) / 'summary.json'}")
    return 0 if summary["verdict"] == BITWISE else EXIT_DIFFERENT
