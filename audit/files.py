"""Crash-safe file writes shared by everything that writes audit data."""

from __future__ import annotations

import json
import os
from pathlib import Path


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` so that `path` is either absent/old or complete, also across a power loss:
    a tmp file in the same folder, fsync, rename over `path`, fsync of the folder."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def json_bytes(obj: object) -> bytes:
    """The one JSON layout of audit files: sorted keys, indent 2, ASCII, trailing newline."""
    return (json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=True, allow_nan=False) + "\n").encode("ascii")
