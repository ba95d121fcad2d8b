"""Turns a scheduled step into cache addresses, runs the model, and samples the new tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.config import CSA, HCA, ModelConfig
from deepinfer.engine.cache import POOL_PREFIX, CacheManager
from deepinfer.engine.sampler import sample, top_logprobs
from deepinfer.engine.scheduler import ScheduledChunk
from deepinfer.engine.sequence import Sequence
from deepinfer.model import CompressorStep, DeepseekV4, StepBatch
import kernels


@dataclass
class ChunkOutput:
    """What one scheduled chunk produced: the logprobs of the prompt tokens it scored for the first
    time (see `scored_positions`) and, when the chunk samples, the new token."""

    chunk: ScheduledChunk
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token: int | None = None
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


def scored_positions(chunk: ScheduledChunk) -> range:
    """Positions of the chunk whose logits score a prompt token (position p scores token p + 1) not
    scored before: a sequence recomputed after preemption does not score its prompt twice."""
    seq = chunk.seq
    if not seq.params.prompt_logprobs:
        return range(0)
    return range(max(chunk.start, len(seq.prompt_logprobs)), min(chunk.end, len(seq.prompt_token_ids) - 1))


class ModelRunner:
    def __init__(self, model: DeepseekV4, cache: CacheManager, device: torch.device | str, numerics: str) -> None:
        self.model = model
        self.numerics = numerics
        self.config: ModelConfig = model.config
        self.cache = cache
        self.device = torch.device(device)

    def step(self, chunks: list[ScheduledChunk]) -> list[ChunkOutput]:
        """Forward the chunks; return what each produced: prompt logprobs and/or a new token."""
        batch = self.build_batch(chunks)
        with kernels.numerics(self.numerics, self.device.type):
            logits = self.model(batch, self.cache.layer_views)
            outputs, row = [], 0
            for chunk in chunks:
                out = ChunkOutput(chunk)
                scored = scored_positions(chunk)
                if scored:
                    out.prompt_logprobs, out.prompt_top_logprobs = self._score(chunk.seq, scored,
                                                                               logits[row:row + len(scored)])
                    row += len(scored)
                if chunk.samples:
                    out.token, out.logprob, out.top = self._sample(chunk.seq, logits[row])
                    row += 1
                outputs.append(out)
            return outputs

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> tuple[int, float, list | None]:
        token = sample(logits, seq.params, seq.seed, len(seq.token_ids))
        logprobs = kernels.log_softmax(logits)
        k = seq.params.logprobs
        return token, float(logprobs[token]), top_logprobs(logprobs, k) if k else None

    def _score(self, seq: Sequence, positions: range, logits: torch.Tensor) -> tuple[list, list]:
        """Logprob of prompt token p + 1 at each position p, and the max(k, 1) most likely there
        (ties to the lower id, as in greedy sampling). log_softmax and sort are row-local."""
        logprobs = kernels.log_softmax(logits)
        targets = torch.tensor(seq.prompt_token_ids[positions.start + 1:positions.stop + 1], device=logits.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
        k = max(seq.params.logprobs or 0, 1)
        values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
        top = [list(zip(i, v)) for i, v in zip(ids[:, :k].tolist(), values[:, :k].tolist())]
        return chosen, top

    def build_batch(self, chunks: list[ScheduledChunk]) -> StepBatch:
        cache, window = self.cache, self.config.sliding_window
        ids, positions, window_write, window_read, window_valid, sample_index = [], [], [], [], [], []
        offset = 0
        for chunk in chunks:
            seq = chunk.seq
            pos = torch.arange(chunk.start, chunk.end, dtype=torch.long)
            ids.append(torch.tensor(seq.token_ids[chunk.start:chunk.end], dtype=torch.long))
            positions.append(pos)
            window_write.append(cache.slots(seq.blocks, "window", pos))
            rows = pos.unsqueeze(1) - window + 1 + torch.arange(window)
            valid = rows >= 0
            window_read.append(cache.slots(seq.blocks, "window", torch.where(valid, rows, pos.unsqueeze(1))))
            window_valid.append(valid)
            sample_index.extend(offset + p - chunk.start for p in scored_positions(chunk))
            offset += chunk.num_tokens
            if chunk.samples:
                sample_index.append(offset - 1)
        positions_t = torch.cat(positions)
        batch = StepBatch(
            input_ids=torch.cat(ids),
            positions=positions_t,
            window_write=torch.cat(window_write),
            window_read=torch.cat(window_read),
            window_valid=torch.cat(window_valid),
            sample_index=torch.tensor(sample_index, dtype=torch.long),
        )
        for layer_type in (CSA, HCA):
            if layer_type in self.config.layer_types:
                batch.compressors[layer_type] = self._compressor_step(chunks, layer_type, positions_t)
        return batch.to(self.device)

    def _compressor_step(
        self, chunks: list[ScheduledChunk], layer_type: str, positions: torch.Tensor
    ) -> CompressorStep:
        cache = self.cache
        prefix = POOL_PREFIX[layer_type]
        state_pool, entry_pool = f"{prefix}_state", f"{prefix}_entries"
        ratio = self.config.compress_rates[layer_type]
        overlap = layer_type == CSA
        span = 2 * ratio if overlap else ratio
        available = (positions + 1) // ratio
        width = max(int(available.max()), 1)
        state_write, close_read, close_valid, close_write, close_position = [], [], [], [], []
        entry_read, entry_valid = [], []
        for chunk in chunks:
            seq = chunk.seq
            pos = torch.arange(chunk.start, chunk.end, dtype=torch.long)
            state_write.append(cache.slots(seq.blocks, state_pool, pos))
            closing = pos[(pos + 1) % ratio == 0] // ratio
            first = closing * ratio - (ratio if overlap else 0)
            rows = first.unsqueeze(1) + torch.arange(span)
            valid = rows >= 0
            close_read.append(cache.slots(seq.blocks, state_pool, rows.clamp(min=0)))
            close_valid.append(valid)
            close_write.append(cache.slots(seq.blocks, entry_pool, closing))
            close_position.append(closing * ratio)
            seq_available = chunk.end // ratio
            entries = torch.arange(width).expand(chunk.num_tokens, width)
            valid_entries = entries < ((pos + 1) // ratio).unsqueeze(1)
            if seq_available > 0:
                slots = cache.slots(seq.blocks, entry_pool, entries.clamp(max=seq_available - 1))
            else:
                slots = torch.zeros_like(entries)
            entry_read.append(slots)
            entry_valid.append(valid_entries)
        return CompressorStep(
            state_write=torch.cat(state_write),
            close_read=torch.cat(close_read).view(-1, span),
            close_valid=torch.cat(close_valid).view(-1, span),
            close_write=torch.cat(close_write),
            close_position=torch.cat(close_position),
            entry_read=torch.cat(entry_read),
            entry_valid=torch.cat(entry_valid),
        )
