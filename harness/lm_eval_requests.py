"""How an lm-eval request becomes engine requests and stream rows. `DeepInferLM` (harness/lm_eval_model.py)
and the `lm-eval` suite kind (harness/lm_eval_suite.py) both go through this module, so a request
served either way has the same id, prompt, params and stored row.

- loglikelihood (context, continuation): encoded as lm-eval's TemplateLM encodes a pair, BOS first,
  the oldest context tokens dropped until it fits; served teacher-forced (`Scoring`). Row: prompt =
  the context ids, tokens = the continuation ids with their prompt logprobs and top-2, finish "forced".
- loglikelihood_rolling (text): lm-eval's disjoint rolling windows, each a `Scoring` (the first
  one's context is BOS), named `<id>/w<k>`.
- generate_until (context, kwargs): a `Generation`, stored as `deepinfer audit run` stores a stream.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from deepinfer import LLM, RequestOutput, SamplingParams
from deepinfer.errors import DeepInferError
from deepinfer.harness.suite_base import TOP_LOGPROBS, failed_fields, generated_fields, request_seed

if TYPE_CHECKING:
    from lm_eval.api.instance import Instance

FORCED = "forced"  # finish reason of a teacher-forced (scored, not generated) stream
GENERATION_KWARGS = frozenset({"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k", "min_p"})
DEFAULT_MAX_GEN_TOKS = 256
SCORING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, logprobs=TOP_LOGPROBS, prompt_logprobs=True)
SCORING_TYPES = ("loglikelihood", "loglikelihood_rolling")


class EvalError(DeepInferError, ValueError):
    """An lm-eval request or model argument the adapter cannot serve."""


class RequestNames:
    """Stable request ids `task/doc/type/choice`, with `#k` for the k-th repeat of a repeated request
    (one counter per run, so the ids do not depend on how the requests are batched)."""

    def __init__(self) -> None:
        self._seen: Counter[str] = Counter()

    def __call__(self, instances: list[Instance]) -> list[str]:
        names = []
        for instance in instances:
            name = f"{instance.task_name}/{instance.doc_id}/{instance.request_type}/{instance.idx}"
            repeat = self._seen[name]
            self._seen[name] += 1
            names.append(f"{name}#{repeat}" if repeat else name)
        return names


def window_id(name: str, window: int) -> str:
    return f"{name}/w{window}"


def request_params(request_id: str, instance: Instance, run_seed: int) -> SamplingParams:
    """The engine params of an lm-eval request: fixed for scoring, from its kwargs for generate_until."""
    if instance.request_type in SCORING_TYPES:
        return SCORING_PARAMS
    if instance.request_type == "generate_until":
        return generation_params(request_id, instance.args[1], run_seed)
    raise EvalError(f"{request_id}: unsupported lm-eval request type {instance.request_type!r}")


def generation_params(name: str, kwargs: dict, run_seed: int) -> SamplingParams:
    """generate_until's kwargs as SamplingParams, seeded from the run seed and the request id."""
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
        seed=request_seed(run_seed, name), logprobs=TOP_LOGPROBS,
    )


def typed_params(request_type: str, params: SamplingParams) -> dict:
    """The params a row records: the lm-eval request type, then the engine's params."""
    return {"request_type": request_type, **params.to_dict(skip_defaults=True)}


@dataclass(frozen=True)
class Scoring:
    """Teacher-force `continuation` after `context` (prompt = both, prompt logprobs on)."""

    request_id: str
    request_type: str
    context: list[int]
    continuation: list[int]
    text: str
    params: ClassVar[SamplingParams] = SCORING_PARAMS

    @property
    def prompt(self) -> list[int]:
        return self.context + self.continuation

    def row_fields(self, output: RequestOutput) -> dict:
        """make_row's prompt, params and stream fields: the continuation and its prompt logprobs."""
        if output.error is not None:
            return failed_fields(self.context, typed_params(self.request_type, self.params), output)
        start = len(self.context) - 1  # prompt_logprobs[i] scores prompt token i + 1
        top = output.prompt_top_logprobs[start:]
        return dict(prompt_token_ids=self.context, params=typed_params(self.request_type, self.params),
                    token_ids=self.continuation, logprobs=output.prompt_logprobs[start:],
                    top_token_ids=[[i for i, _ in t] for t in top], top_logprobs=[[lp for _, lp in t] for t in top],
                    text=self.text, finish_reason=FORCED)


