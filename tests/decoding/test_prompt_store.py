"""The prompt cache's disk tier on its own: blocks round-trip exactly and prefixes share them; two
processes writing the same and overlapping prefixes at once, or one killed mid-write, leave only
blocks that load and hold the right entries; leftover temporary files are never read and are
cleaned up; the folder's budget holds, least recently used blocks going first; everything it creates
is private to its user; an entry at a block's name that fails is removed when it is ours to remove and
the block written again, and anything else there left, reported once and counted."""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import stat
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rag_speculate.decoding.prompt_store import BlockShape, PromptStore, block_hashes
from rag_speculate.files.durable import _HOST

IDENTITY = hashlib.sha256(b"a model that is no model").hexdigest()
SHAPE = BlockShape(layers=2, heads=2, head_dim=4, dtype=torch.float32, tokens=8)
# Larger blocks for the killed writer: each write takes long enough to be caught in the middle.
LARGE = BlockShape(layers=4, heads=8, head_dim=64, dtype=torch.float32, tokens=64)
HERE = Path(__file__).resolve().parent


def layers_of(tokens: list[int], shape: BlockShape = SHAPE) -> list[SimpleNamespace]:
    """A cache's layers whose entries are a function of the tokens alone, as a model's are of its
    prefix: every writer of a block writes the same bytes, and a reader knows what it must find."""
    ids = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None]
    heads = torch.arange(shape.heads, dtype=torch.float32)[None, :, None, None]
    dims = torch.arange(shape.head_dim, dtype=torch.float32)
    return [SimpleNamespace(keys=ids + heads / 4 + dims / 100 + layer, values=-(ids + heads + dims + layer))
            for layer in range(shape.layers)]  # fmt: skip


