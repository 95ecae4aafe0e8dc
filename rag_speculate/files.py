"""Durable file helpers shared by everything that saves to disk (datastores, indexes, pools, the model cache).

Everything is written under a temporary name beside its destination and renamed into place, so a
crash never leaves a half-written file or folder where a good one was.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make the renames and new files in `path` durable; directories cannot be opened so on Windows."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sibling(path: Path, kind: str) -> Path:
    """A unique hidden name beside `path`, so renaming it into place stays on one filesystem.

    Created by the caller (rather than `tempfile`) so the umask, not 0600, decides the
    permissions of files other users may share.
    """
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}.{kind}")


def write_new_file(file: Path, data: bytes) -> None:
    """Create `file` (it must not exist) and make its content durable."""
    with file.open("xb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace `path` with `data` in one rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling(path, "tmp")
    try:
        write_new_file(tmp, data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def replace_dir(staging: Path, path: Path) -> None:
    """Put the complete folder `staging` at `path`, replacing what was there only once it is in place."""
    if not path.exists():
        os.rename(staging, path)
    else:
        # A directory cannot be renamed over a non-empty one: move the old one aside first, and
        # back if the new one cannot take its place.
        old = sibling(path, "old")
        os.rename(path, old)
        try:
            os.rename(staging, path)
        except BaseException:
            os.rename(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(path.parent)
