"""A GGUF file named by a user, checked before anything reads it: the `gguf` package's reader, and
transformers through it, trust every count, length and offset a file holds, so a truncated or damaged
file ends in a reshape, struct or decoding error far from its cause, or in reading a device forever.

The check walks the header, the metadata and the tensor table as llama.cpp lays them out, each
count, length and offset bounded by the file's size before it is used, and each tensor's data inside
the file and of a type the `gguf` package dequantizes. It reads the metadata (a tokenizer's vocabulary
is most of it) but none of the tensors' data.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import stat
import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from ..errors import ModelPackageError
from ..files.durable import os_reason

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # those the gguf package reads
_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_DEFAULT_ALIGNMENT = 32
# struct's code for each fixed-size metadata type; strings and arrays carry their lengths.
_SCALARS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}  # fmt: skip
# The fewest bytes one metadata entry (a key's length, a type, a one-byte value) and one tensor's
# entry (a name's length, a dimension count, a type, an offset) take: what bounds their counts.
_ENTRY_BYTES = 8 + 4 + 1
_TENSOR_BYTES = 8 + 4 + 4 + 8


class _Fault(Exception):
    """What is wrong with the file, in words; `check_gguf` names the file."""


def check_gguf(path: str | os.PathLike[str]) -> Path:
    """`path` once it is known to be a whole GGUF file that the `gguf` package reads within its bounds.

    Raises `ModelPackageError` naming the file and what is wrong: missing, not a regular file (a
    folder, a device), empty, not GGUF, or a header, metadata entry or tensor that runs past its
    end, a count or length the file cannot hold, text that is not UTF-8, a tensor of a type that
    cannot be dequantized.
    """
    path = Path(path)
    # stat, not open: opening a FIFO blocks, and a device such as /dev/zero never ends.
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ModelPackageError(f"no GGUF file at {path}: it does not exist") from None
    except OSError as error:
        raise ModelPackageError(f"the GGUF file {path} cannot be read: {os_reason(error)}") from None
    if stat.S_ISDIR(info.st_mode):
        raise ModelPackageError(f"{path} is a folder, not a GGUF file")
    if not stat.S_ISREG(info.st_mode):
        raise ModelPackageError(f"{path} is not a regular file (a device, a pipe or a socket), not a GGUF file")
    if info.st_size == 0:
        raise ModelPackageError(f"the GGUF file {path} is empty")
    try:
        with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _Reader(data).walk()
    except OSError as error:
        raise ModelPackageError(f"the GGUF file {path} cannot be read: {os_reason(error)}") from None
    except _Fault as fault:
        raise ModelPackageError(f"{path} is not a usable GGUF file: {fault}") from None
    return path


class _Reader:
    """A cursor over the mapped file: every read is checked against the file's end before it is made."""

    def __init__(self, data: mmap.mmap):
        self.data, self.at, self.order = data, 0, "<"

    def walk(self) -> None:
        if self.data[:4] != _MAGIC:
            raise _Fault(f"it does not start with the GGUF magic (its first bytes are {bytes(self.data[:4])!r})")
        self.at = 4
        version = self.unpack("I", "the version")
        if version & 0xFFFF == 0:  # written on a big-endian machine: read as the gguf package reads it
            self.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in _VERSIONS:
            raise _Fault(f"GGUF version {version} is not one of {_VERSIONS}")
        tensors = self.count("tensors", _TENSOR_BYTES)
        entries = self.count("metadata entries", _ENTRY_BYTES)
        metadata = {}
        for i in range(entries):
            key = self.string(f"the key of metadata entry {i}")
            if key in metadata:
                raise _Fault(f"the metadata key {key!r} appears twice")
            metadata[key] = self.value(self.unpack("I", f"the type of {key!r}"), repr(key))
        alignment = metadata.get("general.alignment", (GGUFValueType.UINT32, _DEFAULT_ALIGNMENT))
        if alignment[0] != GGUFValueType.UINT32 or alignment[1] <= 0 or alignment[1] & (alignment[1] - 1):
            raise _Fault(f"general.alignment is {alignment[1]!r}, not a power of two held as a uint32")
        if metadata.get("general.architecture", (None,))[0] != GGUFValueType.STRING:
            raise _Fault("it has no general.architecture string, which names the model's kind")
        table = [self.tensor(i, alignment[1]) for i in range(tensors)]
        start = -(-self.at // alignment[1]) * alignment[1]  # the tensors' data begins aligned
        names, end = set(), len(self.data)
        for name, offset, size in table:
            if name in names:
                raise _Fault(f"the tensor {name!r} appears twice")
            names.add(name)
            if (stop := start + offset + size) > end:
                raise _Fault(f"truncated: the data of tensor {name!r} runs to byte {stop}, past the end at {end}")

    def need(self, size: int, what: str) -> None:
        if size > len(self.data) - self.at:
            raise _Fault(f"truncated: {what} ({size} bytes at byte {self.at}) runs past the end at {len(self.data)}")

    def unpack(self, code: str, what: str) -> int | float | bool:
        fmt = self.order + code
        self.need(struct.calcsize(fmt), what)
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def count(self, what: str, least_bytes: int) -> int:
        """A count of items that take at least `least_bytes` each: refused when the rest of the file
        cannot hold that many, before anything loops over them or allocates for them."""
        n = self.unpack("Q", f"the number of {what}")
        if n * least_bytes > len(self.data) - self.at:
            rest = len(self.data) - self.at
            raise _Fault(f"truncated or damaged: it claims {n} {what}, more than its last {rest} bytes hold")
        return n

    def string(self, what: str) -> str:
        size = self.unpack("Q", f"the length of {what}")
        self.need(size, what)  # a length of 2**62 is compared here, never allocated
        raw = self.data[self.at : self.at + size]
        self.at += size
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Fault(f"{what} at byte {self.at - size} is not UTF-8 text") from None

    def value(self, kind: int, what: str) -> tuple[int, object]:
        """A metadata value as (its type, the value; None for an array, which is walked over)."""
        if kind == GGUFValueType.STRING:
            return kind, self.string(what)
        if kind in _SCALARS:
            return kind, self.unpack(_SCALARS[GGUFValueType(kind)], what)
        if kind != GGUFValueType.ARRAY:
            raise _Fault(f"{what} has the unknown value type {kind}")
        item = self.unpack("I", f"the item type of {what}")
        if item in _SCALARS:
            n = self.count(f"items in {what}", struct.calcsize(_SCALARS[GGUFValueType(item)]))
            self.at += n * struct.calcsize(_SCALARS[GGUFValueType(item)])  # count checked that they fit
        elif item == GGUFValueType.STRING:
            for i in range(self.count(f"items in {what}", 8)):
                self.string(f"{what}[{i}]")
        else:  # nor does llama.cpp read arrays of arrays
            raise _Fault(f"{what} is an array of the unsupported item type {item}")
        return kind, None

    def tensor(self, index: int, alignment: int) -> tuple[str, int, int]:
        """Tensor `index`'s entry in the table: its name, data offset and size in bytes."""
        name = self.string(f"the name of tensor {index}")
        dims = self.unpack("I", f"the dimension count of tensor {name!r}")
        if dims > _MAX_DIMS:
            raise _Fault(f"tensor {name!r} has {dims} dimensions, more than ggml's {_MAX_DIMS}")
        shape = [self.unpack("Q", f"the shape of tensor {name!r}") for _ in range(dims)]
        kind = self.unpack("I", f"the type of tensor {name!r}")
        offset = self.unpack("Q", f"the data offset of tensor {name!r}")
        if kind not in GGML_QUANT_SIZES:
            raise _Fault(f"tensor {name!r} has the unknown type {kind}")
        kind = GGMLQuantizationType(kind)
        if not _dequantizable(kind):
            raise _Fault(f"tensor {name!r} is of type {kind.name}, which the gguf package cannot dequantize")
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if any(n >= 2**63 for n in shape) or (shape and shape[0] % block):
            raise _Fault(f"tensor {name!r} has the shape {shape}, not whole {kind.name} blocks of {block}")
        if offset % alignment:
            raise _Fault(f"the data offset {offset} of tensor {name!r} is not a multiple of the alignment {alignment}")
        return name, offset, math.prod(shape) // block * block_bytes


@functools.cache
def _dequantizable(kind: GGMLQuantizationType) -> bool:
    """Whether the gguf package dequantizes `kind`, as transformers has it do for every tensor."""
    try:
        dequantize(np.zeros(GGML_QUANT_SIZES[kind][1], dtype=np.uint8), kind)
    except NotImplementedError:
        return False
    return True
