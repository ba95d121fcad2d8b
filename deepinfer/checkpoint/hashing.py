"""The checkpoint content hash and its on-disk cache.

The hash covers what the model computes with, not how it is stored: SHA-256 over the tensors in
sorted-name order, each as (name, dtype, shape, raw bytes). Sharding, file names and safetensors
metadata do not enter it. Hashing a large checkpoint reads every byte, so the digest is cached in
`.content-hash.json` inside the folder, keyed by each weight file's name, size, mtime and ctime.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from deepinfer.checkpoint.files import WeightReader, weight_files

CACHE_NAME = ".content-hash.json"
_VERSION = 1


class TensorHasher:
    """Feed tensors in strictly increasing name order; `hexdigest()` gives the content hash."""

    def __init__(self) -> None:
        self._sha = hashlib.sha256(b"deepinfer-content-hash-v1\0")
        self._last: str | None = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._last is not None and name <= self._last:
            raise ValueError(f"tensors must be hashed in sorted name order: {name!r} after {self._last!r}")
        self._last = name
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = ",".join(str(d) for d in tensor.shape)
        self._sha.update(f"{name}\0{dtype}\0{shape}\0{data.nbytes}\0".encode())
        self._sha.update(memoryview(data))

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def hash_tensors(tensors: dict[str, torch.Tensor]) -> str:
    hasher = TensorHasher()
    for name in sorted(tensors):
        hasher.add(name, tensors[name])
    return hasher.hexdigest()


def content_hash(folder: str | Path) -> str:
    """The content hash of the checkpoint in `folder` (from the cache when it is still valid)."""
    folder = Path(folder)
    files = weight_files(folder)
    cached = cached_hash(folder, files)
    if cached is not None:
        return cached
    hasher = TensorHasher()
    with WeightReader(files) as reader:
        for name in sorted(reader.headers):
            hasher.add(name, reader.get(name))
    digest = hasher.hexdigest()
    store_hash(folder, files, digest)
    return digest


def cached_hash(folder: Path, files: list[Path]) -> str | None:
    path = folder / CACHE_NAME
    try:
        cache_mtime = path.stat().st_mtime_ns
        entry = json.loads(path.read_text())
        stamps = _stamps(files)
    except (OSError, ValueError):
        return None
    # A file modified in the same clock tick as the cache write could keep a matching mtime, so
    # only files strictly older than the cache are trusted (the "racy git" rule).
    if (not isinstance(entry, dict) or entry.get("version") != _VERSION or entry.get("files") != stamps
            or any(max(s[2], s[3]) >= cache_mtime for s in stamps)):
        return None
    digest = entry.get("sha256")
    return digest if isinstance(digest, str) else None


def store_hash(folder: Path, files: list[Path], digest: str) -> None:
    """Best effort: a read-only checkpoint folder just goes uncached."""
    tmp = folder / f"{CACHE_NAME}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps({"version": _VERSION, "sha256": digest, "files": _stamps(files)}))
        os.replace(tmp, folder / CACHE_NAME)
    except OSError:
        tmp.unlink(missing_ok=True)


def _stamps(files: Iterable[Path]) -> list[list]:
    out = []
    for f in files:
        st = f.stat()
        out.append([f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    return out

