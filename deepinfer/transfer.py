"""Host <-> device copies of a step's small tensors, packed so each direction is one transfer.

The step metadata goes up as one pinned, non-blocking copy (no host sync); the runner's results
come down as one copy, the step's only synchronisation. Packing goes through int64: fp32 and bf16
values travel as their bit patterns, so nothing is rounded on the way.
"""

from __future__ import annotations

import torch

_PACKABLE = (torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16)
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}  # floats travel as these bit patterns


def _as_int64(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype not in _PACKABLE:
        raise TypeError(f"cannot pack a {tensor.dtype} tensor")
    flat = tensor.reshape(-1)
    return flat.view(_BITS[tensor.dtype]).long() if tensor.dtype in _BITS else flat.long()


def _restore(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if like.dtype in _BITS:
        flat = flat.to(_BITS[like.dtype]).view(like.dtype)
    else:
        flat = flat.to(like.dtype)
    return flat.view(like.shape)


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([_as_int64(t) for t in tensors]) if tensors else torch.empty(0, dtype=torch.long)


def _unpack(packed: torch.Tensor, likes: list[torch.Tensor]) -> list[torch.Tensor]:
    pieces = packed.split([t.numel() for t in likes])
    return [_restore(piece, like) for piece, like in zip(pieces, likes)]


def upload(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Host tensors moved to `device` in one copy (pinned and non-blocking on CUDA)."""
    if device.type == "cpu":
        return dict(tensors)
    packed = _pack(list(tensors.values())).pin_memory()
    moved = _unpack(packed.to(device, non_blocking=True), list(tensors.values()))
    return dict(zip(tensors, moved))


class Download:
    """Device tensors on their way to the host: packed and copied when made (into pinned memory,
    non-blocking, on CUDA), so the device can go on with work queued after them; `wait()` is the
    one synchronisation, on that copy alone."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = dict(tensors)
        self.done: torch.cuda.Event | None = None
        if all(t.device.type == "cpu" for t in self.tensors.values()):
            return  # already on the host: nothing to copy or wait for
        packed = _pack(list(self.tensors.values()))
        self.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self.host.copy_(packed, non_blocking=True)
        self.done = torch.cuda.Event()
        self.done.record()

    def wait(self) -> dict[str, torch.Tensor]:
        if self.done is None:
            return dict(self.tensors)
        self.done.synchronize()
        return dict(zip(self.tensors, _unpack(self.host, list(self.tensors.values()))))
