"""A packaged model's GGUF file: found in its distributions, assembled from parts, sha256-verified.

A split model's parts are concatenated into ``<cache>/gguf/<name>.gguf``; a whole-file model is
verified where pip installed it instead of copied. The file is hashed once per process: it is only
read to convert it into the cache, which takes far longer than hashing it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import transformers

from ..errors import ModelPackageError
from ..files.cache import cache_dir, sha256_once
from ..files.durable import fsync_dir, recover, sibling
from .registry import PackagedModel, resolve

# One logger for every step of loading a packaged model, whichever module takes it.
logger = logging.getLogger("rag_speculate.models.packaged")

Progress = Callable[[str], None]

_CHUNK_BYTES = 8 * 1024 * 1024
_PART_FILE = re.compile(r"(^|/)data/part\d+\.bin$")


def gguf_path(name: str | PackagedModel, *, progress: Progress | None = None) -> Path:
    """Path of the verified GGUF file for a packaged model.

    Split models are assembled into the cache on first use; whole-file models
    are verified where pip installed them. Raises ``ModelPackageError`` if a
    distribution is missing or the checksum does not match.
    """
    spec = resolve(name)
    if len(spec.distributions) > 1:
        target = _gguf_dir() / f"{spec.name}.gguf"
        recover(target)  # a killed assembly's temporary file
        if target.is_file() and sha256_once(target) == spec.sha256:
            return target
        parts = _model_files(spec)
        report(progress, f"assembling {spec.name} ({len(parts)} parts) into {target}")
        _assemble(parts, target, spec)
        return target
    (target,) = _model_files(spec)
    report(progress, f"verifying sha256 of {target.name}")
    actual = sha256_once(target)
    if actual != spec.sha256:
        raise _checksum_error(spec, actual)
    return target


def dense_gguf(gguf_file: str) -> dict:
    """`from_pretrained`'s keywords that read a GGUF file into a plain dense model. transformers
    (5.2x) otherwise keeps the quantized blocks packed where its `kernels` package serves them,
    which changes every matmul; the engine quantizes on its own terms (`quantization="gguf"`)."""
    kwargs: dict = {"gguf_file": gguf_file}
    if hasattr(transformers, "GgufConfig"):  # older transformers always dequantize
        kwargs["quantization_config"] = transformers.GgufConfig(gguf_file=gguf_file, dequantize=True)
    return kwargs


def report(progress: Progress | None, message: str) -> None:
    """Log a step, and hand it to the caller's ``progress`` too: a first load is slow enough to follow."""
    logger.info(message)
    if progress is not None:
        progress(message)


def _gguf_dir() -> Path:
    return cache_dir() / "gguf"


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
