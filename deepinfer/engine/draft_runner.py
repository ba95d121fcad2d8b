"""Drafting on the device inside engine steps: after a step has sampled, the runner hands its drafter
(`DeviceDrafts`) the step's inputs and draws (`DraftInputs`); the drafter updates its own caches and
drafts the next tokens of every sampling chunk, which go down with the step's one download. Each
draft is chosen with the sampler the target uses at that token's position (same seed, same position,
same noise), so a draft that tracks the target's distribution is kept under sampling as often as
under greedy decoding; how many a sequence verifies next follows the drafter's confidence: the
longest run of drafts whose predicted chance that all of them hold stays at or above `threshold`.

`DSparkRunner` runs V4.1's DSpark draft layers (`deepinfer.families.v41.dspark`). The target's forward also
hands over the streams entering the draft's target layers; every computed token's streams become each
draft layer's context KV, written to the draft's own window pool (`DRAFT_POOL`, one row per token per
draft layer, freed behind the window like the target's). Rows of drafts the step rejects are
rewritten before any block reads them: a block at position n reads only positions below n, and
those all held.

Then one draft block per sampling chunk runs, all at once: the block starts at the last token the
chunk yields (n: the token drawn where the first draft failed, or after the last one) and reads the
context rows of positions n - W .. n - 1 (W the sliding window, padded and masked below 0, so a
block's shapes and bits do not depend on the batch); slot j's token is chosen from the
Markov-corrected logits.

`MTPRunner` runs V4's MTP block (`deepinfer.families.v4.mtp`) as one more layer of the target's window pool
(layer `num_hidden_layers`: its rows are kept, released and addressed exactly as the target's window
rows of the same positions, with no block tables of its own). Every step runs the block over all its
tokens, each with the token after it (the next input, or where the target drew, its draw), reading the
target's final streams: that writes every position's KV row (rows past the tokens a verify step keeps
are rewritten by the step that computes those positions again, as the target's are). The output at the
last kept token's predecessor is draft 1; drafts 2 .. k come from one block step each at the next
positions, outside the paged cache: the steps' own KV rows stay in a dense context after the W - 1
rows gathered from the pool (a drafted position may lie past the blocks the sequence holds). A row
depends on the token after its position, so one that a prefix-cache hit at P brings (P - 1) holds the
token P of the sequence that cached it: drafts may differ there, outputs never.

Neither runner reads anything back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from deepinfer.engine.cache import CacheManager
from deepinfer.engine.sampler import SamplingBatch, SamplingNeeds, sample
from deepinfer.model import PoolSpec, StepBatch
from deepinfer.model.batch import CacheAddresses, Paged
from deepinfer.families.v41.dspark import DSpark
from deepinfer.families.v4.mtp import MTP
from deepinfer.model.decoder import Choose
from deepinfer.kernels import Ops

DRAFT_POOL = "draft_window"


@dataclass
class DraftInputs:
    """What a step hands its device drafter once it has sampled: the step's (device) batch, the
    streams its forward tapped and the token after each of its tokens (`next_ids` [T]: the next input,
    or at a sampled row the target's draw there; 0 for padding); per sampling chunk [S] its row in the
    batch (`sample_chunks`), the index of the first token it drew (`draws_at`), what it drew
    (`token_ids` [S, 1 + k]), how many of those count (`num_accepted`) and its sampling settings
    (`params`, any position), with what the host knows of them (`needs`)."""

    batch: StepBatch
    streams_at: dict[int, torch.Tensor]
    next_ids: torch.Tensor
    sample_chunks: torch.Tensor
    draws_at: torch.Tensor
    token_ids: torch.Tensor
    num_accepted: torch.Tensor
    params: SamplingBatch
    needs: SamplingNeeds


class DeviceDrafts(Protocol):
    def run(self, step: DraftInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Update the drafter's caches with the step's tokens and, when the step sampled, draft after
        each sampling chunk's last kept token: (drafts [S, B], how many of them to verify [S], their
        survivals [S, B] by the drafter's confidence)."""


def draft_pool(draft: DSpark) -> PoolSpec:
    """The window pool holding each draft layer's context KV (layer ids after the target's)."""
    config = draft.target_config
    first = config.num_hidden_layers
    return PoolSpec(DRAFT_POOL, "window", tuple(range(first, first + config.num_draft_layers)), config.head_dim,
                    window=config.sliding_window)


def confident_lengths(confidence: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of confidences [S, B] (each slot's chance to hold if the ones before it did): how many
    leading slots keep the chance that all of them hold at or above `threshold` (int64 [S]), and those
    chances, the survivals [S, B] (the host's throughput-aware verification weighs drafts by them)."""
    survivals = torch.cumprod(confidence, dim=1)
    return (survivals >= threshold).sum(dim=1), survivals.float()


def last_kept(step: DraftInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sampling chunk, the last token it yields and that token's index n in its sequence ([S] each):
    drafting starts there."""
    last = (step.num_accepted - 1).unsqueeze(1)
    return step.token_ids.gather(1, last).squeeze(1), step.draws_at + last.squeeze(1)


def chooser(step: DraftInputs, anchors: torch.Tensor, ops: Ops) -> Choose:
    """Choose slot j's drafts (the tokens at n + 1 + j, n = `anchors`) as the target's sampler would
    draw them there."""
    def choose(logits: torch.Tensor, slot: int) -> torch.Tensor:
        return sample(logits, replace(step.params, position=anchors + 1 + slot), ops, step.needs)

    return choose


class DSparkRunner:
    def __init__(self, draft: DSpark, cache: CacheManager, threshold: float) -> None:
        self.draft = draft
        self.threshold = threshold
        self.window = draft.target_config.sliding_window
        self.views = [cache.layer_views[layer]["window"] for layer in draft_pool(draft).layers]

    def run(self, step: DraftInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        paged = Paged.of(step.batch, self.draft.ops)
        self._write_context(step.batch, paged, step.streams_at)
        return self._propose(step, paged) if step.sample_chunks.numel() else None

    def _write_context(self, batch: StepBatch, paged: Paged, streams_at: dict[int, torch.Tensor]) -> None:
        """Write the context KV of every token of `batch` (padding goes to the null block)."""
        slots = paged.write(DRAFT_POOL, batch.positions)
        main_x = self.draft.project(self.draft.features(streams_at))
        for view, rows in zip(self.views, self.draft.context_kv(main_x, batch.positions)):
            view[slots] = rows.to(view.dtype)

    def _propose(self, step: DraftInputs, paged: Paged) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tokens, anchors = last_kept(step)
        slots, valid = paged.slots(DRAFT_POOL, step.sample_chunks, anchors, self.window, offset=-self.window)
        context = torch.stack([view[slots] for view in self.views])
        out = self.draft.blocks(tokens, anchors, context, valid)
        drafts = self.draft.drafts(out, tokens, chooser(step, anchors, self.draft.ops))
        return drafts.tokens, *confident_lengths(drafts.confidence, self.threshold)


class MTPRunner:
    def __init__(self, mtp: MTP, cache: CacheManager, draft_tokens: int, threshold: float) -> None:
        self.mtp = mtp
        self.draft_tokens, self.threshold = draft_tokens, threshold
        self.window = cache.specs["window"]
        self.cache = {"window": cache.layer_views[mtp.layer_id]["window"]}

    def run(self, step: DraftInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        out = self._write_rows(step)
        return self._propose(step, out) if step.sample_chunks.numel() else None

    def _write_rows(self, step: DraftInputs) -> torch.Tensor:
        """Run the block over every token of the step (padding writes to the null block); its output
        streams [T, n, hidden]."""
        batch = step.batch
        addresses = CacheAddresses.of(batch, [self.window], self.mtp.ops)
        return self.mtp.paged(step.next_ids, batch.positions, step.streams_at[self.mtp.layer_id], addresses,
                              self.cache)

    def _propose(self, step: DraftInputs, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _, anchors = last_kept(step)
        batch = step.batch
        first = batch.query_start[step.sample_chunks]  # each chunk's first row, at its first position
        streams = out[first + anchors - 1 - batch.positions[first]]
        width = self.window.window - 1
        slots, valid = Paged.of(batch, self.mtp.ops).slots("window", step.sample_chunks, anchors, width, offset=-width)
        drafts, confidence = self.mtp.drafts(streams, anchors, self.cache["window"][slots], valid,
                                             self.draft_tokens, chooser(step, anchors, self.mtp.ops))
        return drafts, *confident_lengths(torch.sigmoid(confidence), self.threshold)
