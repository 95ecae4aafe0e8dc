"""A compiled kernel is loaded only when the cache proves it is the one built here."""

from __future__ import annotations

import shutil
import stat
import subprocess

import pytest

from rag_speculate.cpu.build import compile_kernel, kernels_dir, library_path

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
FLAGS = ["-O0", "-shared", "-fPIC"]


@pytest.fixture
def source(tmp_path, monkeypatch):
    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("CC", raising=False)
    path = tmp_path / "probe.c"
    path.write_text("int answer(void) { return 42; }\n")
    return path


def _compiler() -> str:
    return shutil.which("cc") or shutil.which("gcc")


def _build_other(tmp_path, target):
    """A working library that answers 7, written where the cache expects the probe."""
    other = tmp_path / "other.c"
    other.write_text("int answer(void) { return 7; }\n")
    subprocess.run([_compiler(), *FLAGS, str(other), "-o", str(target)], check=True)


def _answer(source) -> int:
    library, reason = compile_kernel(source, FLAGS, "probe", "the probe kernel")
    assert library is not None, reason
    return library.answer()


def test_the_kernels_folder_is_private_and_a_fresh_build_loads(source):
    assert _answer(source) == 42
    assert stat.S_IMODE(kernels_dir().stat().st_mode) == 0o700


def test_a_world_writable_kernels_folder_is_made_private(source):
    folder = kernels_dir()
    folder.chmod(0o777)
    assert stat.S_IMODE(kernels_dir().stat().st_mode) == 0o700


def test_a_library_planted_under_the_expected_name_is_rebuilt_not_loaded(source, tmp_path):
    target = library_path(source, FLAGS, "probe", _compiler())
    _build_other(tmp_path, target)
    assert _answer(source) == 42


def test_a_library_whose_recorded_hash_does_not_match_is_rebuilt(source, tmp_path):
    target = library_path(source, FLAGS, "probe", _compiler())
    _build_other(tmp_path, target)
    target.with_suffix(".sha256").write_text("0" * 64)
    assert _answer(source) == 42


def test_a_library_writable_by_others_is_rebuilt_even_with_its_hash_recorded(source, tmp_path):
    from rag_speculate.files.cache import sha256_file

    target = library_path(source, FLAGS, "probe", _compiler())
    _build_other(tmp_path, target)
    target.with_suffix(".sha256").write_text(sha256_file(target))
    target.chmod(0o777)
    assert _answer(source) == 42
    assert not stat.S_IMODE(target.stat().st_mode) & 0o022


def test_garbage_under_the_expected_name_is_rebuilt(source):
    target = library_path(source, FLAGS, "probe", _compiler())
    target.write_bytes(b"not a shared library")
    assert _answer(source) == 42
