"""Progress of long commands: a bar on a terminal; when stderr is piped (a log, CI), one status line
every STATUS_SECONDS, so a long certification shows it is alive without filling the log."""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

STATUS_SECONDS = 10.0


class Progress:
    """Requests of one run done so far, out of `total`; silent when not `enabled`."""

    def __init__(self, label: str, total: int, done: int = 0, enabled: bool = True) -> None:
        self.label, self.total, self.done = label, total, done
        terminal = sys.stderr.isatty()
        self._bar = tqdm(total=total, initial=done, desc=label, unit="req", leave=False,
                         disable=not (enabled and terminal))
        self._piped = enabled and not terminal
        self._next_status = time.monotonic() + STATUS_SECONDS

    def update(self, count: int = 1) -> None:
        self.done += count
        self._bar.update(count)
        if self._piped and time.monotonic() >= self._next_status:
            self._status("")
            self._next_status = time.monotonic() + STATUS_SECONDS

    def close(self) -> None:
        self._bar.close()
        if self._piped:
            self._status(" (done)")

    def _status(self, suffix: str) -> None:
        print(f"{self.label}: {self.done}/{self.total} requests{suffix}", file=sys.stderr, flush=True)
