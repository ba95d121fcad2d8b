"""What every suite kind builds on: `SuiteRequest`, `Suite`, per-request seeds and the stored row's
fields. The kinds (harness/suite_registry.py's native one, harness/traces.py, harness/lm_eval_suite.py) import
this module; harness/suite_registry.py registers them and reads specs. Nothing here imports a kind, so the
kinds and the registry never import each other in a cycle.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from pathlib import Path

from deepinfer import LLM, RequestOutput, SamplingParams
from deepinfer.prompts_file import PromptRequest
from deepinfer.sampling_params import SUITE_SEEDS, derive_seed

TOP_LOGPROBS = 2  # every stored stream keeps the top-2 logprobs, for margins at divergences


@dataclass
class SuiteRequest:
    """One request of a suite; `prompt_ids` and `params` resolve it against an engine, `row_fields`
    says what its stored row holds. Kinds that do not read a `PromptRequest` (request None) override them."""

    request_id: str
    request: PromptRequest | None

    def prompt_ids(self, llm: LLM) -> list[int]:
        return self.request.prompt_ids(llm)

    def params(self, run_seed: int, llm: LLM | None = None) -> SamplingParams:
        """The request's params with a seed always set (derived from the run seed and the request id
        when the suite gives none, so it does not depend on arrival order) and top-2 logprobs; a
        `"tool_call"` constraint is made for `llm`'s protocol when it is given."""
        params = self.request.params(llm=llm)
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
    """`make_row`'s prompt, params and stream fields for a generated stream (`failed_fields` when the
    engine could not finish it)."""
    if output.error is not None:
        return failed_fields(output.prompt_token_ids, params, output)
    top = output.top_logprobs or []
    return dict(prompt_token_ids=output.prompt_token_ids, params=params, token_ids=output.token_ids,
                logprobs=output.logprobs, top_token_ids=[[i for i, _ in row] for row in top],
                top_logprobs=[[lp for _, lp in row] for row in top], text=output.text,
                finish_reason=output.finish_reason)


def failed_fields(prompt_token_ids: list[int], params: dict, output: RequestOutput) -> dict:
    """The fields of a request the engine started but could not finish: an error row (its kind and
    detail; no tokens, as for a refusal), counted in every verdict."""
    return dict(prompt_token_ids=prompt_token_ids, params=params, token_ids=[], logprobs=[], top_token_ids=[],
                top_logprobs=[], text=None, finish_reason="error", error_kind=output.error_kind, error=output.error)


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
