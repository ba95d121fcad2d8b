"""Crash-safe file writes shared by everything that writes audit data."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path

from deepinfer.audit.errors import AuditError


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


@contextlib.contextmanager
def folder_lock(path: Path, *, resumable: bool = False) -> Iterator[None]:
    """Hold an exclusive lock on the folder `path` while the block runs, so that a second writer (a
    `--resume` started beside the first run, say) is refused in one line instead of interleaving its
    files. The lock is taken on the folder itself (no file is added to it) and the kernel drops it
    however the process ends, so a killed run can be resumed at once. A folder created here and still
    empty at the end is removed again. `resumable`: the refusal says the run can be resumed afterwards."""
    path = Path(path)
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (FileExistsError, NotADirectoryError):
        raise AuditError(f"{path}: exists and is not a folder") from None
    except OSError as err:
        raise AuditError(f"{path}: cannot open the folder ({err.strerror or err})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            then = ", then --resume" if resumable else ""
            raise AuditError(f"{path}: another process is writing this folder; wait for it to end (or stop it)"
                             f"{then}") from None
        yield
    finally:
        os.close(fd)
        if created and path.is_dir() and not any(path.iterdir()):
            path.rmdir()
