"""lm-eval's view of the engine: `DeepInferLM`, a `TemplateLM` registered as model "deepinfer".

    lm_eval.simple_evaluate(model="deepinfer", model_args="model=DIR,batch_size=8,run_dir=RUN", ...)

(after `import harness.lm_eval_model`, which registers it). Scoring requests are teacher-forced
through the engine's prompt logprobs, so `loglikelihood` sees exactly the numbers the engine would
report for those tokens, and `batch_size` is the engine's `max_num_seqs`: the engine, not lm-eval,
batches requests. With `run_dir`, every request served becomes one stream row of a run in the audit
store, in the order lm-eval asks (which does not depend on the batch size), so two evaluations can
be compared request by request:

- loglikelihood: prompt = context ids, tokens = continuation ids with their logprobs, finish "forced";
- loglikelihood_rolling: one row per window, the first being the text as continuation of BOS;
- generate_until: the generated stream, as `deepinfer audit run` records it.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from pathlib import Path

from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from audit.manifest import build_manifest
from audit.store import RunStore, make_row
from deepinfer import LLM, RequestOutput, SamplingParams
from deepinfer.errors import DeepInferError
from harness.suites import TOP_LOGPROBS, request_seed

FORCED = "forced"  # finish reason of a teacher-forced (scored, not generated) stream
GENERATION_KWARGS = frozenset({"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k", "min_p"})
DEFAULT_MAX_GEN_TOKS = 256


class EvalError(DeepInferError, ValueError):
    """An lm-eval request or model argument the adapter cannot serve."""


def _positive_int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise EvalError(f"{name} must be a positive integer, got {value!r}")
    return value


@register_model("deepinfer")
class DeepInferLM(TemplateLM):
    """The DeepInfer engine behind lm-eval's three request types.

    `model` is a checkpoint folder (None: the embedded tiny checkpoint); `numerics`, `dtype`,
    `device`, `max_model_len` and `max_num_batched_tokens` go to `LLM`; `batch_size` is the
    engine's `max_num_seqs`; `run_seed` seeds sampled generations (per request id, so not by
    arrival); `run_dir` (a new folder) receives the run; `suite` describes the tasks in its manifest.
    """

    def __init__(
        self, model: str | None = None, numerics: str = "batch_invariant", dtype: str = "float32",
        device: str = "cpu", batch_size: int = 32, max_model_len: int | None = None,
        max_num_batched_tokens: int = 512, run_seed: int = 0, run_dir: str | Path | None = None,
        suite: dict | None = None,
    ) -> None:
        super().__init__()
        self.batch_size = _positive_int(batch_size, "batch_size")
        self.run_seed = run_seed
        engine = dict(device=device, dtype=dtype, numerics=numerics, max_num_seqs=self.batch_size,
                      max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len)
        self.llm = LLM(model, seed=run_seed, **engine)
        if self.llm.tokenizer is None:
            raise EvalError(f"{model}: lm-eval needs text: the checkpoint has no tokenizer.json")
        self.text = self.llm.tokenizer
        self._next_index = 0
        self._names: Counter[str] = Counter()
        self._pending: list[str] = []  # names of the loglikelihood requests on their way to _loglikelihood_tokens
        self._started = time.perf_counter()
        self.store: RunStore | None = None
        if run_dir is not None:
            manifest = build_manifest(
                engine={**engine, "max_model_len": self.llm.max_model_len},
                checkpoint={"path": str(model) if model is not None else None, "content_hash": self.llm.model_id},
                suite=suite or {"kind": "lm-eval"}, seeds={"run_seed": run_seed},
                variant={"name": f"batch-{self.batch_size}", "batch_size": self.batch_size},
            )
            self.store = RunStore.create(run_dir, manifest)
            # A run left open when the process exits normally is still sealed.
            self._finalizer = weakref.finalize(self, self.store.finalize)

    def finalize(self) -> dict | None:
        """Seal the run (streams.parquet and root.json) and return its root; None without a run_dir
        or when already sealed."""
        return self._finalizer() if self.store is not None else None

    # what TemplateLM needs ------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.text.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.text.bos_id

    @property
    def max_length(self) -> int:
        """The longest prompt the engine takes (it keeps room for one generated token)."""
        return self.llm.max_model_len - 1

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Text ids without BOS unless asked for; requests get their BOS in `_with_bos`."""
        return self.text.encode(string, add_bos=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.text.decode(tokens)

    def get_model_info(self) -> dict:
        return {"engine": "deepinfer", "model_id": self.llm.model_id, "numerics": self.llm.numerics,
                "dtype": str(self.llm.dtype).removeprefix("torch."), "device": str(self.llm.device),
                "engine_batch_size": self.batch_size}

    # the three request types -----------------------------------------------------------------------

    def loglikelihood(self, requests: list[Instance], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        self._pending = self._request_names(requests)
        return super().loglikelihood(requests, disable_tqdm)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """((context, continuation) strings, context ids, continuation ids) -> (logprob, is_greedy).
        Requests that do not come through `loglikelihood` are named by their position in the run."""
        names, self._pending = self._pending, []
        if len(names) != len(requests):
            names = [f"loglikelihood/{self._next_index + i}" for i in range(len(requests))]
        pairs = [(self._with_bos(context), continuation) for _, context, continuation in requests]
        return self._score(names, pairs, "loglikelihood")

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        names, pairs, owner = [], [], []
        for number, (name, request) in enumerate(zip(self._request_names(requests), requests)):
            windows = get_rolling_token_windows(self.tok_encode(request.args[0]), self.prefix_token_id,
                                                max_seq_len=self.max_length - 1, context_len=1)
            for w, window in enumerate(map(make_disjoint_window, windows)):
                names.append(f"{name}/w{w}")
                pairs.append(window)
                owner.append(number)
        totals = [0.0] * len(requests)
        for number, (logprob, _) in zip(owner, self._score(names, pairs, "loglikelihood_rolling")):
            totals[number] += logprob
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        names = self._request_names(requests)
        prompts, params = [], []
        for name, request in zip(names, requests):
            context, kwargs = request.args
            sampling = self._generation_params(name, kwargs)
            keep = max(self.max_length - sampling.max_tokens, 1)
            prompts.append(self._with_bos(self.tok_encode(context))[-keep:])
            params.append(sampling)
        arrival = self._now()
        outputs = self.llm.generate(prompts, params)
        finish = self._now()
        rows = [self._row(name, out.prompt_token_ids,
                          {"request_type": "generate_until", **sp.to_dict(skip_defaults=True)}, out.token_ids,
                          out.logprobs, out.top_logprobs or [], out.text, out.finish_reason, arrival, finish)
                for name, sp, out in zip(names, params, outputs)]
        self._record(rows)
        return [out.text for out in outputs]

    # helpers ---------------------------------------------------------------------------------------

    def _request_names(self, requests: list[Instance]) -> list[str]:
        """Stable ids: task/doc/type/choice, with #k for the k-th repeat of a repeated request."""
        names = []
        for request in requests:
            name = f"{request.task_name}/{request.doc_id}/{request.request_type}/{request.idx}"
            repeat = self._names[name]
            self._names[name] += 1
            names.append(f"{name}#{repeat}" if repeat else name)
        return names

    def _with_bos(self, ids: list[int]) -> list[int]:
        return ids if ids[:1] == [self.prefix_token_id] else [self.prefix_token_id, *ids]

    def _generation_params(self, name: str, kwargs: dict) -> SamplingParams:
        unknown = sorted(set(kwargs) - GENERATION_KWARGS)
        if unknown:
            raise EvalError(f"{name}: unsupported generation kwargs {', '.join(unknown)} "
                            f"(supported: {', '.join(sorted(GENERATION_KWARGS))})")
        until = kwargs.get("until") or []
        sampled = kwargs.get("do_sample", False)
        return SamplingParams(
            temperature=float(kwargs.get("temperature", 1.0)) if sampled else 0.0,
            top_p=kwargs.get("top_p", 1.0), top_k=kwargs.get("top_k", 0), min_p=kwargs.get("min_p", 0.0),
            max_tokens=kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS),
            stop=[until] if isinstance(until, str) else list(until),
            seed=request_seed(self.run_seed, name), logprobs=TOP_LOGPROBS,
        )

    def _score(self, names: list[str], pairs: list[tuple[list[int], list[int]]], request_type: str
               ) -> list[tuple[float, bool]]:
        """Teacher-force each continuation after its context: (sum of logprobs, all greedy)."""
        scoring = SamplingParams(temperature=0.0, max_tokens=1, logprobs=TOP_LOGPROBS, prompt_logprobs=True)
        fitted = [self._fit(context, continuation) for context, continuation in pairs]
        served = [i for i, (_, continuation) in enumerate(fitted) if continuation]
        arrival = self._now()
        outputs = dict(zip(served, self.llm.generate([fitted[i][0] + fitted[i][1] for i in served], scoring)))
        finish = self._now()
        params = {"request_type": request_type, **scoring.to_dict(skip_defaults=True)}
        results, rows = [], []
        for i, (name, (context, continuation)) in enumerate(zip(names, fitted)):
            logprobs, top = _continuation_scores(outputs.get(i), len(context))
            greedy = all(t[0][0] == token for t, token in zip(top, continuation))
            results.append((sum(logprobs), greedy))
            rows.append(self._row(name, context, params, continuation, logprobs, top,
                                  self.text.decode(continuation), FORCED, arrival, finish))
        self._record(rows)
        return results

    def _fit(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """Drop the oldest tokens until context + continuation fits; at least one context token stays."""
        whole = (context + continuation)[-self.max_length:]
        cut = max(len(whole) - len(continuation), 1)
        return whole[:cut], whole[cut:]

    def _row(self, name: str, prompt: list[int], params: dict, tokens: list[int], logprobs: list[float],
             top: list[list[tuple[int, float]]], text: str | None, finish_reason: str, arrival: float,
             finish: float) -> dict:
        index = self._next_index
        self._next_index += 1
        return make_row(index=index, request_id=name, prompt_token_ids=prompt, params=params, token_ids=tokens,
                        logprobs=logprobs, top_token_ids=[[i for i, _ in t] for t in top],
                        top_logprobs=[[lp for _, lp in t] for t in top], text=text, finish_reason=finish_reason,
                        error=None, arrival_s=arrival, first_token_s=None, finish_s=finish)

    def _record(self, rows: list[dict]) -> None:
        if self.store is not None:
            self.store.append(rows)

    def _now(self) -> float:
        return time.perf_counter() - self._started


def _continuation_scores(output: RequestOutput | None, context_len: int) -> tuple[list[float], list]:
    """The continuation's slice of a scored request's prompt logprobs (none for an empty continuation)."""
    if output is None:
        return [], []
    return output.prompt_logprobs[context_len - 1:], output.prompt_top_logprobs[context_len - 1:]