def prefixes(count: int, seed: int, blocks: int = 4, shape: BlockShape = SHAPE) -> list[list[int]]:
    """`count` prompts of 1 to `blocks` full blocks and a partial one, many sharing their first blocks."""
    generator = torch.Generator().manual_seed(seed)
    heads = [torch.randint(2, 90, (2 * shape.tokens,), generator=generator).tolist() for _ in range(3)]
    out = []
    for i in range(count):
        length = int(torch.randint(shape.tokens, blocks * shape.tokens + shape.tokens // 2, (1,), generator=generator))
        tail = torch.randint(2, 90, (length,), generator=generator).tolist()
        out.append((heads[i % 3] + tail)[:length] if i % 2 else tail)
    return out


def store(folder: Path, shape: BlockShape = SHAPE, **options) -> PromptStore:
    return PromptStore(folder, IDENTITY, shape, **options)


def expect_block(got, tokens: list[int], index: int, shape: BlockShape = SHAPE) -> None:
    want = layers_of(tokens, shape)
    span = slice(index * shape.tokens, (index + 1) * shape.tokens)
    assert got is not None
    for (keys, values), layer in zip(got, want):
        assert torch.equal(keys, layer.keys[..., span, :]) and torch.equal(values, layer.values[..., span, :])


def block_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.safetensors"))


def test_blocks_round_trip_exactly_and_prefixes_share_them(tmp_path):
    disk = store(tmp_path)
    shared = list(range(2, 18))  # two full blocks
    first, second = shared + [40, 41, 42, 43, 44, 45, 46, 47, 48], shared + [50, 51, 52]
    for tokens in (first, second):
        disk.save(tokens, layers_of(tokens))
    disk.flush()
    # Three blocks for the first prompt, the same two for the second, and no partial block.
    assert len(block_files(tmp_path)) == 3
    for tokens in (first, second):
        hashes = disk.hashes(tokens)
        assert disk.present(hashes, 0) == len(hashes) == len(tokens) // SHAPE.tokens
        for index in range(len(hashes)):
            expect_block(disk.load(tokens, hashes, index), tokens, index)
    assert disk.stats().blocks_written == 3 and disk.stats().bytes == sum(
        f.stat().st_size for f in block_files(tmp_path)
    )
    # A block read back for other tokens, or at another place in the chain, is no hit.
    assert block_hashes(IDENTITY, first, 8)[:2] == block_hashes(IDENTITY, second, 8)[:2]
    assert block_hashes(IDENTITY, first[8:], 8)[0] != block_hashes(IDENTITY, first, 8)[1]


def _writer(folder: str, seed: int, reverse: bool) -> None:
    """A second process's writes: the same prefixes as its twin's, in another order."""
    disk = store(Path(folder))
    for tokens in prefixes(40, seed)[:: -1 if reverse else 1]:
        disk.save(tokens, layers_of(tokens))
    disk.flush()


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.path[:0] = {[str(HERE), str(HERE.parent)]!r}\n{code}"]


def test_two_processes_writing_the_same_and_overlapping_prefixes_at_once(tmp_path):
    code = "from test_prompt_store import _writer; _writer(sys.argv[1], 7, sys.argv[2] == 'reverse')"
    writers = [subprocess.Popen([*_python(code), str(tmp_path), order]) for order in ("forward", "reverse")]
    assert [w.wait(timeout=300) for w in writers] == [0, 0]
    disk = store(tmp_path)
    expected = set()
    for tokens in prefixes(40, 7):
        hashes = disk.hashes(tokens)
        expected |= {disk.path(h) for h in hashes}
        for index in range(len(hashes)):
            expect_block(disk.load(tokens, hashes, index), tokens, index)
    assert set(block_files(tmp_path)) == expected
    assert not list(tmp_path.rglob("*.tmp"))
    assert disk.stats().blocks_rejected == 0


def _endless_writer(folder: str) -> None:
    """Writes large blocks, one prompt of one block each, until it is killed."""
    disk = store(Path(folder), LARGE)
    for i in range(100_000):
        tokens = _large_prompt(i)
        disk.save(tokens, layers_of(tokens, LARGE))
        disk.flush()


def _large_prompt(i: int) -> list[int]:
    return [2 + i % 64, 2 + (i // 64) % 64, 2 + (i // 4096) % 64] + [5] * (LARGE.tokens - 3)


def test_a_writer_killed_mid_write_leaves_no_block_that_loads_wrong(tmp_path, caplog):
    writer = subprocess.Popen(
        _python(f"from test_prompt_store import _endless_writer; _endless_writer({str(tmp_path)!r})")
    )
    try:
        deadline = time.monotonic() + 120
        while len(block_files(tmp_path)) < 12:
            assert writer.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    files = block_files(tmp_path)
    # A temporary file as a killed writer leaves it, for a block that never made it into place.
    never = _large_prompt(99_999)
    never_path = store(tmp_path, LARGE).path(block_hashes(IDENTITY, never, LARGE.tokens)[0])
    never_path.parent.mkdir(parents=True, exist_ok=True)
    leftover = never_path.with_name(f".{never_path.name}.{_HOST}-{writer.pid}.{uuid.uuid4().hex}.tmp")
    leftover.write_bytes(b"half a block")

    disk = store(tmp_path, LARGE)  # its first act: a scan, which removes dead writers' temporary files
    disk.flush()
    assert not list(tmp_path.rglob("*.tmp"))
    written = {}
    for i in range(100_000):
        tokens = _large_prompt(i)
        path = disk.path(block_hashes(IDENTITY, tokens, LARGE.tokens)[0])
        if path in files:
            written[path] = tokens
        if len(written) == len(files):
            break
    assert set(written) == set(files)  # every file is a block the writer meant, at its own name
    for tokens in written.values():
        expect_block(disk.load(tokens, disk.hashes(tokens), 0), tokens, 0, LARGE)
    assert disk.load(never, disk.hashes(never), 0) is None
    assert not [r for r in caplog.records if r.name.startswith("rag_speculate")]


def test_the_folder_budget_holds_and_least_recently_used_blocks_go_first(tmp_path):
    prompts = [[2 + i, *range(3, 3 + SHAPE.tokens - 1)] for i in range(30)]  # one block each
    probe = store(tmp_path / "probe")
    probe.save(prompts[0], layers_of(prompts[0]))
    probe.flush()
    size = block_files(tmp_path / "probe")[0].stat().st_size
    disk = store(tmp_path / "cache", max_bytes=10 * size)
    kept = prompts[0]
    for tokens in prompts:
        disk.save(tokens, layers_of(tokens))
        disk.flush()
        time.sleep(0.002)  # mtimes in order
        assert disk.load(kept, disk.hashes(kept), 0) is not None  # the first prompt stays in use
    files = block_files(tmp_path / "cache")
    assert sum(f.stat().st_size for f in files) <= 10 * size
    assert disk.path(disk.hashes(kept)[0]) in files
    assert disk.path(disk.hashes(prompts[1])[0]) not in files  # the oldest unused went first
    assert disk.path(disk.hashes(prompts[-1])[0]) in files
    stats = disk.stats()
    assert stats.blocks_evicted >= 20 and stats.bytes <= stats.max_bytes


def test_a_full_disk_is_a_log_line_not_an_error(small_disk, caplog):
    disk = store(small_disk / "cache", LARGE)  # a block of 1 MiB, on a 64 KiB filesystem
    tokens = list(range(2, 2 + 3 * LARGE.tokens))
    disk.save(tokens, layers_of(tokens, LARGE))
    disk.flush()
    assert disk.stats().write_failures == 3 and disk.stats().blocks_written == 0
    assert len([r for r in caplog.records if "cannot write blocks" in r.getMessage()]) == 1
    assert not block_files(small_disk)  # and no temporary file left behind
    assert not [p for p in small_disk.rglob("*") if p.is_file()]


def test_everything_the_store_creates_is_private_to_its_user(tmp_path):
    previous = os.umask(0o022)  # the usual umask, which would leave folders 0755 and files 0644
    try:
        disk = store(tmp_path / "cache")
        tokens = list(range(2, 2 + SHAPE.tokens))
        disk.save(tokens, layers_of(tokens))
        disk.flush()
    finally:
        os.umask(previous)
    block = disk.path(disk.hashes(tokens)[0])
    modes = {path: stat.S_IMODE(path.stat().st_mode) for path in (tmp_path / "cache", block.parent.parent, block.parent)}
    assert modes == dict.fromkeys(modes, 0o700) and stat.S_IMODE(block.stat().st_mode) == 0o600


def _bad_entry(path: Path, kind: str) -> None:
    """Put what `kind` names at a block's name, in place of its block."""
    if kind == "a damaged block":
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
        return
    path.unlink()
    if kind == "a file every user may write":
        path.write_bytes(b"anything")
        path.chmod(0o666)
    elif kind in ("a folder", "another user's folder"):
        (path / "inside").mkdir(parents=True)
    elif kind == "a FIFO":
        os.mkfifo(path, 0o600)
    elif kind == "a symbolic link":
        path.symlink_to(path.parent)
    elif kind == "another user's file":
        path.write_bytes(b"anything")
    if kind.startswith("another user's"):
        os.chown(path, 12345, 12345, follow_symlinks=False)


# What may be removed: a file or a folder of this user's (the tests run as the folder's owner).
OURS = ["a damaged block", "a file every user may write", "a folder"]
# What is left: another user's, and what is neither a file nor a folder.
NOT_OURS = ["a FIFO", "a symbolic link", "another user's file", "another user's folder"]


def _needs_root(kind: str) -> None:
    if kind.startswith("another user's") and os.getuid() != 0:
        pytest.skip("giving a file to another user takes root")


@pytest.mark.parametrize("kind", OURS)
def test_an_entry_of_ours_that_fails_is_removed_and_the_block_written_again(tmp_path, caplog, kind):
    disk = store(tmp_path)
    tokens = list(range(2, 2 + 3 * SHAPE.tokens))
    disk.save(tokens, layers_of(tokens))
    disk.flush()
    hashes = disk.hashes(tokens)
    path = disk.path(hashes[1])
    _bad_entry(path, kind)
    with caplog.at_level(logging.WARNING, logger="rag_speculate"):
        # A damaged block is found on reading it; anything else already on looking.
        run = disk.present(hashes, 0)
        assert (run, disk.load(tokens, hashes, 1)) == ((3, None) if kind == "a damaged block" else (1, None))
        assert not os.path.lexists(path)
        disk.save(tokens, layers_of(tokens))  # the write-through after the answer
        disk.flush()
    assert disk.present(hashes, 0) == 3
    expect_block(disk.load(tokens, hashes, 1), tokens, 1)
    stats = disk.stats()
    assert (stats.blocks_rejected, stats.entries_refused, stats.blocks_written) == (1, 0, 4)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("rag_speculate")]
    assert len(lines) == 1 and str(path) in lines[0] and "removed" in lines[0]


@pytest.mark.parametrize("kind", NOT_OURS)
def test_an_entry_not_ours_to_remove_is_left_reported_once_and_counted(tmp_path, caplog, kind):
    _needs_root(kind)
    disk = store(tmp_path)
    tokens = list(range(2, 2 + 3 * SHAPE.tokens))
    hashes = disk.hashes(tokens)
    path = disk.path(hashes[1])
    disk.save(tokens, layers_of(tokens))
    disk.flush()
    _bad_entry(path, kind)
    before = path.lstat()
    with caplog.at_level(logging.WARNING, logger="rag_speculate"):
        for _ in range(3):  # a prefix asked for again and again: one line, one count
            assert disk.present(hashes, 0) == 1
            assert disk.load(tokens, hashes, 1) is None  # and a FIFO does not keep the read waiting
            disk.save(tokens, layers_of(tokens))
            disk.flush()
    after = path.lstat()
    assert (after.st_ino, after.st_mode, after.st_uid) == (before.st_ino, before.st_mode, before.st_uid)
    expect_block(disk.load(tokens, hashes, 0), tokens, 0)
    expect_block(disk.load(tokens, hashes, 2), tokens, 2)
    stats = disk.stats()
    assert (stats.entries_refused, stats.blocks_rejected, stats.blocks_written) == (1, 0, 3)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("rag_speculate")]
    reason = {"a FIFO": "a FIFO", "a symbolic link": "a symbolic link", "another user's folder": "a folder"}.get(
        kind, "owned by another user (uid 12345)"
    )
    assert len(lines) == 1 and str(path) in lines[0] and reason in lines[0], lines
