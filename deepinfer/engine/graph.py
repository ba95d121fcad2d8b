"""A model forward captured as a CUDA graph for one step bucket, replayed for other steps of it.

The step metadata's shapes depend only on its buckets (`deepinfer.model.batch`) and the forward
reads nothing back to the host, so one capture serves every step whose `StepBatch` has the same
shapes: `replay` copies the new step's values into the captured inputs and relaunches the recorded
kernels, which read and write the same cache pools.
"""

from __future__ import annotations

import torch

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
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(batch, caches, **taps)
        torch.cuda.current_stream().wait_stream(side)
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
