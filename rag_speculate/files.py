"""Durable file helpers shared by everything that saves to disk (datastores, indexes, pools, the model
cache, the kernels), and where the cache lives (`cache_dir`).

Everything is written under a temporary name beside its destination and renamed into place, so a
crash never leaves a half-written file or folder where a good one was. A folder is replaced in two
renames (a directory cannot be renamed over a non-empty one); a process killed between them leaves
the old folder aside under a hidden name, which `recover` puts back, so the next load finds the old
folder at its path. Hidden names record the process that made them, so leftovers of dead processes
are removed and those of live ones left alone.

What is read back is checked before it is used: JSON against a schema of its fields (`fields`,
`integer`, `text`, ...), and a large file's sha256 hashed once per process (`sha256_once`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20
# Which machine made a hidden name: a process id means nothing on another one.
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
# How long a load waits for a live process that has moved the old folder aside to put the new one in
# place; two renames take far less, so only a stopped process makes a load wait this long.
_RENAME_GRACE_S = 2.0


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
    recover(path)


def not_ours(folder: Path, what: str, manifest: str, kind: str, names: Collection[str]) -> str | None:
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


def untrusted(path: Path) -> str | None:
    """Why another user could have changed what is at `path`, or None: it is owned by someone other
    than this user or root, or anyone may write it."""
    if os.name != "posix":
        return None
    info = path.lstat()
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


# --- checking what is read back -------------------------------------------------------------


def load_json(data: str | bytes) -> Any:
    """Parsed JSON; nesting too deep for the parser is malformed JSON too (`ValueError`)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


# A JSON token for `nesting`: a string, a bracket, or a run of anything else (numbers, commas, colons, blanks).
_JSON_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]|[^"\[\]{}]+')


def too_deep(data: str | bytes, limit: int) -> list[str | int] | None:
    """Where JSON `data` first nests more than `limit` arrays and objects deep: the keys and indexes
    that lead there, or None if it never does. A scan rather than a parse, so it is safe where
    parsing would recurse past Python's limit; nothing but the nesting is checked."""
    data = data.encode() if isinstance(data, str) else data
    if data.count(b"[") + data.count(b"{") <= limit:
        return None
    path: list[str | int | None] = []
    for match in _JSON_TOKEN.finditer(data):
        token = match.group()
        first = token[:1]
        if first == b'"':
            if path and path[-1] is None:  # an object's key
                path[-1] = token[1:-1].decode(errors="replace")
        elif first in (b"[", b"{"):
            path.append(0 if first == b"[" else None)
            if len(path) > limit:
                return path
        elif first in (b"]", b"}"):
            if not path:
                return None
            path.pop()
        elif path and b"," in token:
            path[-1] = path[-1] + token.count(b",") if isinstance(path[-1], int) else None
    return None


class FieldError(Exception):
    """A field read back is missing or has the wrong type or value; the message names the field."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"field {field or '(top level)'} {problem}")
        self.field = field


# A check takes a value and the field's name, and raises FieldError if the value is not allowed.
Check = Callable[[Any, str], None]


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def integer(low: int = 0, high: int | None = None) -> Check:
    """An int (not a bool) in [low, high]."""

    def check(value: Any, field: str) -> None:
        if type(value) is not int or value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise FieldError(field, f"must be an integer {bound}, got {_shown(value)}")

    return check


def text(pattern: str | None = None) -> Check:
    """A string, matching `pattern` (a regex) if given."""

    def check(value: Any, field: str) -> None:
        if not isinstance(value, str) or (pattern is not None and not re.fullmatch(pattern, value)):
            kind = "a string" if pattern is None else f"a string matching {pattern}"
            raise FieldError(field, f"must be {kind}, got {_shown(value)}")

    return check


SHA256 = text(r"[0-9a-f]{64}")


def of_type(*types: type) -> Check:
    """An instance of one of `types` (a bool is no int here)."""

    def check(value: Any, field: str) -> None:
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join(t.__name__ for t in types)
            raise FieldError(field, f"must be {names}, got {_shown(value)}")

    return check


def optional(inner: Check) -> Check:
    """None, or what `inner` allows."""

    def check(value: Any, field: str) -> None:
        if value is not None:
            inner(value, field)

    return check


def list_of(item: Check, length: int | None = None) -> Check:
    """A list of items `item` allows, of `length` items if given."""

    def check(value: Any, field: str) -> None:
        if not isinstance(value, list) or (length is not None and len(value) != length):
            raise FieldError(field, f"must be a list{'' if length is None else f' of {length}'}, got {_shown(value)}")
        for i, entry in enumerate(value):
            item(entry, f"{field}[{i}]")

    return check


def mapping(name: Check, value: Check) -> Check:
    """A JSON object of any fields, each name allowed by `name` and each value by `value`."""

    def check(obj: Any, field: str) -> None:
        if not isinstance(obj, dict):
            raise FieldError(field, f"must be an object, got {_shown(obj)}")
        for key, entry in obj.items():
            name(key, f"{field} (a name)")
            value(entry, f"{field}.{key}")

    return check


def fields(schema: dict[str, Check]) -> Check:
    """A JSON object with (at least) every field of `schema`, each allowed by its check."""

    def check(value: Any, field: str) -> None:
        if not isinstance(value, dict):
            raise FieldError(field, f"must be an object, got {_shown(value)}")
        for name, inner in schema.items():
            inner_field = f"{field}.{name}" if field else name
            if name not in value:
                raise FieldError(inner_field, "is missing")
            inner(value[name], inner_field)

    return check
