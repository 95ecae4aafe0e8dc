"""The prompt cache's disk tier: KV entries of token prefixes in fixed-size blocks, one safetensors file
each, shared by every process and replica pointed at the same folder.

Keys. A block holds `block_tokens` tokens' entries, every layer's keys and values for one sequence
(`[kv_heads, block_tokens, head_dim]` each), and is named by a hash chain over token ids: h_0 is the
model's identity (`model_identity`), h_i = sha256(h_{i-1} || block i's ids), so a name fixes every
token before the block and the model that computed it, and prompts sharing a prefix share its
blocks. Only full blocks are stored; a prompt's last partial block is prefilled.

    <folder>/<identity[:24]>/<h[:2]>/<h>.safetensors

Invariants:
- a file at a block's name is whole: it is written under a temporary name beside it and renamed into
  place (`files.durable.atomic_write_bytes`), so a killed writer leaves at most a temporary file,
  which is never read and is removed once its process is dead;
- a block is used only once it verifies (`_verified`): it is a regular file (not a link, a folder
  or a FIFO) and ours (our user's or root's, not writable by every user); its header's length fits
  the file; the header, parsed by us and bounded, names the format and version, the identity, the
  chain hash, the parent hash and the token ids asked for, and exactly the tensors the model's cache
  has, in its shape and dtype, tiling the data; a sha256 over the tensors' names and bytes matches.
  Anything else is a miss with one log line;
- the tier leaves nothing it cannot use: a name can only ever hold one content, and writers skip
  names that exist, so an entry left at a block's name would keep its prefix a miss for good. One
  that fails is removed where it is ours to remove (a file or folder of this user's: damaged,
  truncated, writable by every user), and its block is written again by the next write-through;
  anything else there (another user's, a FIFO, a link) is left as it is, reported once and counted
  (`entries_refused`);
- what the tier creates is private to its user, folders 0700 and blocks 0600: a block's entries
  are its prompt in another form;
- no locks: processes share a folder through content-addressed names and atomic renames; two writers
  of one block write entries for the same tokens and the last rename wins, and a block that vanishes
  between a look and a read is a miss;
- the folder stays within `max_bytes`: once its writes pass the budget the store deletes the least
  recently used blocks (by mtime, which every hit and every write-through touches) down to 7/8 of it.
  Other processes' writes are only seen at a scan, so a shared folder can pass the budget by what
  they wrote since.

Writes run on a background thread behind a bounded queue; the engine's thread only copies a new
block's entries to the CPU. A write that cannot happen (a full disk, no permission) is a log line,
never a failed request, and a block the queue has no room for is written the next time its prefix is.
No fsync: a block torn by a power cut fails its checksum, which costs a prefill, not an answer.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import stat
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from safetensors.torch import save as safetensors_bytes

from ..devices import processor
from ..errors import InvalidArgumentError, check_int
from ..files.durable import atomic_write_bytes, os_reason, remove_dead_temporaries, untrusted
from ..files.schema import SHA256, FieldError, fields, load_json, text
from ..fingerprint import weights_fingerprint
from .kv_cache import kv_shape

logger = logging.getLogger(__name__)

FORMAT = "rag-speculate-kv-block"
FORMAT_VERSION = 1
# Bumped whenever how the library computes or lays out KV entries changes: blocks written before are
# then another identity's, never read as this one's.
KV_LAYOUT_VERSION = 1
DEFAULT_BLOCK_TOKENS = 64
DEFAULT_MAX_BYTES = 8 << 30
# A block's header (its tensors' names, shapes and offsets, and the metadata) takes far less.
_MAX_HEADER = 1 << 20
# Blocks waiting for the writer thread at most; the queue holds CPU copies of entries.
_QUEUED_BLOCKS = 256
# Over budget, blocks are deleted down to this share of it, so a full folder is scanned once per
# eighth of its budget written rather than at every write.
_EVICT_TO = 7 / 8
# How long a process that exits waits for its queued writes.
_EXIT_WAIT_S = 10.0
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
_BLOCK = re.compile(r"[0-9a-f]{64}\.safetensors")
_MODEL_FOLDER = re.compile(r"[0-9a-f]{24}")
_PREFIX_FOLDER = re.compile(r"[0-9a-f]{2}")
_METADATA = fields({"format": text(), "version": text(), "identity": SHA256, "hash": SHA256, "parent": SHA256,
                    "tokens": text(), "checksum": SHA256})  # fmt: skip
_SCAN, _STOP = object(), object()
# A block is read through neither a link nor a FIFO's wait for a writer: what is opened is checked first.
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)

Block = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys and values, [1, heads, block_tokens, head_dim]


@dataclass(frozen=True)
class BlockShape:
    """What one block of a model's cache holds: `layers` pairs of `[heads, tokens, head_dim]` tensors."""

    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    tokens: int = DEFAULT_BLOCK_TOKENS

    @classmethod
    def of(cls, model: torch.nn.Module, tokens: int = DEFAULT_BLOCK_TOKENS) -> BlockShape:
        return cls(*kv_shape(model), next(model.parameters()).dtype, tokens)

    @property
    def tensor_bytes(self) -> int:
        return self.heads * self.tokens * self.head_dim * self.dtype.itemsize

    @property
    def data_bytes(self) -> int:
        return 2 * self.layers * self.tensor_bytes


