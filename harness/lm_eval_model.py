"""lm-eval's view of the engine: `DeepInferLM`, a `TemplateLM` registered as model "deepinfer".

    import deepinfer.harness.lm_eval_model  # registers "deepinfer"
    lm_eval.simple_evaluate(model="deepinfer", model_args="model=DIR,run_dir=RUN", batch_size=8, ...)

The import is needed: lm-eval 0.4.13 resolves a model name only in its own registry
(`lm_eval.api.registry.get_model` reads no entry points and has no plugin hook), so "deepinfer" exists
once this module has run. From the shell, `deepinfer lm-eval ...` (harness/lm_eval_cli.py) imports it
and then runs lm-eval's own command line.

Scoring requests are teacher-forced through the engine's prompt logprobs, so `loglikelihood` sees
exactly the numbers the engine would report for those tokens, and `batch_size` is the engine's
`max_num_seqs`: the engine, not lm-eval, batches requests. With `run_dir`, every request served becomes
one stream row of a run in the audit store, in the order lm-eval asks (which does not depend on the
batch size), so two evaluations can be compared request by request. harness.lm_eval_requests turns
each request into engine requests and rows (loglikelihood and rolling windows teacher-forced, finish
"forced"; generate_until the generated stream), the same way the `lm-eval:TASKS` suite of
`deepinfer audit certify` does.
"""

from __future__ import annotations

import inspect
import re
import time
import weakref
from contextlib import ExitStack
from dataclasses import fields
from pathlib import Path

import lm_eval.models  # noqa: F401  lm-eval's own models: get_model adds them only to an empty registry
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string

from deepinfer.audit.files import folder_lock
from deepinfer import LLM
from deepinfer.engine.config import EngineConfig
from deepinfer.errors import DeepInferError
from deepinfer.harness.lm_eval_requests import (FORCED, EvalError, Generation, LmEvalText, RequestNames, Scoring, request_params,
                                      score)
from deepinfer.harness.run_writer import RunWriter, open_run, run_manifest

__all__ = ["FORCED", "DeepInferLM", "EvalError"]

# lm-eval's own settings that reach the model next to model_args; its CLI always passes both
LM_EVAL_FLAGS = {"batch_size": "--batch_size, default 1", "device": "--device, default cuda:0"}


# EngineConfig settings lm-eval's model_args may set (max_num_seqs is batch_size, seed is run_seed).
ENGINE_ARGS = tuple(f.name for f in fields(EngineConfig) if f.name not in ("max_num_seqs", "seed"))


def _positive_int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise EvalError(f"{name} must be a positive integer, got {value!r}")
    return value


def _engine_batch_size(value: object) -> int:
    """lm-eval's batch size (an int, or a decimal string from its CLI) as the engine's max_num_seqs.
    lm-eval's `auto` probes for the largest batch that fits; the engine schedules its own batches."""
    if isinstance(value, str) and value.strip().lower().startswith("auto"):
        raise EvalError(f"batch_size {value!r} is not supported: the engine batches requests itself; "
                        f"give a number (it is the engine's max_num_seqs)")
    if isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
        value = int(value)
    return _positive_int(value, "batch_size")


