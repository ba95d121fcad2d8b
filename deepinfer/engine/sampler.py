"""Token choice for a whole step at once: greedy, or Gumbel-max with counter-based noise.

The noise for (seed, position, token id) comes from an integer hash evaluated in int64
arithmetic (`kernels.sampling`), so it is the same on every device and independent of batch
composition, arrival order or preemption: a request's draw at a position never depends on anything
but itself. The argmax and the Gumbel draw are the numerics table's `first_argmax` and
`gumbel_argmax` (one launch each on CUDA).
Every row-wise step (temperature, sort, softmax, cumulative sum, log) treats each row on its own,
so a row's choice is the same bits whether it is sampled alone or with others.

`SamplingBatch` carries each row's settings as tensors on the device; `sample` makes one pass
over the batch and never reads anything back to the host.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch

from deepinfer.sampling_params import SamplingParams
from deepinfer.kernels import Ops
from deepinfer.kernels.sampling import MASK32, noise_keys, uniforms


def uniform_noise(seed: int, position: int, vocab: int, device) -> torch.Tensor:
    """The uniforms [vocab] of one (seed, position)."""
    low, high, pos = (torch.tensor([v], dtype=torch.long, device=device)
                      for v in (seed & MASK32, seed >> 32, position))
    return uniforms(noise_keys(low, high, pos), vocab)[0]


@dataclass
class SamplingBatch:
    """Per-row sampling settings as device tensors [R] (R rows sampled this step)."""

    temperature: torch.Tensor  # fp32; 0 = greedy
    top_k: torch.Tensor  # int64; 0 = off
    top_p: torch.Tensor  # fp32; 1 = off
    min_p: torch.Tensor  # fp32; 0 = off
    seed_low: torch.Tensor  # int64: seed & 0xFFFFFFFF
    seed_high: torch.Tensor  # int64: seed >> 32
    position: torch.Tensor  # int64: the index the new token will have in its sequence

    @staticmethod
    def host_tensors(rows: list[tuple[SamplingParams, int, int]]) -> dict[str, torch.Tensor]:
        """The settings of (params, seed, position) per row as two host tensors, to upload with the
        step's other metadata (`from_tensors` reads them back on the device)."""
        longs = torch.tensor([[p.top_k, seed & MASK32, seed >> 32, position] for p, seed, position in rows],
                             dtype=torch.long).reshape(len(rows), 4)
        floats = torch.tensor([[p.temperature, p.top_p, p.min_p] for p, _, _ in rows],
                              dtype=torch.float32).reshape(len(rows), 3)
        return {"sampling_longs": longs, "sampling_floats": floats}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "SamplingBatch":
        longs, floats = tensors["sampling_longs"], tensors["sampling_floats"]
        return cls(temperature=floats[:, 0], top_k=longs[:, 0], top_p=floats[:, 1], min_p=floats[:, 2],
                   seed_low=longs[:, 1], seed_high=longs[:, 2], position=longs[:, 3])

    def rows(self, index: torch.Tensor) -> "SamplingBatch":
        """The settings of rows `index`."""
        return SamplingBatch(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    @classmethod
    def of(cls, params: SamplingParams, seed: int, position: int) -> "SamplingBatch":
        """One row's settings on the CPU."""
        return cls.from_tensors(cls.host_tensors([(params, seed, position)]))


def filtered_logits(logits: torch.Tensor, batch: SamplingBatch, ops: Ops) -> torch.Tensor:
    """Temperature-scaled logits [R, V] with each row's tokens outside its top-k / top-p / min-p
    set to -inf (rows with temperature 0 are scaled by 1)."""
    scaled = logits / torch.where(batch.temperature > 0, batch.temperature, 1.0).unsqueeze(1)
    order = torch.sort(scaled, dim=-1, descending=True, stable=True).indices
    probs = ops.softmax(scaled.gather(1, order))
    ranks = torch.arange(scaled.shape[-1], device=scaled.device).unsqueeze(0)
    top_k = batch.top_k.unsqueeze(1)
    ranked_keep = (top_k == 0) | (ranks < top_k)
    top_p = batch.top_p.unsqueeze(1)
    before = torch.cumsum(probs, dim=-1) - probs
    ranked_keep &= (top_p >= 1.0) | (before < top_p)
    min_p = batch.min_p.unsqueeze(1)
    ranked_keep &= (min_p <= 0.0) | (probs >= min_p * probs[:, :1])
    ranked_keep[:, 0] = True
    keep = torch.empty_like(ranked_keep).scatter_(1, order, ranked_keep)
    return scaled.masked_fill(~keep, float("-inf"))


@dataclass(frozen=True)
class SamplingNeeds:
    """Which parts of `sample` a step's rows use, known on the host from their settings: `greedy_only`,
    every row has temperature 0 (no noise, no filter); `filtering`, some row has a top-k, top-p or
    min-p (the sort over the vocabulary). Skipping a part no row uses changes no choice; a step's
    needs are part of the shapes a CUDA graph of its sampling is captured for."""

    greedy_only: bool = False
    filtering: bool = True

    @classmethod
    def of(cls, params: Iterable[SamplingParams]) -> "SamplingNeeds":
        drawn = [p for p in params if p.temperature > 0]
        return cls(greedy_only=not drawn,
                   filtering=any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in drawn))


def sample(logits: torch.Tensor, batch: SamplingBatch, ops: Ops, needs: SamplingNeeds = SamplingNeeds()) -> torch.Tensor:
    """The token chosen in each row of fp32 logits [R, V] (int64 [R], on the logits' device). `needs`
    (what the caller knows of the rows' settings) skips the noise, or the sort, over the vocabulary
    that no row would use; the choice is the same."""
    if needs.greedy_only:
        return ops.first_argmax(logits)
    if not needs.filtering:  # temperature and the greedy rows inside the draw
        return ops.gumbel_argmax(logits, batch.seed_low, batch.seed_high, batch.position, batch.temperature)
    drawn = ops.gumbel_argmax(filtered_logits(logits, batch, ops), batch.seed_low, batch.seed_high, batch.position)
    return torch.where(batch.temperature > 0, drawn, ops.first_argmax(logits))


def top_logprobs(logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k most likely tokens of each row of [R, V], ties to the lower id: (ids, logprobs) [R, k]."""
    values, ids = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    return ids[:, :k], values[:, :k]
