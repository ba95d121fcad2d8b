"""A model forward, and a device drafter's pass after it, captured as CUDA graphs for one step bucket
and replayed for other steps of it.

The step metadata's shapes depend only on its buckets (`deepinfer.model.batch`), and neither the
forward nor the drafter reads anything back to the host, so one capture serves every step of the same
shapes: `replay` copies the new step's values into the captured inputs and relaunches the recorded
kernels, which read and write the same cache pools.
"""

from __future__ import annotations

from dataclasses import fields, replace

import torch

from deepinfer.engine.draft_runner import DeviceDrafts, DraftInputs
from deepinfer.engine.sampler import SamplingBatch
from deepinfer.model import Decoder, StepBatch


class StepGraph:
    """`model`'s forward over `caches` for steps shaped like `batch` (a device batch), as a CUDA graph;
    with `tap_streams`, the forward also hands out the streams a device drafter reads
    (`model(..., streams_at=...)`), which stay in the graph's buffers.

    Capturing runs the forward once eagerly first (kernels compile and autotune outside the
    capture); that run writes `batch`'s cache rows, as the step itself would. Graphs given the same
    memory `pool` share their intermediate buffers: replay one at a time, and read each replay's
    hidden states and streams before the next.
    """

    def __init__(self, model: Decoder, caches: list[dict[str, torch.Tensor]], batch: StepBatch,
                 pool: tuple | None = None, tap_streams: bool = False) -> None:
        self.batch = batch
        self.shapes = batch.shapes()
        taps = {"streams_at": {}} if tap_streams else {}
        _warmed_up(lambda: model(batch, caches, **taps))
        self.streams_at: dict[int, torch.Tensor] = {}
        taps = {"streams_at": self.streams_at} if tap_streams else {}
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.hidden = model(batch, caches, **taps)

    def fits(self, batch: StepBatch) -> bool:
        return batch.shapes() == self.shapes and batch.block_size == self.batch.block_size

    def replay(self, batch: StepBatch) -> torch.Tensor:
        """The forward of `batch` (same shapes as the captured one): the hidden states it returns
        (and `streams_at`'s), in buffers the next replay overwrites."""
        if not self.fits(batch):
            raise ValueError(f"a step shaped {batch.shapes()} does not fit the graph captured for {self.shapes}")
        captured = self.batch.tensors()
        for name, tensor in batch.tensors().items():
            captured[name].copy_(tensor)
        self.graph.replay()
        return self.hidden


def _warmed_up(run) -> None:
    """Run `run()` once on a side stream (kernels compile and autotune outside a capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)


class DraftGraph:
    """A device drafter's pass (`DeviceDrafts.run`) over steps shaped like `step`, as a CUDA graph. The
    step's batch and tapped streams must be a `StepGraph`'s (`StepGraph.batch`, `StepGraph.streams_at`):
    its replay fills them, so this graph reads them in place; the rest of the step's inputs are copied
    into its own. Capturing runs the pass once eagerly first, which writes the drafter's cache rows of
    the step as the replay does again (the same rows, the same values). Its drafts are in buffers the
    next replay overwrites."""

    def __init__(self, drafts: DeviceDrafts, step: DraftInputs, pool: tuple | None = None) -> None:
        self.step = replace(step, next_ids=step.next_ids.clone(), sample_chunks=step.sample_chunks.clone(),
                            draws_at=step.draws_at.clone(), token_ids=step.token_ids.clone(),
                            num_accepted=step.num_accepted.clone(),
                            params=SamplingBatch(**{f.name: getattr(step.params, f.name).clone()
                                                    for f in fields(step.params)}))
        _warmed_up(lambda: drafts.run(self.step))
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = drafts.run(self.step)

    def replay(self, step: DraftInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The drafts of `step`, as `DeviceDrafts.run` gives them (shaped as the captured one, over the
        same batch and streams)."""
        if step.batch is not self.step.batch or step.streams_at is not self.step.streams_at:
            raise ValueError("a drafter graph replays over the batch and streams of the forward graph it follows")
        for name in ("next_ids", "sample_chunks", "draws_at", "token_ids", "num_accepted"):
            getattr(self.step, name).copy_(getattr(step, name))
        for f in fields(step.params):
            getattr(self.step.params, f.name).copy_(getattr(step.params, f.name))
        self.graph.replay()
        return self.out
