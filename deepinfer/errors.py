"""The one error family users see: every message is a single line that names the problem.

An error that stops one request (rather than a whole command) is recorded in audit rows by its `kind`
and its `detail`, never by its `where`: the same prompt fails the same way whichever file or folder
it was read from, so two runs of it compare equal.
"""

from __future__ import annotations

# The last one is raised by the engine mid-request (NaN weights, say), not at intake.
ERROR_KINDS = ("malformed", "unsupported_content", "prompt_too_long", "invalid_request", "non_finite_logits")


class DeepInferError(Exception):
    """Base class for errors caused by bad input (files, flags, prompts, parameters).

    `detail` is the problem; `where` (optional) the input it was found in, e.g. `file:line`; `str()`
    is `where: detail`. `kind` (one of ERROR_KINDS) classifies a request that cannot be served.
    """

    kind = "invalid_request"

    def __init__(self, detail: str = "", *, where: str | None = None, kind: str | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.where = where
        if kind is not None:
            if kind not in ERROR_KINDS:
                raise ValueError(f"unknown error kind {kind!r}")
            self.kind = kind

    def __str__(self) -> str:
        return f"{self.where}: {self.detail}" if self.where else self.detail

    def at(self, where: str) -> DeepInferError:
        """This error, located at `where` (replacing any location it had)."""
        self.where = where
        return self


def first_line(error: BaseException) -> str:
    """The first non-empty line of an exception's message (libraries' messages run to several lines),
    or its type's name when it has none."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
