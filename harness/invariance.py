"""The invariance matrix: one request set run under many engine configurations, compared bitwise.

A request's result is its token ids plus the IEEE-754 bits of every returned logprob (chosen and
top-k). The determinism contract says these must not change with batch size, arrival order,
staggered arrival, chunked-prefill size, preemption, speculative decoding (prompt lookup or the
checkpoint's own draft model) or prefix caching (off, or hot: every prompt already cached); `run_matrix` measures whether they do.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deepinfer import LLM, RequestOutput, SamplingParams
from deepinfer.engine.sequence import Sequence
from deepinfer.harness.serve import serve
from deepinfer.harness.sweep import FACTORS, Variant, checkpoint_drafter, draft_model_variants

# every factor of the contract (`harness.sweep.FACTORS`) over an engine that takes all requests at once
STANDARD_VARIANTS = (Variant.of("all-at-once"), *(Variant.of(name, **factor) for name, factor in FACTORS))


def model_variants(model: str | Path | None) -> tuple[Variant, ...]:
    """STANDARD_VARIANTS and, when `model` stores a draft model, speculation with it at 1, 3 and 5 drafts
    and under a confidence threshold (`draft_model_variants`)."""
    return STANDARD_VARIANTS + draft_model_variants(STANDARD_VARIANTS[0], checkpoint_drafter(model))


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams


# constraints of the standard set's structured requests: outlines-core (regex, choice, a schema) and
# llguidance (a schema with numeric bounds, a Lark grammar); each language is finite, so a random model
# ends every output within a few dozen tokens
STRUCTURED_SAMPLES = (
    {"regex": r"[a-z]{2,6}( [a-z]{2,6}){0,3}\."},
    {"json_schema": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                      "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                               "maxItems": 3}},
                     "required": ["id", "tags"], "additionalProperties": False}},
    {"choice": ["alpha", "beta", "gamma delta"]},
    {"grammar": 'start: NAME "(" (NUM ("," NUM)~0..2)? ")"\nNAME: /[a-z]{1,5}/\nNUM: /[0-9]{1,3}/', "syntax": "lark"},
    {"json_schema": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
                     "required": ["name", "ok"]}},
)


def standard_requests(vocab_size: int, count: int = 24, seed: int = 0, max_tokens: int = 24) -> list[Request]:
    """Mixed prompt lengths (short, past the tiny window, several compression windows), greedy and
    seeded sampling at temperatures 0.7-1.0 with top-p / top-k / min-p, logprobs with top-2; every
    fourth request structured (`STRUCTURED_SAMPLES` in turn), so constrained and free rows share batches."""
    rng = random.Random(seed)
    lengths = [1, 5, 17, 33, 48, 64, 97, 130, 160, 200, 250, 300]
    requests = []
    for i in range(count):
        prompt = [rng.randrange(2, vocab_size) for _ in range(lengths[i % len(lengths)] + rng.randrange(3))]
        if i % 3 == 0:
            params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
        else:
            params = SamplingParams(
                temperature=rng.choice([0.7, 0.8, 0.9, 1.0]), top_p=rng.choice([0.9, 0.95, 1.0]),
                top_k=rng.choice([0, 20, 50]), min_p=rng.choice([0.0, 0.05]), seed=1000 + i,
                max_tokens=max_tokens, logprobs=2, ignore_eos=True,
            )
        if i % 4 == 3:
            params.structured = STRUCTURED_SAMPLES[i // 4 % len(STRUCTURED_SAMPLES)]
        requests.append(Request(prompt, params))
    return requests


def signature(output: RequestOutput) -> tuple:
    """Token ids and the exact bits of every logprob the request returned."""
    bits = tuple(struct.pack("<f", lp) for lp in output.logprobs)
    top = tuple(tuple((i, struct.pack("<f", lp)) for i, lp in row) for row in output.top_logprobs or [])
    return tuple(output.token_ids), bits, top


class ReferenceDrafter:
    """Drafts from known continuations (a run's prompt + output streams), deliberately wrong at every
    `wrong_every`-th token position of a sequence, so that verification both keeps and rejects
    drafts: outputs must not change either way (speculation's contract), and the share kept sets
    how much a step yields (an oracle drafter at a chosen acceptance rate)."""

    on_device = False

    def __init__(self, streams: list[list[int]], wrong_every: int) -> None:
        self.streams, self.wrong_every = streams, wrong_every

    def survivals(self, seq: Sequence) -> None:
        return None  # no confidence: throughput-aware verification goes by the rates it observes

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        token_ids = seq.known_token_ids
        for stream in self.streams:
            if stream[:len(token_ids)] == token_ids:
                drafts = stream[len(token_ids):len(token_ids) + limit]
                # wrong, and still in the vocabulary (token + 1 was not, after its last id)
                return [(token - 1 if token else 1) if (len(token_ids) + i) % self.wrong_every == 0 else token
                        for i, token in enumerate(drafts)]
        return []


class ReferenceDrafts:
    """A device drafter (`engine.draft_runner.DeviceDrafts`) drafting from known continuations: after the
    drafter it wraps has run (its caches written, its drafts made), each sampling row's drafts are
    replaced by the tokens its request's stream (a run's prompt + output, found by the request's seed,
    which must be distinct and below 2**32) has after the row's last kept token, wrong at every
    `wrong_every`-th position. Every draft is looked up on the device, so drafts that hold reach the steps
    queued behind a speculative one without the host seeing them (what async speculation must get right)."""

    def __init__(self, inner, streams: dict[int, list[int]], wrong_every: int, device) -> None:
        self.inner, self.wrong_every = inner, wrong_every
        width = max(map(len, streams.values())) + 64
        self.seeds = torch.tensor(list(streams), dtype=torch.long, device=device)
        self.streams = torch.tensor([stream + [0] * (width - len(stream)) for stream in streams.values()],
                                    dtype=torch.long, device=device)

    def run(self, step):
        made = self.inner.run(step)
        if made is None:
            return None
        drafts, _, survivals = made
        request = (step.params.seed_low.unsqueeze(1) == self.seeds).long().argmax(dim=1)
        after = step.draws_at + step.num_accepted  # the index of the first token a draft stands for
        index = (after.unsqueeze(1) + torch.arange(drafts.shape[1], device=drafts.device)).clamp(
            max=self.streams.shape[1] - 1)
        truth = self.streams[request.unsqueeze(1), index]
        wrong = index % self.wrong_every == 0
        drafts = torch.where(wrong, torch.where(truth > 0, truth - 1, 1), truth)  # wrong, still in the vocabulary
        return drafts, torch.full_like(step.num_accepted, drafts.shape[1]), survivals


def matrix_variant(variant: Variant, *, dtype: str, numerics: str, device: str) -> Variant:
    """`variant` with the matrix's dtype, numerics and device (and a 512-token context)."""
    return variant.derive(variant.name, dtype=dtype, numerics=numerics, device=device, max_model_len=512)


def run_variant(llm: LLM, requests: list[Request], variant: Variant) -> list[RequestOutput]:
    """Serve `requests` under `variant` with an engine over `llm`'s model (`LLM.with_engine`, so the
    weights are not loaded again); outputs come back in request order."""
    engine = llm.with_engine(variant.engine)
    outputs = {done.index: done.output for done in serve(engine, [(r.prompt, r.params) for r in requests], variant)}
    if variant.engine.num_cache_blocks is not None and engine.scheduler.num_preemptions == 0:
        raise AssertionError(f"variant {variant.name} was meant to force preemption but none happened")
    return [outputs[i] for i in range(len(requests))]


@dataclass
class MatrixResult:
    """Per variant, the indices of requests whose results differ from the reference variant's."""

    reference: str
    diverged: dict[str, list[int]] = field(default_factory=dict)

    @property
    def invariant(self) -> bool:
        return not any(self.diverged.values())


def run_matrix(
    model: str | Path | LLM | None, requests: list[Request], variants: tuple[Variant, ...] = STANDARD_VARIANTS, *,
    dtype: str = "float32", numerics: str = "batch_invariant", device: str = "cpu", stop_at_first: bool = False,
) -> MatrixResult:
    """Run every variant and compare each request's signature with the first variant's. The model is
    loaded once (or `model` is an `LLM` already loaded with this dtype, numerics and device)."""
    variants = tuple(matrix_variant(v, dtype=dtype, numerics=numerics, device=device) for v in variants)
    llm = model if isinstance(model, LLM) else LLM(model, variants[0].engine)
    reference = [signature(o) for o in run_variant(llm, requests, variants[0])]
    result = MatrixResult(variants[0].name)
    for variant in variants[1:]:
        got = [signature(o) for o in run_variant(llm, requests, variant)]
        result.diverged[variant.name] = [i for i, (a, b) in enumerate(zip(reference, got)) if a != b]
        if stop_at_first and result.diverged[variant.name]:
            break
    return result
