"""The checkpoint content hash and its cache.

The hash covers what the model computes with, not how it is stored: SHA-256 over the tensors in
sorted-name order, each as (name, dtype, shape, raw bytes). Sharding, file names and safetensors
metadata do not enter it. Hashing a large checkpoint reads every byte, so digests are cached, but
never inside the checkpoint folder: whoever can change the weights could change such a cache too. The
cache lives in `$DEEPINFER_HOME/content-hashes/`, one file per set of weight files, named by a digest
of each file's name, size, mtime, ctime, inode and device. Rewriting or replacing a file changes its
ctime or inode (which a file's owner cannot set back), so tampered weights miss the cache and are
hashed from their bytes; `checkpoint info --verify` and certifications always hash the bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from deepinfer.checkpoint.files import WeightReader, deepinfer_home, weight_files

CACHE_FOLDER = "content-hashes"
_VERSION = 2


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


def content_hash(folder: str | Path, *, trust_cache: bool = True) -> str:
    """The content hash of the checkpoint in `folder`: from the cache when `trust_cache` and it holds
    these exact files, else hashed from the bytes (and cached)."""
    folder = Path(folder)
    files = weight_files(folder)
    cached = cached_hash(files) if trust_cache else None
    if cached is not None:
        return cached
    hasher = TensorHasher()
    with WeightReader(files) as reader:
        for name in sorted(reader.headers):
            hasher.add(name, reader.get(name))
    digest = hasher.hexdigest()
    store_hash(files, digest)
    return digest


def cache_path(files: list[Path]) -> Path:
    """The cache entry for these weight files as they are now on disk."""
    key = json.dumps(_stamps(files), separators=(",", ":")).encode()
    return deepinfer_home() / CACHE_FOLDER / f"{hashlib.sha256(key).hexdigest()}.json"


def cached_hash(files: list[Path]) -> str | None:
    try:
        path = cache_path(files)
        cache_mtime = path.stat().st_mtime_ns
        entry = json.loads(path.read_text())
        stamps = _stamps(files)
    except (OSError, ValueError):
        return None
    # A file modified in the same clock tick as the cache write could keep matching stamps, so only
    # files strictly older than the cache entry are trusted (the "racy git" rule).
    if (not isinstance(entry, dict) or entry.get("version") != _VERSION or entry.get("files") != stamps
            or any(max(s[2], s[3]) >= cache_mtime for s in stamps)):
        return None
    digest = entry.get("sha256")
    return digest if isinstance(digest, str) else None


def store_hash(files: list[Path], digest: str) -> None:
    """Best effort: without a writable $DEEPINFER_HOME the hash just goes uncached."""
    try:
        path = cache_path(files)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": _VERSION, "sha256": digest, "files": _stamps(files)}))
        os.replace(tmp, path)
    except OSError:
        return


def _stamps(files: Iterable[Path]) -> list[list]:
    out = []
    for f in files:
        st = f.stat()
        out.append([f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev])
    return out
