"""Which safetensors files make up a checkpoint, and reading them with one-line errors."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from deepinfer.checkpoint.errors import CheckpointError


def deepinfer_home() -> Path:
    """Where DeepInfer keeps what it builds or caches for the user: $DEEPINFER_HOME, else ~/.cache/deepinfer."""
    return Path(os.environ.get("DEEPINFER_HOME") or Path.home() / ".cache" / "deepinfer").expanduser()

INDEX_NAME = "model.safetensors.index.json"
# safetensors dtype codes -> torch dtype names (what error messages and the content hash use)
DTYPE_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
               "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
               "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}


def weight_files(folder: Path) -> list[Path]:
    """The files named by `model.safetensors.index.json` if present, else every `*.safetensors`."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: checkpoint folder not found")
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise CheckpointError(f"{index}: not a valid safetensors index (needs a 'weight_map' object)") from None
        files = [folder / n for n in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: names {f.name}, which does not exist")
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weight files")
    return files


def read_headers(files: list[Path]) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """name -> (file, dtype name, shape) over all files, reading headers only."""
    out: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for path in files:
        with _open(path) as f:
            for name in f.keys():
                if name in out:
                    raise CheckpointError(f"{name}: stored twice, in {out[name][0].name} and {path.name}")
                sl = f.get_slice(name)
                code = sl.get_dtype()
                out[name] = (path, DTYPE_NAMES.get(code, code), tuple(sl.get_shape()))
    return out


class WeightReader:
    """All weight files held open at once; tensors fetched by name, in any order, each onto `device`,
    or where `placement(name)` says (a model may keep some tensors in host memory: they are read
    there, never through the device)."""

    def __init__(self, files: list[Path], device: str | torch.device = "cpu",
                 placement: Callable[[str], str | torch.device] | None = None):
        self.headers = read_headers(files)
        self.device, self.placement = device, placement
        self._handles = {(path, str(device)): _open(path, device) for path in files}

    def get(self, name: str) -> torch.Tensor:
        path = self.headers[name][0]
        device = str(self.device if self.placement is None else self.placement(name))
        if (path, device) not in self._handles:
            self._handles[path, device] = _open(path, device)
        try:
            return self._handles[path, device].get_tensor(name)
        except SafetensorError as err:
            raise _corrupt(path, err) from None

    def __enter__(self) -> WeightReader:
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()


def _open(path: Path, device: str | torch.device = "cpu"):
    try:
        return safe_open(str(path), framework="pt", device=str(device))
    except SafetensorError as err:
        raise _corrupt(path, err) from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err.strerror})") from None


def _corrupt(path: Path, err: Exception) -> CheckpointError:
    detail = str(err).splitlines()[0] if str(err) else type(err).__name__
    return CheckpointError(f"{path}: corrupt or truncated safetensors file ({detail})")
