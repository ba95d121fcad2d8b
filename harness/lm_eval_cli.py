"""`deepinfer lm-eval ARGS...`: lm-eval's own command line, with the model "deepinfer" registered.

`lm_eval --model deepinfer` cannot work: lm-eval 0.4.13 looks a model name up only in its own registry
(`lm_eval.api.registry.get_model` fills it from `lm_eval.models`; it reads no entry points and has no
flag or setting that imports a user's module), so a model outside its source tree exists only once
Python code has registered it. This command imports harness.lm_eval_model (which registers
`DeepInferLM`) and hands every argument, unchanged, to lm-eval's CLI; anything typed after `lm_eval`
works after `deepinfer lm-eval`:

    deepinfer lm-eval --model deepinfer --model_args model=DIR --tasks T --include_path TASKS \\
        --batch_size 8 --device cpu --output_path OUT --log_samples

lm-eval's CLI passes `--device cuda:0` unless told otherwise: give `--device cpu` on a machine without
CUDA. `--batch_size` is the engine's max_num_seqs (`auto` is refused). A DeepInferError from the model
(bad model_args, batch size or device, a missing checkpoint) is one `error:` line with exit 2, as for
every deepinfer command; lm-eval's own errors are lm-eval's.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from deepinfer.audit.errors import AuditError
from deepinfer.errors import DeepInferError

# A prefix no command-line argument can contain, so argparse sees lm-eval's flags (--help too) as plain
# words: a REMAINDER positional alone rejects a flag that comes first ("unrecognized arguments").
NO_OPTIONS = "\0"
# `pip install deepinfer[eval]` would install DeepSeek's own package of that name from PyPI, not this project
LM_EVAL_HINT = "pip install -e '.[eval]' in this project's checkout (or pip install 'lm-eval>=0.4.13')"


@contextmanager
def needs_lm_eval(command: str) -> Iterator[None]:
    """Turn lm-eval missing, while importing what `command` needs, into a one-line DeepInferError."""
    try:
        yield
    except ModuleNotFoundError as err:
        if (err.name or "").partition(".")[0] != "lm_eval":
            raise
        raise DeepInferError(f"{command} needs lm-eval: {LM_EVAL_HINT}") from None


def _include_paths(argv: Sequence[str]) -> list[str]:
    """The folders of `--include_path DIR` / `--include_path=DIR` in lm-eval's arguments."""
    folders = []
    for flag, value in zip(argv, [*argv[1:], ""]):
        if flag == "--include_path":
            folders.append(value)
        elif flag.startswith("--include_path="):
            folders.append(flag.partition("=")[2])
    return [folder for folder in folders if folder and Path(folder).is_dir()]


def add_lm_eval_command(commands: argparse._SubParsersAction) -> None:
    """Add `lm-eval` to the top-level `deepinfer` commands."""
    command = commands.add_parser(
        "lm-eval", help="run lm-eval's own command line with the model 'deepinfer' available",
        description="Run lm-eval's command line (every argument passed on unchanged) after registering the "
                    "model 'deepinfer': deepinfer lm-eval --model deepinfer --model_args model=DIR --tasks T "
                    "--batch_size 8 --device cpu. See `deepinfer lm-eval --help` for lm-eval's options.",
        add_help=False, prefix_chars=NO_OPTIONS,
    )
    command.add_argument("args", nargs=argparse.REMAINDER, help="lm-eval's arguments")
    command.set_defaults(run=_cmd_lm_eval)


def run_lm_eval(argv: Sequence[str]) -> int:
    """lm-eval's `cli_evaluate` on `argv` (it reads sys.argv, which is restored afterwards). Without an
    `--include_path` of the user's, the shipped offline tasks are included; lm-eval's ValueErrors (an
    unknown task, say) become one-line errors."""
    with needs_lm_eval("deepinfer lm-eval"):
        import deepinfer.harness.lm_eval_model  # noqa: F401  registers the model "deepinfer"
        from lm_eval.__main__ import cli_evaluate

        from deepinfer.harness.evaluate import SUITES, broken_task_files

    if not any(arg == "--include_path" or arg.startswith("--include_path=") for arg in argv):
        argv = [*argv, "--include_path", str(SUITES)]  # our shipped offline tasks: deepinfer, deepinfer_mc, ...
    saved = sys.argv
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except (DeepInferError, AuditError):
        raise
    except ValueError as err:  # lm-eval reports an unknown task or a bad setting this way
        broken = broken_task_files(_include_paths(argv)) if "not found" in str(err).lower() else []
        why = f"; lm-eval skipped {'; '.join(broken)}" if broken else ""
        raise DeepInferError(f"lm-eval: {str(err).strip()}{why}") from None
    finally:
        sys.argv = saved
    return 0


def _cmd_lm_eval(args: argparse.Namespace) -> int:
    return run_lm_eval(args.args)
