"""Durable writes shared by everything that saves to disk (datastores, indexes, pools, the model
cache, the kernels, the prompt cache), and what may be trusted or replaced on disk.

Everything is written under a temporary name beside its destination and renamed into place, so a
crash never leaves a half-written file or folder where a good one was. A folder is replaced in two
renames (a directory cannot be renamed over a non-empty one); a process killed between them leaves
the old folder aside under a hidden name, which `recover` puts back, so the next load finds the old
folder at its path. Hidden names record the process that made them, so leftovers of dead processes
are removed and those of live ones left alone.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Collection
from pathlib import Path

from .schema import load_json

# Which machine made a hidden name: a process id means nothing on another one.
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
# How long a load waits for a live process that has moved the old folder aside to put the new one in
# place; two renames take far less, so only a stopped process makes a load wait this long.
_RENAME_GRACE_S = 2.0


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

    The name records this process, so `recover` can tell a dead process's leftover from a live
    one's work. Created by the caller (rather than `tempfile`) so the umask, not 0600, decides the
    permissions of files other users may share.
    """
    return path.with_name(f".{path.name}.{_HOST}-{os.getpid()}.{uuid.uuid4().hex}.{kind}")


def write_new_file(file: Path, data: bytes, mode: int = 0o666) -> None:
    """Create `file` (it must not exist) with `mode`, less the umask, and make its content durable."""
    with open(os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), mode), "wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o666) -> None:
    """Replace `path` with `data` in one rename, a file of `mode` less the umask."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling(path, "tmp")
    try:
        write_new_file(tmp, data, mode)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)
    recover(path)


def not_replaceable(folder: Path, what: str, manifest: str, kind: str, names: Collection[str]) -> str | None:
    """Why the existing `folder` must not be replaced by a `what` we write, or None when it may: it is
    not a folder, its `manifest` does not say `kind` in the "format" field only we write, or it
    holds files a `what` never has. An empty folder holds nothing to lose."""
    if not folder.is_dir():
        return "is not a folder"
    found = set(os.listdir(folder))
    if not found:
        return None
    try:
        written = load_json((folder / manifest).read_bytes())
    except (OSError, ValueError):
        written = None
    if not isinstance(written, dict) or written.get("format") != kind:
        return f"exists and is not a {what}"
    foreign = sorted(found - set(names))
    if foreign:
        return f"holds files a {what} does not ({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''})"
    return None


# What each kind of file that is not a regular one is called in a message.
_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}  # fmt: skip


def untrusted(entry: Path | os.stat_result, regular_file: bool = False) -> str | None:
    """Why what is at `entry` must not be trusted, or None: it is owned by someone other than this user
    or root, or anyone may write it, so another user could have changed it; with `regular_file`, also
    when it is anything but a regular file (a folder, a symbolic link, a FIFO, ...). `entry` is a path,
    whose link is judged rather than its target, or what `os.lstat` or `os.fstat` said of one."""
    info = entry if isinstance(entry, os.stat_result) else entry.lstat()
    if regular_file and not stat.S_ISREG(info.st_mode):
        return f"is {_KINDS.get(stat.S_IFMT(info.st_mode), 'not a regular file')}, not a regular file"
    if os.name != "posix":
        return None
    if info.st_uid not in (os.getuid(), 0):
        return f"is owned by another user (uid {info.st_uid})"
    if info.st_mode & stat.S_IWOTH and not stat.S_ISLNK(info.st_mode):
        return "is writable by every user"
    return None


def os_reason(error: OSError) -> str:
    """An OSError in a few words, with its errno's name: "No space left on device (ENOSPC)". numpy's
    short writes carry no errno; a full disk is what leaves one."""
    if error.errno is None:
        return f"{error} (a short write: the disk is probably full)"
    name = errno.errorcode.get(error.errno, str(error.errno))
    return f"{error.strerror} ({name})" + (f": {error.filename}" if error.filename else "")


def replace_dir(staging: Path, path: Path) -> None:
    """Put the complete folder `staging` at `path`, replacing what was there only once it is in place."""
    if not path.exists():
        os.rename(staging, path)
    else:
        # A directory cannot be renamed over a non-empty one: move the old one aside first, and
        # back if the new one cannot take its place. A kill in between leaves it for `recover`.
        old = sibling(path, "old")
        os.rename(path, old)
        try:
            os.rename(staging, path)
        except BaseException:
            os.rename(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(path.parent)
    recover(path)


# --- what killed processes leave behind -----------------------------------------------------


def recover(path: Path) -> None:
    """Undo what a process killed while replacing `path` left beside it.

    A folder it had moved aside (`.old`) is put back when nothing is at `path`; its staging
    (`.tmp`) and superseded folders are removed. A live process's are left alone, as is everything
    made on another machine. Best effort: a folder this user cannot write is left as it is.
    """
    try:
        found = _leftovers(path)
        if not found:
            return
        if not path.exists():
            _restore(path, [(name, alive) for name, kind, alive in found if kind == "old"])
        for name, kind, alive in found:
            # Even a dead process's `.old` is the only copy while nothing is at `path`.
            if not alive and (kind == "tmp" or path.exists()):
                _remove(name)
    except OSError:
        pass


def _leftovers(path: Path) -> list[tuple[Path, str, bool]]:
    """Hidden siblings of `path` made by `sibling`: (path, kind, whether their process may be alive)."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(?:([0-9a-f]{{8}})-(\d+)\.)?[0-9a-f]{{32}}\.(tmp|old)")
    found = []
    for entry in os.scandir(path.parent):
        match = pattern.fullmatch(entry.name)
        if match:
            host, pid, kind = match.groups()
            found.append((Path(entry.path), kind, _may_be_alive(host, pid)))
    return found


# Any temporary file `sibling` names: the file it stands in for, the machine and the process that made it.
_TEMPORARY = re.compile(r"\.(.+)\.([0-9a-f]{8})-(\d+)\.[0-9a-f]{32}\.tmp")


def remove_dead_temporaries(folder: Path) -> None:
    """Remove the temporary files (`sibling(..., "tmp")`) that dead processes of this machine left in
    `folder`, whatever file they stood in for; a live process's, and another machine's, stay."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        match = _TEMPORARY.fullmatch(entry.name)
        if match and not _may_be_alive(match.group(2), match.group(3)):
            try:
                _remove(Path(entry.path))
            except OSError:  # best effort, as `recover`
                pass


def _may_be_alive(host: str | None, pid: str | None) -> bool:
    if host is None:  # a name from before names recorded their process
        return False
    if host != _HOST or os.name != "posix":  # no way to tell: leave it
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's
        return True
    return True


def _restore(path: Path, olds: list[tuple[Path, bool]]) -> None:
    if not olds:
        return
    deadline = time.monotonic() + _RENAME_GRACE_S
    while any(alive for _, alive in olds) and not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)  # its owner is between its two renames: the new folder is coming
    if path.exists():
        return
    newest = max((name for name, _ in olds), key=lambda name: name.lstat().st_ctime_ns)
    try:
        os.rename(newest, path)
    except OSError:  # another process restored it first, or the owner finished
        return
    fsync_dir(path.parent)


def _remove(name: Path) -> None:
    if name.is_dir() and not name.is_symlink():
        shutil.rmtree(name, ignore_errors=True)
    else:
        name.unlink(missing_ok=True)
