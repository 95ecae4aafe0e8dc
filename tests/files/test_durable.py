"""What may be trusted on disk: `untrusted` names why another user could have changed an entry, and
with `regular_file` refuses anything a file to read must not be."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rag_speculate.files.durable import untrusted

pytestmark = pytest.mark.skipif(os.name != "posix", reason="owners and modes are POSIX's")


def _file(tmp_path: Path, mode: int = 0o600) -> Path:
    path = tmp_path / "entry"
    path.write_bytes(b"data")
    path.chmod(mode)
    return path


def test_a_private_file_of_ours_is_trusted_by_path_and_by_stat(tmp_path):
    path = _file(tmp_path)
    assert untrusted(path) is None
    assert untrusted(path, regular_file=True) is None
    with path.open("rb") as opened:
        assert untrusted(os.fstat(opened.fileno()), regular_file=True) is None


def test_a_file_every_user_may_write_is_not(tmp_path):
    assert untrusted(_file(tmp_path, 0o666)) == "is writable by every user"
    assert untrusted(os.lstat(tmp_path / "entry"), regular_file=True) == "is writable by every user"


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user takes root")
def test_another_users_file_is_not(tmp_path):
    path = _file(tmp_path)
    os.chown(path, 12345, 12345)
    assert untrusted(path) == "is owned by another user (uid 12345)"


def test_only_a_regular_file_is_one_to_read(tmp_path):
    target = _file(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(target)
    folder = tmp_path / "folder"
    folder.mkdir(mode=0o700)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    # A link is judged itself, not through its target; its own mode says nothing.
    assert untrusted(link) is None and untrusted(folder) is None and untrusted(fifo) is None
    assert untrusted(link, regular_file=True) == "is a symbolic link, not a regular file"
    assert untrusted(folder, regular_file=True) == "is a folder, not a regular file"
    assert untrusted(fifo, regular_file=True) == "is a FIFO, not a regular file"
