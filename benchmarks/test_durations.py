"""Where the test suite's time goes: runs `make test`'s pytest command with `--durations=0` (or reads a saved
output) and writes a Markdown table of seconds per test file and the slowest tests.

    .venv/bin/python -m benchmarks.test_durations --out benchmarks/results/test_durations_<cpu>.md
    .venv/bin/python -m benchmarks.test_durations --log pytest-output.txt --command "pytest -n 2 ..." --out ...
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

LINE = re.compile(r"\s*([\d.]+)s (call|setup|teardown)\s+(tests/[^:]+)::(\S+)")
MAKE_TEST_OPTIONS = "-q -n auto --dist loadfile"
SUMMARY = re.compile(r"=* ?(\d+ passed.*) in ([\d.]+)s")


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def table(log: str, command: str, top: int) -> str:
    per_file: collections.Counter[str] = collections.Counter()
    per_test: collections.Counter[str] = collections.Counter()
    for match in LINE.finditer(log):
        seconds, file, test = float(match.group(1)), match.group(3), match.group(4)
        per_file[file] += seconds
        per_test[f"{file}::{test}"] += seconds
    summary = SUMMARY.search(log)
    cores = len(os.sched_getaffinity(0))
    lines = ["# Test durations", "", f"- command: `{command}`", f"- CPU: {_cpu()}, {cores} cores",
             f"- result: {summary.group(1) if summary else 'no summary line'}, {summary.group(2) if summary else '?'} s wall",
             f"- sum of recorded setup + call + teardown: {sum(per_file.values()):.0f} s", "",
             "| seconds | file |", "| ---: | --- |"]
    lines += [f"| {seconds:.1f} | {file} |" for file, seconds in per_file.most_common()]
    lines += ["", f"Slowest {top} tests (setup + call + teardown):", "", "| seconds | test |", "| ---: | --- |"]
    lines += [f"| {seconds:.1f} | {test} |" for test, seconds in per_test.most_common(top)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log", type=Path, help="saved output of `pytest --durations=0` (default: run the suite)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--command", help="with --log: the command that wrote the log, for the table's header")
    parser.add_argument("--top", type=int, default=60)
    args = parser.parse_args()
    if args.log is not None and args.command is None:
        parser.error("--log needs --command: the table says what ran")
    command = args.command or f"{Path(sys.executable).parent / 'pytest'} {MAKE_TEST_OPTIONS} --durations=0"
    if args.log is not None:
        log = args.log.read_text()
    else:
        started = time.time()
        log = subprocess.run(command.split(), capture_output=True, text=True).stdout
        print(f"suite ran {time.time() - started:.0f} s", file=sys.stderr)
    args.out.write_text(table(log, command.replace(str(Path.cwd()) + "/", ""), args.top))


if __name__ == "__main__":
    main()