@dataclass(frozen=True)
class Generation:
    """Generate after `prompt` with `params`."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    request_type: ClassVar[str] = "generate_until"

    def row_fields(self, output: RequestOutput) -> dict:
        return generated_fields(typed_params(self.request_type, self.params), output)


def score(fields: dict) -> tuple[float, bool]:
    """lm-eval's answer for a scored row: (sum of the continuation's logprobs, whether each token was greedy)."""
    greedy = all(top[0] == token for top, token in zip(fields["top_token_ids"], fields["token_ids"]))
    return sum(fields["logprobs"]), greedy


class LmEvalText:
    """lm-eval's tokenization rules over an engine's tokenizer and length limit: builds the engine
    requests of lm-eval requests."""

    def __init__(self, llm: LLM, where: str | None = None) -> None:
        if llm.tokenizer is None:
            prefix = f"{where}: " if where else ""
            raise EvalError(f"{prefix}lm-eval needs text: the checkpoint has no tokenizer.json")
        self.tokenizer = llm.tokenizer
        self.max_length = llm.max_model_len - 1  # the longest prompt: the engine keeps room for one token

    @property
    def bos(self) -> int:
        return self.tokenizer.bos_id

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def with_bos(self, ids: list[int]) -> list[int]:
        return ids if ids[:1] == [self.bos] else [self.bos, *ids]

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """As lm-eval's TemplateLM (causal): an empty context becomes BOS; otherwise the context's
        trailing spaces move to the continuation and the whole is encoded, then split."""
        if context == "":
            ids = self.encode(continuation)
            return ([self.bos], ids) if ids[:1] != [self.bos] else (ids[:1], ids[1:])
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, context_ids = self.encode(context + continuation), self.encode(context)
        return context_ids, whole[len(context_ids):]

    def scoring(self, request_id: str, request_type: str, context: list[int], continuation: list[int]) -> Scoring:
        """Drop the oldest tokens until context + continuation fits; at least one context token stays."""
        whole = (context + continuation)[-self.max_length:]
        cut = max(len(whole) - len(continuation), 1)
        return Scoring(request_id, request_type, whole[:cut], whole[cut:], self.decode(whole[cut:]))

    def loglikelihood(self, request_id: str, context: str, continuation: str) -> Scoring:
        context_ids, continuation_ids = self.encode_pair(context, continuation)
        return self.scoring(request_id, "loglikelihood", self.with_bos(context_ids), continuation_ids)

    def rolling(self, request_id: str, text: str) -> list[Scoring]:
        windows = get_rolling_token_windows(self.encode(text), self.bos, max_seq_len=self.max_length - 1,
                                            context_len=1)
        return [self.scoring(window_id(request_id, w), "loglikelihood_rolling", *make_disjoint_window(window))
                for w, window in enumerate(windows)]

    def generation(self, request_id: str, context: str, params: SamplingParams) -> Generation:
        """The context's most recent tokens that leave room for `params.max_tokens`."""
        keep = max(self.max_length - params.max_tokens, 1)
        return Generation(request_id, self.with_bos(self.encode(context))[-keep:], params)

    def requests(self, request_id: str, instance: Instance, params: SamplingParams) -> list[Scoring | Generation]:
        """The engine requests of one lm-eval request (several only for a long rolling text); `params`
        are its `request_params`."""
        kind, args = instance.request_type, instance.args
        if kind == "loglikelihood":
            return [self.loglikelihood(request_id, *args)]
        if kind == "loglikelihood_rolling":
            return self.rolling(request_id, args[0])
        if kind == "generate_until":
            return [self.generation(request_id, args[0], params)]
        raise EvalError(f"{request_id}: unsupported lm-eval request type {kind!r}")
