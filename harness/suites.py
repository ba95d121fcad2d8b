"""Suites: the requests a run serves. A suite spec is `KIND:PATH` (or a bare path to a native JSONL
file); each kind turns its file into `SuiteRequest`s with stable ids, in a fixed order.

`native`: the JSONL request format of `deepinfer generate --prompts-file` (see deepinfer.prompts_file).
`traces`: agent episodes (harness/traces.py), one request per assistant turn, teacher-forced.
`lm-eval`: `lm-eval:TASKS[?limit=N]` names shipped lm-eval tasks, not a file (harness/lm_eval_suite.py):
every request lm-eval would send a model, scoring requests teacher-forced.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from deepinfer import LLM, RequestOutput, SamplingParams
from deepinfer.errors import DeepInferError
from deepinfer.prompts_file import PromptRequest, read_prompts_file
from deepinfer.sampling_params import SUITE_SEEDS, derive_seed
from harness.lm_eval_cli import needs_lm_eval

SHIPPED = Path(__file__).parent / "suites"
TOP_LOGPROBS = 2  # every stored stream keeps the top-2 logprobs, for margins at divergences


@dataclass
class SuiteRequest:
    """One request of a suite; `prompt_ids` and `params` resolve it against an engine, `row_fields`
    says what its stored row holds. Kinds that do not read a `PromptRequest` (request None) override them."""

    request_id: str
    request: PromptRequest | None

    def prompt_ids(self, llm: LLM) -> list[int]:
        return self.request.prompt_ids(llm)

    def params(self, run_seed: int) -> SamplingParams:
        """The request's params with a seed always set (derived from the run seed and the request id
        when the suite gives none, so it does not depend on arrival order) and top-2 logprobs."""
        params = self.request.params()
        seed = params.seed if params.seed is not None else request_seed(run_seed, self.request_id)
        return replace(params, seed=seed, logprobs=max(params.logprobs or 0, TOP_LOGPROBS))

    def row_params(self, params: SamplingParams) -> dict:
        """The params as the stored row records them."""
        return params.to_dict(skip_defaults=True)

    def row_fields(self, llm: LLM, params: SamplingParams, output: RequestOutput) -> dict:
        """The row's prompt, params and stream (`make_row`'s fields) for the engine's `output`: the
        generated stream here; a scoring request stores its teacher-forced continuation instead."""
        return generated_fields(self.row_params(params), output)


def generated_fields(params: dict, output: RequestOutput) -> dict:
    """`make_row`'s prompt, params and stream fields for a generated stream."""
    top = output.top_logprobs or []
    return dict(prompt_token_ids=output.prompt_token_ids, params=params, token_ids=output.token_ids,
                logprobs=output.logprobs, top_token_ids=[[i for i, _ in row] for row in top],
                top_logprobs=[[lp for _, lp in row] for row in top], text=output.text,
                finish_reason=output.finish_reason)


@dataclass
class Suite:
    kind: str
    path: Path
    content_hash: str
    requests: list[SuiteRequest]
    target: str | None = None  # what follows `KIND:` when it is not the path (lm-eval: the task list)

    @property
    def spec(self) -> str:
        return f"{self.kind}:{self.path if self.target is None else self.target}"

    def describe(self) -> dict:
        described = {"kind": self.kind, "path": str(self.path), "content_hash": self.content_hash,
                     "count": len(self.requests)}
        return described if self.target is None else {**described, "target": self.target}


def request_seed(run_seed: int, request_id: str) -> int:
    """The seed of a suite request without one: derived from its id, so it does not depend on the
    order the engine numbers requests in (which the variant's arrival order decides)."""
    return derive_seed(run_seed, request_id, SUITE_SEEDS)


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


def load_lm_eval(target: str) -> Suite:
    with needs_lm_eval("an lm-eval suite"):
        from harness.lm_eval_suite import load_lm_eval_suite  # imports lm-eval
    return load_lm_eval_suite(target)


SUITE_KINDS: dict[str, Callable[[Path], Suite]] = {"native": load_native, "traces": load_traces}
NAMED_KINDS: dict[str, Callable[[str], Suite]] = {"lm-eval": load_lm_eval}  # `KIND:` names what to load, not a file


def load_suite(spec: str) -> Suite:
    """`KIND:PATH`, `KIND:NAMES` for a named kind, a bare path (native), or the name of a shipped native
    suite (e.g. `smoke`)."""
    kind, sep, rest = spec.partition(":")
    if sep and kind in NAMED_KINDS:
        return NAMED_KINDS[kind](rest)
    if sep and kind in SUITE_KINDS:
        loader, target = SUITE_KINDS[kind], rest
    elif sep and not Path(spec).exists():
        known = ", ".join([*SUITE_KINDS, *NAMED_KINDS])
        raise DeepInferError(f"unknown suite kind {kind!r} in {spec!r} (known: {known})")
    else:
        loader, target = load_native, spec
    path = Path(target)
    if not path.exists() and (SHIPPED / f"{target}.jsonl").exists():
        path = SHIPPED / f"{target}.jsonl"
    if not path.is_file():
        raise DeepInferError(f"suite {spec!r}: no such file")
    return loader(path.resolve())