@dataclass
class StoreStats:
    bytes: int = 0  # the folder's blocks, as last seen: at the last scan, plus this process's writes since
    max_bytes: int = 0
    blocks_written: int = 0
    write_failures: int = 0  # writes that could not happen (a full disk, no permission)
    writes_dropped: int = 0  # blocks the writer's queue had no room for
    blocks_rejected: int = 0  # blocks that failed verification (damaged, truncated, foreign) and were removed
    entries_refused: int = 0  # entries at a block's name not ours to remove (another user's, a FIFO, a link), each once
    blocks_evicted: int = 0


def model_identity(model: torch.nn.Module, kernels: bool) -> str:
    """The hash a model's blocks are filed under: everything their entries depend on. The weights
    (`fingerprint.weights_fingerprint`), dtype, device kind and which GPU or CPU (whose kernels round
    differently), the attention implementation, whether the CPU kernels computed them, torch's and
    transformers' versions, and the library's block format and KV layout versions. Two models never
    share a block."""
    parameter = next(model.parameters())
    described = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "layout": KV_LAYOUT_VERSION,
        "weights": weights_fingerprint(model), "dtype": str(parameter.dtype), "device": parameter.device.type,
        "processor": processor(parameter.device), "attention": getattr(model.config, "_attn_implementation", None),
        "kernels": kernels, "torch": torch.__version__, "transformers": transformers.__version__,
    }  # fmt: skip
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


def prepare_folder(folder: Any) -> Path:
    """The disk tier's folder, created private to the user where missing. InvalidArgumentError naming
    `prompt_cache_dir` where it cannot serve: a file, a path that cannot be created, a folder this
    process cannot write, or one another user could change (owned by another user, root aside, or
    writable by every user), as the CPU kernels' folder is refused."""
    if not isinstance(folder, (str, os.PathLike)) or not str(folder):
        raise InvalidArgumentError(f"prompt_cache_dir must be a folder's path, got {folder!r}", "prompt_cache_dir")
    path = Path(folder).expanduser()

    def refuse(problem: str) -> InvalidArgumentError:
        return InvalidArgumentError(f"prompt_cache_dir {path} {problem}", "prompt_cache_dir")

    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        raise refuse("is a file, not a folder") from None
    except OSError as error:
        raise refuse(f"cannot be created: {os_reason(error)}") from None
    for place in dict.fromkeys([path, path.resolve()]):
        problem = untrusted(place)
        if problem:
            raise refuse(
                f"{'' if place == path else f'(at {place}) '}{problem}, so another user could change the entries "
                "it holds; make it yours and writable only by you (chown, chmod o-w)"
            )
    if not os.access(path, os.W_OK | os.X_OK):
        raise refuse("is not writable by this process")
    return path


