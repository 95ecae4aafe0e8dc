"""C kernels compiled on first use with the system's compiler, cached, and loaded with `ctypes`.

Loading a shared library runs its code, so nothing in the cache is loaded on its name alone: the
kernels folder is private to the user (0700), and a library is loaded only if it is a regular file
owned by the user, writable by nobody else, whose sha256 matches the one recorded beside it when it
was built (in the same private folder). Anything else is rebuilt.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

from ..files.cache import cache_dir, sha256_file
from ..files.durable import atomic_write_bytes, sibling

# -ffp-contract=off: the kernels' sums keep the order written, whatever the compiler fuses.
BASE_FLAGS = ["-O3", "-funroll-loops", "-ffp-contract=off", "-shared", "-fPIC"]
# The worker threads the kernels share (`pool.c`), loaded before any kernel, which links to it.
_POOL = Path(__file__).with_name("pool.c")


def kernels_dir() -> Path:
    """The kernels' cache folder, created private to the user; its permissions are tightened if we own it."""
    folder = cache_dir() / "kernels"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.lstat()
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) != 0o700:
        folder.chmod(0o700)
    return folder


def library_path(source_path: Path, flags: list[str], stem: str, compiler: str) -> Path:
    """`stem-<hash>.so`, the hash covering the source, the headers beside it that it includes, the
    compiler and the flags."""
    source = source_path.read_bytes()
    headers = [source_path.with_name(name.decode()).read_bytes() for name in re.findall(rb'^#include "([^"/]+)"', source, re.M)]
    digest = hashlib.sha256(b"\0".join([source, *headers, compiler.encode(), *(f.encode() for f in flags)])).hexdigest()[:16]
    return kernels_dir() / f"{stem}-{digest}.so"


@functools.cache
def sources_digest() -> str:
    """A digest of every kernel's C source and header here: what a measured speed depends on."""
    sources = sorted(p for p in _POOL.parent.iterdir() if p.suffix in (".c", ".h"))
    return hashlib.sha256(b"\0".join(p.name.encode() + b"\0" + p.read_bytes() for p in sources)).hexdigest()[:16]


def trusted(path: Path) -> str:
    """Why the file at `path` must not be loaded, or "" when it may: a regular file (not a link) owned
    by this user, writable by nobody else."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return "missing"
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_uid != os.getuid():
        return "owned by another user"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "writable by other users"
    return ""


def _verified(library: Path) -> bool:
    """Whether `library` and the hash recorded beside it are trusted and agree."""
    record = library.with_suffix(".sha256")
    if trusted(library) or trusted(record):
        return False
    return record.read_text(encoding="ascii", errors="replace").strip() == sha256_file(library)


def compile_kernel(source_path: Path, flags: list[str], stem: str, what: str) -> tuple[ctypes.CDLL | None, str]:
    """`source_path` compiled with `flags` into the cache unless a verified build is already there,
    and loaded (after the kernels' thread pool, which it may call); or None and why not, naming the
    kernel as `what`."""
    reason = _load_pool()
    if reason:
        return None, f"{what} needs the kernels' thread pool: {reason}"
    return _compile_and_load(source_path, flags, stem, what, ctypes.DEFAULT_MODE)


@functools.cache
def _load_pool() -> str:
    """Load `pool.c` built, its symbols global so the kernels loaded later find `pool_run`; "" or why not."""
    return _compile_and_load(_POOL, [*BASE_FLAGS, "-pthread"], "pool", "the kernels' thread pool", ctypes.RTLD_GLOBAL)[1]


def _compile_and_load(source_path: Path, flags: list[str], stem: str, what: str, mode: int) -> tuple[ctypes.CDLL | None, str]:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, f"no C compiler (cc, gcc or $CC) to build {what}"
    library = library_path(source_path, flags, stem, compiler)
    if not _verified(library):
        built = sibling(library, "so")
        try:
            subprocess.run([compiler, *flags, str(source_path), "-o", str(built)], check=True, capture_output=True, timeout=120)
            built.chmod(0o700)
            # The hash first: a crash between the two renames leaves a mismatch, which rebuilds.
            atomic_write_bytes(library.with_suffix(".sha256"), sha256_file(built).encode())
            os.replace(built, library)  # another process may have built it too: same bytes
        except (OSError, subprocess.SubprocessError) as exc:
            detail = exc.stderr.decode(errors="replace").strip() if isinstance(exc, subprocess.CalledProcessError) else exc
            return None, f"building {what} with {compiler} failed: {detail}"
        finally:
            built.unlink(missing_ok=True)
        if not _verified(library):
            return None, f"{what} at {library} changed while it was being built; not loading it"
    try:
        return ctypes.CDLL(str(library), mode=mode), ""
    except OSError as exc:
        return None, f"loading {what} {library} failed: {exc}"
