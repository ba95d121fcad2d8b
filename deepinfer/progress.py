"""Progress of long commands: a bar on a terminal; when stderr is piped (a log, CI), one status line
every STATUS_SECONDS, so a long command shows it is alive without filling the log. A piped command
that ends before its first status line prints nothing; one that printed status lines ends with a
`(done)` line.

It lives in the engine package so that `deepinfer checkpoint create` can use it; the harness (audit
runs, replay) imports it from here.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

STATUS_SECONDS = 10.0


class Progress:
    """`unit` done so far (requests of a run, tensors of a checkpoint, ...), out of `total`; silent
    when not `enabled`."""

    def __init__(self, label: str, total: int, done: int = 0, enabled: bool = True, unit: str = "requests") -> None:
        self.label, self.total, self.done, self.unit = label, total, done, unit
        terminal = sys.stderr.isatty()
        self._bar = tqdm(total=total, initial=done, desc=label, unit=f" {unit}", leave=False,
                         disable=not (enabled and terminal))
        self._piped = enabled and not terminal
        self._shown = False  # a status line was printed
        self._next_status = time.monotonic() + STATUS_SECONDS

    def update(self, count: int = 1) -> None:
        self.done += count
        self._bar.update(count)
        if self._piped and time.monotonic() >= self._next_status:
            self._status("")
            self._next_status = time.monotonic() + STATUS_SECONDS

    def close(self) -> None:
        self._bar.close()
        if self._piped and self._shown:
            self._status(" (done)")

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # stopped by an error: no `(done)` line
            self._bar.close()

    def _status(self, suffix: str) -> None:
        self._shown = True
        print(f"{self.label}: {self.done}/{self.total} {self.unit}{suffix}", file=sys.stderr, flush=True)
