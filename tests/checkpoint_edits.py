"""A checkpoint copied with its tensors edited: how tests make bad checkpoints from good ones."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def copy_with(folder: Path, out: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """`folder`'s single-file checkpoint in `out`, its tensors changed in place by `change`."""
    out.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (out / name).write_bytes((folder / name).read_bytes())
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, out / "model.safetensors")
