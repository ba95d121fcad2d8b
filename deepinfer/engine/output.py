"""From sequences to what users get: stop conditions, detokenisation and `RequestOutput`."""

from __future__ import annotations

import time

from deepinfer.engine.sequence import Sequence
from deepinfer.outputs import RequestOutput
from deepinfer.recipe.tokenizer import TextTokenizer


class OutputProcessor:
    """Knows the model's end tokens, the tokenizer and the context length; reads sequences only."""

    def __init__(self, tokenizer: TextTokenizer | None, eos_token_ids: list[int], max_model_len: int,
                 numerics: str) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.numerics = numerics

    def stop(self, seq: Sequence, length: int) -> tuple[str, str | None] | None:
        """Whether `seq`, whose token `length - 1` is the one just sampled, is done: ("stop" |
        "length", text cut at a stop string or None), or None to go on. Tokens from `length` on are
        placeholders of steps still in flight and are not looked at."""
        params, token = seq.params, seq.token_ids[length - 1]
        ends = token in self.eos_token_ids and (not params.ignore_eos or seq.grammar is not None)  # a constraint's end
        if ends or token in params.stop_token_ids:
            return "stop", None
        if params.stop:
            text = self.tokenizer.decode(seq.token_ids[len(seq.prompt_token_ids):length])
            hits = [text.find(s) for s in params.stop if s in text]
            if hits:
                return "stop", text[: min(hits)]
        if self.full(seq, length):
            return "length", None
        return None

    def full(self, seq: Sequence, length: int) -> bool:
        """Whether `seq` with `length` tokens may have no more (max_tokens or the context length)."""
        return length - len(seq.prompt_token_ids) >= seq.params.max_tokens or length >= self.max_model_len

    def request_output(self, seq: Sequence) -> RequestOutput:
        text = seq.text
        if text is None and self.tokenizer is not None:
            ids = seq.output_token_ids
            if seq.finish_reason == "stop" and ids and (ids[-1] in seq.params.stop_token_ids
                                                        or ids[-1] in self.eos_token_ids):
                ids = ids[:-1]
            text = self.tokenizer.decode(ids)
        params = seq.params
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=list(seq.prompt_token_ids),
            token_ids=list(seq.output_token_ids),
            text=text,
            finish_reason=seq.finish_reason,
            seed=seq.seed,
            numerics=self.numerics,
            logprobs=list(seq.logprobs),
            top_logprobs=[list(t) for t in seq.top_logprobs] if params.logprobs else None,
            prompt_logprobs=list(seq.prompt_logprobs) if params.prompt_logprobs else None,
            prompt_top_logprobs=[list(t) for t in seq.prompt_top_logprobs] if params.prompt_logprobs else None,
            arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time,
            finish_time=time.perf_counter(),
            error=seq.error,
            error_kind=seq.error_kind,
        )