def block_hashes(identity: str, tokens: Sequence[int], block_tokens: int) -> list[str]:
    """The chain of `tokens`' full blocks: h_i = sha256(h_{i-1} || block i's ids as 64-bit little-endian
    integers), h_0 the identity."""
    hashes, parent = [], bytes.fromhex(identity)
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = hashlib.sha256(
            parent + np.asarray(tokens[start : start + block_tokens], dtype="<i8").tobytes()
        ).digest()
        hashes.append(parent.hex())
    return hashes


class _Unusable(Exception):
    """A block file that is not the block asked for; the message says why."""


@dataclass(frozen=True)
class _Write:
    path: Path
    hash: str
    parent: str
    tokens: tuple[int, ...]
    tensors: dict[str, torch.Tensor]


class PromptStore:
    """One model's blocks in a folder that other processes may share; its methods are safe to call
    from several threads."""

    def __init__(self, folder: Any, identity: str, shape: BlockShape, *, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = check_int(max_bytes, "prompt_cache_disk_bytes", 0)
        self.folder = prepare_folder(folder)
        self.identity, self.shape, self.block_tokens = identity, shape, shape.tokens
        if shape.dtype not in _DTYPES:
            raise InvalidArgumentError(f"the prompt cache's disk tier stores {', '.join(map(str, _DTYPES))} entries, "
                                       f"not {shape.dtype}", "prompt_cache_dir")  # fmt: skip
        self._root = self.folder / identity[:24]
        self._lock = threading.Lock()
        self._stats = StoreStats(max_bytes=self.max_bytes)
        self._reported: set[str] = set()
        self._pending: set[str] = set()  # blocks queued and not yet written: a second save skips them
        self._queue: queue.Queue = queue.Queue()
        self._queue.put(_SCAN)  # the folder's size, and what dead writers left
        reference = weakref.ref(self)
        writer = threading.Thread(target=_write_loop, args=(self._queue, reference), name="rag-speculate-prompt-store",
                                  daemon=True)  # fmt: skip
        writer.start()
        weakref.finalize(self, self._queue.put, _STOP).atexit = False
        atexit.register(_drain, self._queue, writer)

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(**vars(self._stats))

    def hashes(self, tokens: Sequence[int]) -> list[str]:
        return block_hashes(self.identity, tokens, self.block_tokens)

    def path(self, block: str) -> Path:
        return self._root / block[:2] / f"{block}.safetensors"

    def present(self, hashes: Sequence[str], first: int) -> int:
        """How many blocks from `first` on are on disk in a row (a later read may still miss)."""
        count = 0
        while first + count < len(hashes) and self._look(hashes[first + count]):
            count += 1
        return count

    def _look(self, block: str) -> bool | None:
        """Whether a file we may read is at `block`'s name: True; False when nothing is (an entry we
        must not read was there and is removed); None when something we leave is there."""
        path = self.path(block)
        try:
            info = path.lstat()
        except FileNotFoundError:
            return False
        except OSError as error:  # its prefix folder is not one we can search: nothing to write there either
            self._report(block, logging.WARNING, "prompt cache: cannot read block %s: %s", path, os_reason(error))
            return None
        problem = untrusted(info, regular_file=True)
        if not problem:
            return True
        return False if self._unusable(path, block, info, f"it {problem}") else None

    def flush(self) -> None:
        """Wait until every write queued so far is done (or has failed)."""
        self._queue.join()

    # --- reads, on the engine's thread ----------------------------------------------------------

    def load(self, tokens: Sequence[int], hashes: Sequence[str], index: int) -> Block | None:
        """Block `index` of `tokens` (whose chain is `hashes`), verified, on the CPU; None for a miss."""
        block, path = hashes[index], self.path(hashes[index])
        try:
            fd = os.open(path, _READ_FLAGS)
            try:
                info = os.fstat(fd)
                problem = untrusted(info, regular_file=True)
                if not problem:
                    data = bytearray(min(info.st_size, 8 + _MAX_HEADER + self.shape.data_bytes))
                    with open(fd, "rb", closefd=False) as file:
                        read = file.readinto(data)
            finally:
                os.close(fd)
        except FileNotFoundError:  # evicted, or never written: a miss
            return None
        except OSError as error:  # a link (O_NOFOLLOW refuses it) is removed or left as any such entry
            if self._look(block):  # a file we may read, and cannot
                self._report(block, logging.WARNING, "prompt cache: cannot read block %s: %s", path, os_reason(error))
            return None
        span = slice(index * self.block_tokens, (index + 1) * self.block_tokens)
        try:
            if problem:
                raise _Unusable(f"it {problem}")
            if read != info.st_size:
                raise _Unusable(f"it is {info.st_size} bytes, not a block's")
            offsets = self._verified(data, block, hashes[index - 1] if index else self.identity, tokens[span])
        except _Unusable as unusable:
            self._unusable(path, block, info, str(unusable))
            return None
        try:
            os.utime(path)  # recently used: the last to be evicted
        except OSError:
            pass
        shape = self.shape
        count = shape.heads * shape.tokens * shape.head_dim

        def tensor(name: str) -> torch.Tensor:  # sharing `data`'s memory
            flat = torch.frombuffer(data, dtype=shape.dtype, count=count, offset=offsets[name])
            return flat.view(1, shape.heads, shape.tokens, shape.head_dim)

        return [(tensor(f"k.{layer}"), tensor(f"v.{layer}")) for layer in range(shape.layers)]

    def _verified(self, data: bytearray, block: str, parent: str, tokens: Sequence[int]) -> dict[str, int]:
        """Where each tensor of `data`, this block's file, starts; `_Unusable` when it is not this block's."""
        shape = self.shape
        length = int.from_bytes(data[:8], "little") if len(data) >= 8 else -1
        if not 0 < length <= min(_MAX_HEADER, len(data) - 8):
            raise _Unusable("its header's length does not fit the file (truncated?)")
        if len(data) - 8 - length != shape.data_bytes:
            raise _Unusable(
                f"it holds {len(data) - 8 - length} bytes of tensors, a block {shape.data_bytes} (truncated?)"
            )
        try:
            header = load_json(bytes(data[8 : 8 + length]))
            _METADATA(header.get("__metadata__") if isinstance(header, dict) else None, "__metadata__")
            written = load_json(header["__metadata__"]["tokens"])
        except (ValueError, FieldError) as error:
            raise _Unusable(f"its header is malformed: {error}") from None
        metadata = header.pop("__metadata__")
        expected = {
            "format": FORMAT,
            "version": str(FORMAT_VERSION),
            "identity": self.identity,
            "hash": block,
            "parent": parent,
        }
        for key, value in expected.items():
            if metadata[key] != value:
                raise _Unusable(f"its {key} is not this block's ({metadata[key][:24]!r}...)")
        if written != list(tokens):
            raise _Unusable("its token ids are not this block's")
        if header.keys() != {f"{kind}.{layer}" for kind in "kv" for layer in range(shape.layers)}:
            raise _Unusable("its tensors are not the model's layers' keys and values")
        wanted = {"dtype": _DTYPES[shape.dtype], "shape": [shape.heads, shape.tokens, shape.head_dim]}
        spans = []
        for name, entry in header.items():
            offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
            if {k: entry.get(k) for k in wanted} != wanted or not isinstance(offsets, list) or len(offsets) != 2 \
                    or any(type(o) is not int for o in offsets):  # fmt: skip
                raise _Unusable(f"its tensor {name} is not {wanted['dtype']} {wanted['shape']}")
            spans.append((offsets[0], offsets[1], name))
        spans.sort()
        end = 0
        for first, last, name in spans:  # the tensors tile the data, each a block's size
            if first != end or last != first + shape.tensor_bytes:
                raise _Unusable(f"its tensor {name}'s bytes are not where a block's are")
            end = last
        base = 8 + length
        tensors = {name: memoryview(data)[base + first : base + last] for first, last, name in spans}
        if _checksum(tensors) != metadata["checksum"]:
            raise _Unusable("its checksum does not match its tensors (damaged)")
        return {name: base + first for first, _, name in spans}

    def _unusable(self, path: Path, block: str, info: os.stat_result, problem: str) -> bool:
        """Deal with what is at `block`'s name (`info`, from lstat or fstat) and must not be read, as
        `problem` says: removed when it is ours to remove, a file or folder of this user's, so the name
        is free for the block; else left, reported once and counted. Whether the name is free."""
        kind = stat.S_IFMT(info.st_mode)
        if info.st_uid == os.getuid() and kind in (stat.S_IFREG, stat.S_IFDIR):
            try:
                if kind == stat.S_IFDIR:
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
            except FileNotFoundError:  # another process removed it first
                return True
            except OSError as error:
                problem = f"{problem}, and removing it failed: {os_reason(error)}"
            else:
                with self._lock:
                    self._stats.blocks_rejected += 1
                self._report(block, logging.WARNING, "prompt cache: block %s is unusable (%s); removed, its tokens "
                             "are prefilled", path, problem)  # fmt: skip
                return True
        message = "prompt cache: leaving %s as it is (%s): not this user's to remove; its block's tokens are prefilled"
        if self._report(f"left {block}", logging.WARNING, message, path, problem):
            with self._lock:
                self._stats.entries_refused += 1
        return False

    # --- writes: copied on the engine's thread, written on the store's --------------------------

    def save(self, tokens: Sequence[int], layers: Sequence[Any]) -> None:
        """Write through: queue the full blocks of `tokens` that are not on disk, their entries
        (`layers[i].keys` / `.values`, `[1, heads, >= len(tokens), head_dim]`) copied to the CPU now;
        those on disk are touched, as their prefix is in use."""
        if self.max_bytes == 0 or len(tokens) < self.block_tokens:
            return
        shape = self.shape
        keys = layers[0].keys
        if (len(layers), keys.shape[1], keys.shape[-1], keys.dtype) != (
            shape.layers,
            shape.heads,
            shape.head_dim,
            shape.dtype,
        ):
            self._report("shape", logging.WARNING, "prompt cache: not writing to %s: the cache's entries are not shaped "
                         "as the model's config says", self.folder)  # fmt: skip
            return
        hashes = self.hashes(tokens)
        for index, block in enumerate(hashes):
            path = self.path(block)
            there = self._look(block)
            if there is None:  # something left in its place: nothing to write it over
                continue
            if there:
                try:
                    os.utime(path)
                    continue
                except FileNotFoundError:  # evicted meanwhile: written again
                    pass
                except OSError:  # there, but not ours to touch
                    continue
            with self._lock:
                if block in self._pending:
                    continue
                if len(self._pending) >= _QUEUED_BLOCKS:
                    self._stats.writes_dropped += 1
                    continue
                self._pending.add(block)
            span = slice(index * self.block_tokens, (index + 1) * self.block_tokens)
            tensors = {}
            for number, layer in enumerate(layers):
                for kind, source in (("k", layer.keys), ("v", layer.values)):
                    part = source[0, :, span, :]
                    tensors[f"{kind}.{number}"] = torch.empty(part.shape, dtype=part.dtype, device="cpu").copy_(part)
            parent = hashes[index - 1] if index else self.identity
            self._queue.put(_Write(path, block, parent, tuple(tokens[span]), tensors))

    def _write(self, item: _Write) -> None:
        try:
            self._write_file(item)
        finally:
            with self._lock:
                self._pending.discard(item.hash)

    def _write_file(self, item: _Write) -> None:
        checksum = _checksum(
            {name: tensor.reshape(-1).view(torch.uint8).numpy() for name, tensor in item.tensors.items()}
        )
        metadata = {"format": FORMAT, "version": str(FORMAT_VERSION), "identity": self.identity, "hash": item.hash,
                    "parent": item.parent, "tokens": json.dumps(list(item.tokens)), "checksum": checksum}  # fmt: skip
        data = safetensors_bytes(item.tensors, metadata)
        try:
            for folder in (self._root, item.path.parent):  # one by one: with `parents`, the first would be 0777
                folder.mkdir(mode=0o700, exist_ok=True)
            atomic_write_bytes(item.path, data, mode=0o600)
        except OSError as error:
            with self._lock:
                self._stats.write_failures += 1
            self._report(f"write {error.errno}", logging.WARNING, "prompt cache: cannot write blocks to %s: %s",
                         self.folder, os_reason(error))  # fmt: skip
            return
        with self._lock:
            self._stats.blocks_written += 1
            self._stats.bytes += len(data)
            over = self._stats.bytes > self.max_bytes
        if over:
            self._scan()

    def _scan(self) -> None:
        """Measure the folder's blocks and, over budget, delete the least recently used down to 7/8 of
        it; remove the temporary files of dead writers. Only names a block store writes are touched."""
        blocks = []
        for model_folder in _folders(self.folder, _MODEL_FOLDER):
            for prefix in _folders(model_folder, _PREFIX_FOLDER):
                remove_dead_temporaries(prefix)
                for entry in _entries(prefix):
                    if _BLOCK.fullmatch(entry.name):
                        try:
                            info = entry.stat(follow_symlinks=False)
                        except OSError:  # gone meanwhile
                            continue
                        blocks.append((info.st_mtime_ns, info.st_size, entry.path))
        total, evicted = sum(size for _, size, _ in blocks), 0
        if total > self.max_bytes:
            target = int(self.max_bytes * _EVICT_TO)
            for _, size, path in sorted(blocks):
                if total <= target:
                    break
                try:
                    os.unlink(path)
                except FileNotFoundError:  # another process evicted it first
                    pass
                except OSError:
                    continue
                total -= size
                evicted += 1
        with self._lock:
            self._stats.bytes = total
            self._stats.blocks_evicted += evicted

    def _report(self, key: str, level: int, message: str, *args: Any) -> bool:
        """Log `message` once per `key` in this process: a bad block or a failing disk is one line.
        Whether it was logged now."""
        with self._lock:
            if key in self._reported:
                return False
            self._reported.add(key)
        logger.log(level, message, *args)
        return True


def _checksum(tensors: dict[str, Any]) -> str:
    """sha256 over the tensors' names and bytes, in the names' sorted order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode() + b"\0")
        digest.update(tensors[name])
    return digest.hexdigest()


def _entries(folder: str | Path) -> list[os.DirEntry]:
    try:
        return list(os.scandir(folder))
    except OSError:  # removed meanwhile, or unreadable: nothing of ours to count
        return []


def _folders(folder: str | Path, name: re.Pattern) -> list[str]:
    return [e.path for e in _entries(folder) if name.fullmatch(e.name) and e.is_dir(follow_symlinks=False)]


def _write_loop(tasks: queue.Queue, store: weakref.ref) -> None:
    """The writer thread: writes and scans until its store is gone. It holds the store only while it
    works, so an engine dropped is a store collected and a thread ended."""
    while True:
        task = tasks.get()
        try:
            owner = store()
            if task is _STOP or owner is None:
                return
            try:
                owner._scan() if task is _SCAN else owner._write(task)
            except Exception:  # a cache write never fails a request; say what went wrong
                logger.exception("prompt cache: writing to %s failed", owner.folder)
            del owner
        finally:
            tasks.task_done()


def _drain(tasks: queue.Queue, writer: threading.Thread) -> None:
    """At exit, give the queued writes a moment (a one-shot command's blocks are what the next one
    reads), then end the writer: a thread still waiting once the interpreter finalizes aborts it."""
    deadline = time.monotonic() + _EXIT_WAIT_S
    while tasks.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    tasks.put(_STOP)
    writer.join(timeout=max(deadline - time.monotonic(), 0.1))
