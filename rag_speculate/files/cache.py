"""Where the cache lives (`cache_dir`), and files' sha256: a large file read back is hashed once per
process while it is unchanged (`sha256_once`)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_CHUNK = 1 << 20


def cache_dir() -> Path:
    """Root of the on-disk cache: ``$RAG_SPECULATE_CACHE``, else ``$XDG_CACHE_HOME/rag-speculate``,
    else ``~/.cache/rag-speculate``."""
    explicit = os.environ.get("RAG_SPECULATE_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "rag-speculate"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


# A file's identity -> its sha256. Any write changes the mtime or the ctime (which no one can set
# back), and a replacement changes the inode, so a remembered hash is never one of other content.
_HASHED: dict[tuple[int, int, int, int, int], str] = {}


def _identity(path: Path) -> tuple[int, int, int, int, int]:
    info = path.stat()
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def sha256_once(path: Path) -> str:
    """sha256 of `path`, hashed once per process while the file is unchanged: a large file is read
    at its first load rather than at every one."""
    key = _identity(path)
    digest = _HASHED.get(key)
    if digest is None:
        digest = sha256_file(path)
        if _identity(path) == key:  # not remembered if the file changed while being read
            _HASHED[key] = digest
    return digest
