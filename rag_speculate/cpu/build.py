"""C kernels compiled on first use with the system's compiler, cached, and loaded with `ctypes`."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from ..files import sibling

# -ffp-contract=off: the kernels' sums keep the order written, whatever the compiler fuses.
BASE_FLAGS = ["-O3", "-funroll-loops", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]


def compile_kernel(source_path: Path, flags: list[str], stem: str, what: str) -> tuple[ctypes.CDLL | None, str]:
    """`source_path` compiled with `flags` into the cache as `stem-<hash>.so` unless already there
    (the hash covers the source, the compiler and the flags; built under a temporary name and
    renamed into place), and loaded; or None and why not, naming the kernel as `what`."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None, f"no C compiler (cc, gcc or $CC) to build {what}"
    source = source_path.read_bytes()
    digest = hashlib.sha256(b"\0".join([source, compiler.encode(), *(f.encode() for f in flags)])).hexdigest()[:16]
    from ..models.packaged import cache_dir  # models imports transformers' loaders; only needed here

    library = cache_dir() / "kernels" / f"{stem}-{digest}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        built = sibling(library, "so")
        try:
            subprocess.run([compiler, *flags, str(source_path), "-o", str(built)], check=True, capture_output=True, timeout=120)
            os.replace(built, library)  # another process may have built it too: same bytes
        except (OSError, subprocess.SubprocessError) as exc:
            detail = exc.stderr.decode(errors="replace").strip() if isinstance(exc, subprocess.CalledProcessError) else exc
            return None, f"building {what} with {compiler} failed: {detail}"
        finally:
            built.unlink(missing_ok=True)
    try:
        return ctypes.CDLL(str(library)), ""
    except OSError as exc:
        return None, f"loading {what} {library} failed: {exc}"
