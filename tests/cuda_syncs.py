"""Counting the host synchronisations a piece of CUDA work makes (`torch.cuda.set_sync_debug_mode`)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

# What each synchronising call warns; the mode's own "prototype feature" notice, printed the first time
# it is switched on in a process, is not a synchronisation.
SYNC_WARNING = "called a synchronizing CUDA operation"


def synchronisations(work: Callable[[], object]) -> list[str]:
    """`file:line` of each synchronising call `work()` makes (after the device is idle)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            work()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)]
