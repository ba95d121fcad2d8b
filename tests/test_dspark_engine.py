"""DSpark inside the engine (`speculation="dspark"`): the drafts a step makes on the device are the
draft model's own (its context KV written by the engine's steps, gathered through the block tables,
read at the right anchors), a rollback never recomputes anything before the rejected draft, and bad
settings are refused in one line. That outputs stay the same bits as without speculation is the V4.1
invariance matrix's (tests/test_invariance_v41.py: 1, 3 and 5 drafts and a confidence threshold, in fp32
and bf16)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deepinfer import LLM, SamplingParams
from deepinfer.engine.cache import CacheManager
from deepinfer.engine.draft_runner import confident_lengths
from deepinfer.engine.drafter import DeviceDrafter
from deepinfer.engine.runner import ModelRunner
from deepinfer.engine.scheduler import ScheduledChunk
from deepinfer.engine.sequence import Sequence
from deepinfer.errors import DeepInferError

MAX_TOKENS = 16


def _dspark(llm: LLM, **settings) -> LLM:
    return llm.with_engine(replace(llm.engine_config, speculation="dspark", **settings))


class Recording(DeviceDrafter):
    """Keeps every set of drafts the runner hands over, with the tokens they follow. Given `streams`
    (each request's prompt and plain-decoding output), it proposes those tokens instead of the device
    drafts, wrong at every `wrong_every`-th proposal, so steps keep several drafts before a rejection and
    the device drafts after them start past the chunk's first drawn token."""

    def __init__(self, streams: list[list[int]] | None = None, wrong_every: int = 3) -> None:
        self.on_device = streams is None  # proposing the streams makes it a host drafter
        self.seen: list[tuple[list[int], list[int]]] = []
        self.streams, self.wrong_every, self.proposals = streams, wrong_every, 0

    def observe(self, seq: Sequence, length: int, drafts: list[int], survivals: list[float]) -> None:
        self.seen.append((seq.token_ids[:length], drafts))
        super().observe(seq, length, drafts, survivals)

    def survivals(self, seq: Sequence) -> list[float] | None:
        return super().survivals(seq) if self.streams is None else None  # the device's are for other drafts

    def propose(self, seq: Sequence, limit: int) -> list[int] | None:
        if self.streams is None:
            return super().propose(seq, limit)
        length = len(seq.known_token_ids)
        stream = next(s for s in self.streams if s[:len(seq.prompt_token_ids)] == seq.prompt_token_ids)
        self.proposals += 1
        drafts = stream[length:length + limit]
        if self.proposals % self.wrong_every == 0 and len(drafts) > 1:
            drafts[1] = (drafts[1] + 1) % 1000
        return drafts


def _offline_drafts(llm: LLM, tokens: list[int]) -> list[int]:
    """The draft model's greedy block after `tokens`, from one forward over all but the last token."""
    model, draft = llm.model, llm.host.draft_model("dspark", True)
    anchor = len(tokens) - 1
    cache = CacheManager(model.pools, max_num_seqs=1, max_model_len=anchor, max_step_tokens=anchor,
                         num_blocks=None, block_size=16, dtype=torch.float32, device="cpu")
    seq = Sequence(0, tokens[:anchor], SamplingParams(temperature=0), seed=0)
    cache.grow(seq.blocks, anchor)
    batch, _ = ModelRunner(model, cache, "cpu").build_batch([ScheduledChunk(seq, 0, anchor)])
    batch.sample_index = None
    streams: dict[int, torch.Tensor] = {}
    model(batch, cache.layer_views, streams_at=streams)
    main_x = draft.project(draft.features(streams))
    return draft.propose(tokens[anchor], anchor, main_x).tokens.tolist()


@pytest.mark.parametrize("proposed", ["device drafts", "held drafts"])
def test_the_engine_drafts_what_the_draft_model_drafts(proposed: str) -> None:
    """Greedy requests of short and long prompts (anchors inside and past the first window), drafted in
    one batch: every block the runner drafted equals `DSpark.propose` on the sequence's own features,
    whether the step verified the device drafts (random weights: rejected) or drafts that mostly held."""
    llm = LLM("preset:v41-tiny")
    window = llm.config.sliding_window
    prompts = [list(range(5, 12)), [(7 * i) % 900 + 3 for i in range(window + 9)], list(range(40, 43))]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    streams = None
    if proposed == "held drafts":
        streams = [prompt + out.token_ids for prompt, out in zip(prompts, llm.generate(prompts, params))]
    spec = _dspark(llm, draft_tokens=llm.config.dspark_block_size)
    spec.scheduler.drafter = recording = Recording(streams)
    spec.generate(prompts, params)
    anchors = sorted(len(tokens) - 1 for tokens, _ in recording.seen)
    assert anchors[0] < window < anchors[-1] and len(recording.seen) >= 3 * 2
    if streams is not None:
        assert spec.scheduler.num_draft_kept >= 2 * spec.scheduler.num_verify_chunks  # several held per step
    for tokens, drafts in recording.seen:
        assert drafts == _offline_drafts(llm, tokens), len(tokens)


def test_a_rollback_resumes_at_the_rejected_draft() -> None:
    """After a verify chunk whose drafts failed, the sequence's next chunk starts exactly at the first
    token not kept: the rows of the rejected drafts (at most k) are rewritten, nothing is replayed."""
    llm = LLM("preset:v41-tiny")
    spec = _dspark(llm, draft_tokens=3)
    scheduler = spec.scheduler
    seq_id = spec.add_request(list(range(3, 30)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    checked = 0
    while spec.has_unfinished():
        scheduled = scheduler.schedule()
        scheduler.undo(scheduled)
        before = {chunk.seq.request_id: (chunk.end, chunk.num_draft) for chunk in scheduled.chunks}
        spec.step()
        seq = next((s for s in scheduler.running if s.request_id == seq_id), None)
        end, drafts = before.get(seq_id, (0, 0))
        if seq is not None and drafts:
            assert seq.num_computed == len(seq.token_ids) - 1 and end - seq.num_computed <= drafts
            checked += 1
    assert checked >= 3 and scheduler.num_rollbacks >= 1


# confidences 0 or at least 1e-6, so no product of five is subnormal: whether one stays subnormal or is
# flushed to zero depends on the code path (cumprod's vectorised one flushed 0.75 x 2^-149 on a Zen 3
# where the scalar product kept it); a verify length never changes outputs
CONFIDENCE = st.one_of(st.just(0.0), st.floats(1e-6, 1))


@given(st.lists(st.lists(CONFIDENCE, min_size=5, max_size=5), min_size=1, max_size=4),
       st.floats(0, 1, allow_subnormal=False))
def test_confident_lengths_count_the_leading_slots_above_the_threshold(rows: list, threshold: float) -> None:
    confidence = torch.tensor(rows, dtype=torch.float32)
    threshold = float(torch.tensor(threshold, dtype=torch.float32))  # the comparison is in fp32
    lengths, survivals = confident_lengths(confidence, threshold)
    for row, length, survival in zip(confidence, lengths.tolist(), survivals.tolist()):
        chance, chances = 1.0, []
        for value in row.tolist():
            chance = float(torch.tensor(chance, dtype=torch.float32) * value)
            chances.append(chance)
        assert survival == pytest.approx(chances, rel=1e-6)  # cumprod's running product (accumulated in double)
        assert length == next((j for j, chance in enumerate(survival) if chance < threshold), len(survival))
    assert confident_lengths(confidence, 0.0)[0].tolist() == [5] * len(rows)


@pytest.mark.parametrize("model,settings,message", [
    ("preset:tiny", {}, "speculation=dspark runs a V4.1 checkpoint's DSpark draft layers; preset:tiny:seed=0 is V4 "
                        "(its draft layers run with speculation=mtp)"),
    ("preset:v41-tiny", {"draft_confidence": 1.5}, "draft_confidence must be a number from 0 to 1, got 1.5"),
    ("preset:v41-tiny", {"draft_confidence": "high"}, "draft_confidence must be a number from 0 to 1, got 'high'"),
    ("preset:v41-tiny", {"draft_tokens": 6}, "draft_tokens=6: the checkpoint's dspark draft model proposes at most 5 "
                                             "tokens per step"),
])
def test_bad_dspark_settings_are_refused_in_one_line(model: str, settings: dict, message: str) -> None:
    with pytest.raises(DeepInferError) as err:
        LLM(model, speculation="dspark", **settings)
    assert str(err.value) == message
