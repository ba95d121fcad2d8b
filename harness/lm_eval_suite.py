"""The `lm-eval` suite kind: `lm-eval:TASKS[?include_path=DIR][&limit=N]`, TASKS being comma-separated tasks
or tags of the shipped offline tasks (harness/suites/lm_eval) or of the user's task folder DIR (lm-eval's
`--include_path`), e.g. `lm-eval:deepinfer`, `lm-eval:deepinfer_mc?limit=5` or
`lm-eval:my_task?include_path=tasks&limit=5`.

The suite is every request lm-eval would send a model for those tasks, in lm-eval's order: the tasks
are run once through `lm_eval.simple_evaluate` against a model that only writes the requests down.
Each becomes a `LmEvalRequest` whose prompt, params and stored row come from harness.lm_eval_requests,
as `DeepInferLM` serves them, so the rows equal those of `deepinfer audit eval`'s runs. A rolling
text must fit one window at the run's max_model_len (its request is `<id>/w0`); a longer one is
recorded as an error row.

The content hash (harness.evaluate.suite_hash) covers the shipped task files, those of DIR (every file,
recursively), the task list and the limit; DIR's location is not hashed, the suite's target records it
as an absolute path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import lm_eval
from lm_eval.api.instance import Instance
from lm_eval.api.model import LM

from deepinfer import LLM, RequestOutput, SamplingParams
from deepinfer.harness import evaluate  # keeps lm-eval and `datasets` offline (neither has loaded `datasets` yet)
from deepinfer.harness.lm_eval_requests import (EvalError, Generation, LmEvalText, RequestNames, Scoring, request_params,
                                      typed_params, window_id)
from deepinfer.harness.suite_base import Suite, SuiteRequest

KIND = "lm-eval"
QUERY_KEYS = ("include_path", "limit")


@dataclass
class LmEvalRequest(SuiteRequest):
    """One lm-eval request (`name`: its id before any window suffix); `request` is None."""

    name: str = ""
    instance: Instance | None = None

    def params(self, run_seed: int, llm: LLM | None = None) -> SamplingParams:
        return request_params(self.name, self.instance, run_seed)

    def prompt_ids(self, llm: LLM) -> list[int]:
        return self.engine_request(llm, self.params(0)).prompt  # the seed does not change the prompt

    def row_params(self, params: SamplingParams) -> dict:
        return typed_params(self.instance.request_type, params)

    def row_fields(self, llm: LLM, params: SamplingParams, output: RequestOutput) -> dict:
        return self.engine_request(llm, params).row_fields(output)

    def engine_request(self, llm: LLM, params: SamplingParams) -> Scoring | Generation:
        requests = LmEvalText(llm).requests(self.name, self.instance, params)
        if len(requests) > 1:
            raise EvalError(f"{self.name}: the text needs {len(requests)} rolling windows at max_model_len "
                            f"{llm.max_model_len}; an lm-eval suite scores one window per text: raise max_model_len",
                            kind="prompt_too_long")
        return requests[0]


class _Recorder(LM):
    """A model that answers nothing useful and writes down every request it is sent, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Instance] = []

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self.requests += requests
        return [(0.0, False)] * len(requests)

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        self.requests += requests
        return [0.0] * len(requests)

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        self.requests += requests
        return [""] * len(requests)


def load_lm_eval_suite(target: str) -> Suite:
    """`TASKS[?include_path=DIR][&limit=N]` as a Suite; one-line EvalError for an unknown task, a missing
    folder or a bad query."""
    names, _, query = target.partition("?")
    include, limit = _query(query, target)
    if not names.strip(","):
        raise EvalError(f"suite '{KIND}:{target}' names no task (e.g. {KIND}:deepinfer)")
    manager = evaluate.task_manager(include)
    tasks = evaluate.parse_tasks(names, manager)
    recorder = _Recorder()
    lm_eval.simple_evaluate(model=recorder, tasks=list(tasks), task_manager=manager, limit=limit,
                            bootstrap_iters=0, log_samples=False)
    ids = RequestNames()(recorder.requests)
    requests = [
        LmEvalRequest(window_id(name, 0) if instance.request_type == "loglikelihood_rolling" else name, None,
                      name=name, instance=instance)
        for name, instance in zip(ids, recorder.requests)
    ]
    for request in requests:
        request.params(0)  # unsupported generation kwargs stop the suite before anything is written
    parameters = [f"include_path={include}"] if include is not None else []
    parameters += [f"limit={limit}"] if limit is not None else []
    spec = ",".join(tasks) + ("?" + "&".join(parameters) if parameters else "")
    return Suite(KIND, evaluate.SUITES, evaluate.suite_hash(tasks, limit, include), requests, target=spec)


def _query(query: str, target: str) -> tuple[Path | None, int | None]:
    """The include folder and the limit of `include_path=DIR&limit=N` (each optional, in any order)."""
    values: dict[str, str] = {}
    for parameter in query.split("&") if query else []:
        key, equals, value = parameter.partition("=")
        if key not in QUERY_KEYS or not equals or not value or key in values:
            raise EvalError(f"suite '{KIND}:{target}': expected ?include_path=DIR&limit=N (each at most once, "
                            f"N a positive integer) after the tasks, got {parameter!r}")
        values[key] = value
    limit = values.get("limit")
    if limit is not None and (not limit.isdecimal() or int(limit) < 1):
        raise EvalError(f"suite '{KIND}:{target}': expected ?limit=N with N a positive integer after the tasks")
    include = evaluate.include_folder(values["include_path"]) if "include_path" in values else None
    return include, int(limit) if limit is not None else None
