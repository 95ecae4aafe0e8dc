"""Loading a packaged model through its converted cache: the GGUF file dequantized once into safetensors.

transformers dequantizes every tensor of a GGUF file at each load, which is slow, so the first
load per (model, dtype) saves the result as ``<cache>/<name>-<dtype>/`` with a manifest, and every
later load is a plain ``from_pretrained``. The folder is written under a temporary name, checked to
reload to bit-identical tensors, and renamed into place, so an interrupted run never leaves a
partial cache that looks complete. Before it is loaded, every file in it must match the size and
sha256 its manifest records (hashed once per process), and nothing else may be there; a cache that
fails is rebuilt.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..errors import InvalidArgumentError, ModelPackageError
from ..files.cache import cache_dir, sha256_once
from ..files.durable import fsync_dir, recover, replace_dir, sibling, write_new_file
from ..files.schema import SHA256, FieldError, fields, integer, load_json, mapping, text
from ..fingerprint import known_weights
from .gguf_file import Progress, dense_gguf, gguf_path, logger, report
from .registry import PackagedModel, resolve

# Bump when the converted-cache layout changes so old caches get rebuilt.
CACHE_FORMAT_VERSION = 1
MANIFEST_NAME = "rag_speculate_manifest.json"
WEIGHTS_NAME = "model.safetensors"
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Errors that a damaged safetensors/config file can raise on load.
_CACHE_LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, SafetensorError)
# Every manifest field loading reads; a file name is a plain name inside the folder.
_MANIFEST = fields(
    {
        "format_version": integer(0),
        "model": text(),
        "gguf_sha256": SHA256,
        "dtype": text(),
        "files": mapping(text(r"[\w][\w.-]*"), fields({"size": integer(0), "sha256": SHA256})),
    }
)


def load_packaged_model(
    name: str | PackagedModel,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    progress: Progress | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a packaged model and its tokenizer, in eval mode, on ``device``.

    The first call per (model, dtype) converts the GGUF file into a safetensors
    cache, which is slow; later calls load that cache. A cache that fails
    validation is logged as a warning and rebuilt.
    """
    spec = resolve(name)
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
    model = model.eval().to(target_device)
    # Its weights are the GGUF file's, checked against the registry's sha256, in this dtype: what the
    # prompt cache's disk tier files its entries under, with no pass over the weights.
    known_weights(model, f"packaged {spec.name} {spec.sha256} {_dtype_name(dtype)}")
    return model, tokenizer


def load_packaged_tokenizer(name: str | PackagedModel, *, progress: Progress | None = None) -> PreTrainedTokenizerBase:
    """A packaged model's tokenizer without its weights: from a converted cache of any dtype whose
    files are the ones written (the weights only by their size, as they are not read), else read
    from the GGUF file, which is slower."""
    spec = resolve(name)
    for dtype in SUPPORTED_DTYPES:
        folder = converted_dir(spec, dtype)
        recover(folder)
        if folder.exists() and _manifest_problem(folder, spec, dtype, weights=False) is None:
            try:
                return AutoTokenizer.from_pretrained(folder, local_files_only=True)
            except Exception:  # noqa: BLE001 - the tokenizers library raises a bare Exception; the GGUF remains
                logger.warning("the tokenizer in %s did not load; reading it from the GGUF file", folder)
    path = gguf_path(spec, progress=progress)
    report(progress, f"reading {spec.name}'s tokenizer from {path}")
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


def converted_dir(name: str | PackagedModel, dtype: torch.dtype) -> Path:
    """Folder holding the safetensors cache of a model for one dtype."""
    spec = resolve(name)
    return cache_dir() / f"{spec.name}-{_dtype_name(dtype)}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- loading the cache ----------------------------------------------------


class _UnusableCache(Exception):
    """A converted cache folder that transformers cannot load faithfully."""