def model_arguments(model_args: dict, lm_eval_settings: dict) -> dict:
    """DeepInferLM's keyword arguments from lm-eval's `model_args` and the settings lm-eval adds
    (`batch_size`, `max_batch_size`, `device`; None when not given). A setting also given in
    model_args must have the same value: lm-eval's CLI always passes batch_size and device."""
    known = [name for name in inspect.signature(DeepInferLM.__init__).parameters if name not in ("self", "engine")]
    known += [name for name in ENGINE_ARGS if name not in known]
    settings = {key: value for key, value in lm_eval_settings.items() if value is not None}
    if "max_batch_size" in settings or "max_batch_size" in model_args:
        raise EvalError("max_batch_size only applies to batch_size auto, which deepinfer does not use: "
                        "give batch_size N (the engine's max_num_seqs)")
    unknown = sorted(set(model_args) - set(known))
    if unknown:
        raise EvalError(f"unknown model_args {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    args = dict(model_args)
    if "batch_size" in args:
        args["batch_size"] = _engine_batch_size(args["batch_size"])
    if "batch_size" in settings:
        settings["batch_size"] = _engine_batch_size(settings["batch_size"])
    for key, flag in LM_EVAL_FLAGS.items():
        if key in settings and key in args and args[key] != settings[key]:
            raise EvalError(f"{key} given twice: {args[key]!r} in model_args, {settings[key]!r} from lm-eval "
                            f"({flag}); give it once")
    device = str(settings.get("device", ""))
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvalError(f"device {device!r} from lm-eval, but CUDA is not available here "
                        f"(lm-eval's CLI passes cuda:0 unless given --device): pass --device cpu")
    return {**args, **{key: settings[key] for key in LM_EVAL_FLAGS if key in settings}}


@register_model("deepinfer")
class DeepInferLM(TemplateLM):
    """The DeepInfer engine behind lm-eval's three request types.

    `model` is a checkpoint folder (None: the embedded default checkpoint); `engine` takes any other
    `EngineConfig` setting (numerics, dtype, device, max_model_len, ...); `batch_size` is the engine's
    `max_num_seqs` (None: its default); `run_seed` seeds sampled generations (per request id, so not by
    arrival); `run_dir` (a new folder, locked against a second writer until the run is sealed) receives
    the run; `suite` describes the tasks in its manifest.
    lm-eval builds it from `model_args` plus its own `batch_size` and `device` (`model_arguments`).
    """

    def __init__(
        self, model: str | None = None, batch_size: int | None = None, run_seed: int = 0,
        run_dir: str | Path | None = None, suite: dict | None = None, **engine,
    ) -> None:
        super().__init__()
        if batch_size is not None:
            engine["max_num_seqs"] = _positive_int(batch_size, "batch_size")
        self.run_seed = run_seed
        self.writer: RunWriter | None = None
        with ExitStack() as lock:  # released here unless the run opens, then when it is sealed
            if run_dir is not None:  # taken before the engine loads: a second writer is refused at once
                lock.enter_context(folder_lock(Path(run_dir)))
            self.llm = LLM(model, EngineConfig.from_dict({**engine, "seed": run_seed}, where="model_args"))
            if self.llm.layout.world > 1:
                raise DeepInferError(f"the lm-eval model runs in one process, this launch has {self.llm.layout.world}")
            self.batch_size = self.llm.engine_config.max_num_seqs
            self.text = LmEvalText(self.llm, str(model))
            self._next_index = 0
            self._names = RequestNames()
            self._started = time.perf_counter()
            if run_dir is not None:
                manifest = run_manifest(self.llm, model, suite=suite or {"kind": "lm-eval"},
                                        run_seed=run_seed,
                                        variant={"name": f"batch-{self.batch_size}", "batch_size": self.batch_size})
                # no stats.json: an lm-eval run folder holds the manifest and the streams only
                self.writer = open_run(run_dir, manifest, self.llm, stats=False)
                # A run left open when the process exits normally is still sealed.
                self._finalizer = weakref.finalize(self, _seal, self.writer, lock.pop_all())

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> DeepInferLM:
        """lm-eval's constructor for `model_args="k=v,..."`: see `model_arguments`."""
        return cls(**model_arguments(simple_parse_args_string(arg_string), additional_config or {}))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> DeepInferLM:
        """lm-eval's constructor for `model_args` as a dict (its CLI's form): see `model_arguments`."""
        return cls(**model_arguments(arg_dict, additional_config or {}))

    def finalize(self) -> dict | None:
        """Seal the run (streams.parquet and root.json) and return its root; None without a run_dir
        or when already sealed."""
        return self._finalizer() if self.writer is not None else None

    # what TemplateLM needs ------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.text.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.text.bos

    @property
    def max_length(self) -> int:
        """The longest prompt the engine takes (it keeps room for one generated token)."""
        return self.text.max_length

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Text ids without BOS unless asked for; requests get their BOS from LmEvalText."""
        return self.text.encode(string, add_bos=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.text.decode(tokens)

    def get_model_info(self) -> dict:
        return {"engine": "deepinfer", "model_id": self.llm.model_id, "numerics": self.llm.numerics,
                "dtype": str(self.llm.dtype).removeprefix("torch."), "device": str(self.llm.device),
                "engine_batch_size": self.batch_size}

    # the three request types (harness.lm_eval_requests builds the engine requests) -----------------

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return [score(fields) for fields in self._serve(self._engine_requests(requests))]

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """((context, continuation) strings, context ids, continuation ids) -> (logprob, is_greedy), for
        callers that encode themselves; named by their position in the run."""
        scorings = [self.text.scoring(f"loglikelihood/{self._next_index + i}", "loglikelihood",
                                      self.text.with_bos(context), continuation)
                    for i, (_, context, continuation) in enumerate(requests)]
        return [score(fields) for fields in self._serve(scorings)]

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """The sum over the text's windows (one row each)."""
        texts = [self._requests_of(name, request) for name, request in zip(self._names(requests), requests)]
        scores = iter(self._serve([window for windows in texts for window in windows]))
        return [sum(score(next(scores))[0] for _ in windows) for windows in texts]

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        return [fields["text"] for fields in self._serve(self._engine_requests(requests))]

    # helpers ---------------------------------------------------------------------------------------

    def _engine_requests(self, requests: list[Instance]) -> list[Scoring | Generation]:
        return [engine_request for name, request in zip(self._names(requests), requests)
                for engine_request in self._requests_of(name, request)]

    def _requests_of(self, name: str, request: Instance) -> list[Scoring | Generation]:
        return self.text.requests(name, request, request_params(name, request, self.run_seed))

    def _serve(self, requests: list[Scoring | Generation]) -> list[dict]:
        """Serve in one engine batch; record one row each; return each row's prompt, params and stream."""
        arrival = self._now()
        outputs = self.llm.generate([r.prompt for r in requests], [r.params for r in requests])
        finish = self._now()
        served = [r.row_fields(out) for r, out in zip(requests, outputs)]
        for request, row, output in zip(requests, served, outputs):
            if self.writer is not None:
                self.writer.served(self._next_index, request.request_id, row, arrival_s=arrival,
                                   first_token_s=None if output.first_token_time is None else output.first_token_time - self._started,
                                   finish_s=finish)
            self._next_index += 1
        if self.writer is not None:
            self.writer.flush()  # one part file per batch lm-eval sends
        return served

    def _now(self) -> float:
        return time.perf_counter() - self._started


def _seal(writer: RunWriter, lock: ExitStack) -> dict:
    """Seal the run, then release its folder."""
    with lock:
        return writer.finalize()
