"""Suites: the requests a run serves. A suite spec is `KIND:PATH` (or a bare path to a native JSONL
file); each kind turns its file into `SuiteRequest`s with stable ids, in a fixed order.

`native`: the JSONL request format of `deepinfer generate --prompts-file` (see deepinfer.prompts_file).
`traces`: agent episodes (harness/traces.py), one request per assistant turn, teacher-forced.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from deepinfer import LLM, SamplingParams
from deepinfer.errors import DeepInferError
from deepinfer.prompts_file import PromptRequest, read_prompts_file

SHIPPED = Path(__file__).parent / "suites"
TOP_LOGPROBS = 2  # every stored stream keeps the top-2 logprobs, for margins at divergences


@dataclass
class SuiteRequest:
    """One request of a suite; `prompt_ids` and `params` resolve it against an engine."""

    request_id: str
    request: PromptRequest

    def prompt_ids(self, llm: LLM) -> list[int]:
        return self.request.prompt_ids(llm)

    def params(self, run_seed: int) -> SamplingParams:
        """The request's params with a seed always set (derived from the run seed and the request id
        when the suite gives none, so it does not depend on arrival order) and top-2 logprobs."""
        params = self.request.params()
        seed = params.seed if params.seed is not None else request_seed(run_seed, self.request_id)
        return replace(params, seed=seed, logprobs=max(params.logprobs or 0, TOP_LOGPROBS))


@dataclass
class Suite:
    kind: str
    path: Path
    content_hash: str
    requests: list[SuiteRequest]

    @property
    def spec(self) -> str:
        return f"{self.kind}:{self.path}"

    def describe(self) -> dict:
        return {"kind": self.kind, "path": str(self.path), "content_hash": self.content_hash,
                "count": len(self.requests)}


def request_seed(run_seed: int, request_id: str) -> int:
    digest = hashlib.sha256(f"deepinfer-request-seed:{run_seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def load_native(path: Path) -> Suite:
    requests = [SuiteRequest(r.request_id, r) for r in read_prompts_file(str(path))]
    for request in requests:
        request.request.params()  # bad sampling params stop the suite before anything is written
    return Suite("native", path, file_hash(path), requests)


def load_traces(path: Path) -> Suite:
    from harness.traces import load_traces_suite  # harness.traces builds on this module's Suite

    return load_traces_suite(path)


SUITE_KINDS: dict[str, Callable[[Path], Suite]] = {"native": load_native, "traces": load_traces}


def load_suite(spec: str) -> Suite:
    """`KIND:PATH`, a bare path (native), or the name of a shipped native suite (e.g. `smoke`)."""
    kind, sep, rest = spec.partition(":")
    if sep and kind in SUITE_KINDS:
        loader, target = SUITE_KINDS[kind], rest
    elif sep and not Path(spec).exists():
        raise DeepInferError(f"unknown suite kind {kind!r} in {spec!r} (known: {', '.join(SUITE_KINDS)})")
    else:
        loader, target = load_native, spec
    path = Path(target)
    if not path.exists() and (SHIPPED / f"{target}.jsonl").exists():
        path = SHIPPED / f"{target}.jsonl"
    if not path.is_file():
        raise DeepInferError(f"suite {spec!r}: no such file")
    return loader(path.resolve())
