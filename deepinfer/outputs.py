"""What `LLM.generate` returns per request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """One finished request. `logprobs[i]` is the logprob of `token_ids[i]` under the model's
    unscaled distribution (before temperature and filtering); `top_logprobs[i]` lists the
    `SamplingParams.logprobs` most likely (token id, logprob) pairs there, ties to the lower id.
    With `SamplingParams.prompt_logprobs`, `prompt_logprobs[i]` is the logprob of
    `prompt_token_ids[i + 1]` given the tokens before it and `prompt_top_logprobs[i]` the
    max(`logprobs`, 1) most likely pairs there (so its first entry is the greedy choice).
    `arrival_time`, `first_token_time` and `finish_time` are `time.perf_counter()` when the request
    was queued, when its first output token was sampled and when its finish was read: timing, not
    output, so `==` ignores them. A request the engine could not finish (non-finite logits, as
    NaN weights give) has `finish_reason="error"`, says why in `error` and classifies it in `error_kind`
    (`deepinfer.errors.ERROR_KINDS`); the tokens before it stay."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str
    seed: int
    numerics: str
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] | None = None
    message: dict | None = None
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    arrival_time: float | None = field(default=None, compare=False)
    first_token_time: float | None = field(default=None, compare=False)
    finish_time: float | None = field(default=None, compare=False)
    error: str | None = None
    error_kind: str | None = None
