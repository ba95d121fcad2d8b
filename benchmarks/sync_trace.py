"""Where a decode step synchronises with the GPU: the Python stack of every synchronising call.

    python benchmarks/sync_trace.py [--preset flash-4l] [--batch 1] [--steps 12]

Runs `--steps` decode steps and prints how many synchronisations (`torch.cuda.set_sync_debug_mode`)
each made and, for every one other than the runner's download, the innermost frames of its stack.
"""

from __future__ import annotations

import argparse
import traceback
import warnings

import torch

from decode_step_profile import SYNC_WARNING, decoding_engine, engine_config
from deepinfer import LLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="flash-4l")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    model = LLM(f"preset:{args.preset}", engine_config("bfloat16", "batch_invariant", 1))
    llm = decoding_engine(model, args.batch, new_tokens=args.steps)
    found = []

    def record(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING in str(message):
            found.append((step, "".join(traceback.format_stack(limit=8)[:-1])))

    for step in range(args.steps):
        torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                llm.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    counts = [sum(1 for at, _ in found if at == step) for step in range(args.steps)]
    print("synchronisations per step:", counts)
    for step, stack in found:
        if "deepinfer/transfer.py" not in stack:  # the step's one download is expected
            print(f"--- step {step}\n{stack}")


if __name__ == "__main__":
    main()
