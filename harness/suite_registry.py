"""Suites: the requests a run serves. A suite spec is `KIND:PATH` (or a bare path to a native JSONL
file); each kind turns its file into `SuiteRequest`s with stable ids, in a fixed order.

`native`: the JSONL request format of `deepinfer generate --prompts-file` (see deepinfer.prompts_file).
`traces`: agent episodes (harness/traces.py), one request per assistant turn, teacher-forced.
`lm-eval`: `lm-eval:TASKS[?limit=N]` names shipped lm-eval tasks, not a file (harness/lm_eval_suite.py):
every request lm-eval would send a model, scoring requests teacher-forced.

This module is the registry of kinds (`register_kind`) and reads specs (`load_suite`). The types the
kinds build on live in harness/suite_base.py (re-exported here), which the kind modules import
instead of this one: the registry imports the kinds, never the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from deepinfer.errors import DeepInferError
from deepinfer.prompts_file import read_prompts_file
from deepinfer.harness.lm_eval_cli import needs_lm_eval
from deepinfer.harness.suite_base import TOP_LOGPROBS, Suite, SuiteRequest, file_hash, generated_fields, request_seed
from deepinfer.harness.traces import load_traces_suite

__all__ = ["KINDS", "SHIPPED", "TOP_LOGPROBS", "Suite", "SuiteKind", "SuiteRequest", "file_hash", "generated_fields",
           "load_suite", "register_kind", "request_seed"]

SHIPPED = Path(__file__).parent / "suites"


@dataclass(frozen=True)
class SuiteKind:
    """A kind of suite: `KIND:TARGET` loads `load(TARGET)`. A file kind gets TARGET as a resolved path to
    an existing file (or the shipped suite of that name); a named kind (`reads_file=False`) gets the
    text after `KIND:` as it is, e.g. lm-eval's task list."""

    name: str
    load: Callable[..., Suite]
    reads_file: bool = True


KINDS: dict[str, SuiteKind] = {}  # in registration order, which error messages list them in


def register_kind(kind: SuiteKind) -> SuiteKind:
    """Make `KIND:` specs load through `kind`; a name can be registered once."""
    if kind.name in KINDS:
        raise ValueError(f"suite kind {kind.name!r} is already registered")
    KINDS[kind.name] = kind
    return kind


def load_native(path: Path) -> Suite:
    requests = [SuiteRequest(r.request_id, r) for r in read_prompts_file(str(path))]
    for request in requests:
        request.request.params()  # bad sampling params stop the suite before anything is written
    return Suite("native", path, file_hash(path), requests)


def load_lm_eval(target: str) -> Suite:
    """lm-eval is optional and slow to import: harness.lm_eval_suite loads on the first lm-eval spec."""
    with needs_lm_eval("an lm-eval suite"):
        from deepinfer.harness.lm_eval_suite import load_lm_eval_suite
    return load_lm_eval_suite(target)


register_kind(SuiteKind("native", load_native))
register_kind(SuiteKind("traces", load_traces_suite))
register_kind(SuiteKind("lm-eval", load_lm_eval, reads_file=False))


def load_suite(spec: str) -> Suite:
    """`KIND:PATH`, `KIND:NAMES` for a named kind, a bare path (native), or the name of a shipped native
    suite (e.g. `smoke`)."""
    name, sep, rest = spec.partition(":")
    kind = KINDS.get(name) if sep else None
    if kind is not None and not kind.reads_file:
        return kind.load(rest)
    if kind is not None:
        target = rest
    elif sep and not Path(spec).exists():
        raise DeepInferError(f"unknown suite kind {name!r} in {spec!r} (known: {', '.join(KINDS)})")
    else:
        kind, target = KINDS["native"], spec
    path = Path(target)
    if not path.exists() and (SHIPPED / f"{target}.jsonl").exists():
        path = SHIPPED / f"{target}.jsonl"
    if not path.is_file():
        raise DeepInferError(f"suite {spec!r}: no such file")
    return kind.load(path.resolve())