def _load_converted_or_none(
    folder: Path, spec: PackagedModel, dtype: torch.dtype, progress: Progress | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase] | None:
    """Load the safetensors cache, or None (after a warning) if it is unusable."""
    recover(folder)  # a replacement killed halfway leaves the previous cache aside
    if not folder.exists():
        return None
    problem = _manifest_problem(folder, spec, dtype)
    if problem is None:
        report(progress, f"loading {spec.name} ({_dtype_name(dtype)}) from cache {folder}")
        try:
            return _load_cached(folder, dtype)
        except _UnusableCache as exc:
            problem = str(exc)
    logger.warning("model cache %s is unusable (%s); rebuilding it", folder, problem)
    report(progress, f"cache at {folder} is unusable; rebuilding")
    return None


def _load_cached(folder: Path, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, local_files_only=True, output_loading_info=True
        )
    except _CACHE_LOAD_ERRORS as exc:
        raise _UnusableCache(f"loading failed: {type(exc).__name__}: {exc}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot read
        raise _UnusableCache(f"loading the tokenizer failed: {type(exc).__name__}: {exc}") from exc
    # transformers only warns about missing or unexpected weights; here they mean
    # randomly initialised layers, e.g. a tied weight that was not re-tied.
    bad = {kind: sorted(keys) for kind, keys in info.items() if kind != "error_msgs" and keys}
    if bad:
        raise _UnusableCache(f"weights do not match the model: {bad}")
    return model, tokenizer


def _manifest_problem(folder: Path, spec: PackagedModel, dtype: torch.dtype, *, weights: bool = True) -> str | None:
    """Why the cache in ``folder`` cannot be trusted, or None if every file is the one written
    (``weights=False``: every file but the weights, whose size alone is checked)."""
    try:
        manifest = load_json((folder / MANIFEST_NAME).read_bytes())
        _MANIFEST(manifest, "")
    except (OSError, ValueError) as exc:
        return f"manifest unreadable: {exc}"
    except FieldError as exc:
        return f"manifest {exc}"
    expected = {
        "format_version": CACHE_FORMAT_VERSION,
        "gguf_sha256": spec.sha256,
        "dtype": _dtype_name(dtype),
    }
    for key, value in expected.items():
        if manifest[key] != value:
            return f"manifest {key} is {manifest[key]!r}, expected {value!r}"
    files = manifest["files"]
    if WEIGHTS_NAME not in files:
        return "manifest lists no weights file"
    # transformers reads whatever else is in the folder (a chat template, a tokenizer's extra files).
    present = {path.name for path in folder.iterdir()} - {MANIFEST_NAME}
    if present != files.keys():
        return f"the folder holds {sorted(present)}, the manifest lists {sorted(files)}"
    # Sizes first, which find a truncated file without reading it; then every byte, since a same-size
    # change would load other weights silently.
    for file_name, entry in files.items():
        size = (folder / file_name).stat().st_size
        if size != entry["size"]:
            return f"{file_name} has size {size}, expected {entry['size']}"
    for file_name, entry in files.items():
        if (weights or file_name != WEIGHTS_NAME) and sha256_once(folder / file_name) != entry["sha256"]:
            return f"{file_name} does not match its sha256"
    return None


# --- building the cache ---------------------------------------------------


def _convert(
    spec: PackagedModel, dtype: torch.dtype, folder: Path, progress: Progress | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the GGUF file with transformers, save it as the cache, and load the cache."""
    path = gguf_path(spec, progress=progress)
    report(
        progress,
        f"converting {spec.name} GGUF to {_dtype_name(dtype)} safetensors "
        "(once: every tensor is dequantized, which is slow for the larger models)",
    )
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, **dense_gguf(path.name), dtype=dtype, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    report(progress, f"writing model cache {folder}")
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
    recover(folder)  # leftovers of killed conversions
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
            files[path.name] = {"size": path.stat().st_size, "sha256": sha256_once(path)}
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
    """Replace ``folder`` (if any) with the finished ``tmp`` folder."""
    try:
        replace_dir(tmp, folder)
    except OSError:
        # Another process finished the same conversion first; its copy is equivalent.
        if not folder.exists():
            raise
        logger.info("model cache %s was written concurrently; keeping that copy", folder)
