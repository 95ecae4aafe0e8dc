"""What this machine computes on: the torch device a model loads on (named the ways transformers'
users name it), the CPU's features, and the dtype a model computes in by default there."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from .errors import InvalidArgumentError

Device = str | int | torch.device | None


def resolve_device(device: Device) -> torch.device:
    """None: CUDA when torch sees a GPU, else the CPU. A string or `torch.device` as torch reads it
    ("cpu", "cuda", "cuda:1", "mps"); an int as transformers' pipelines read it (-1: the CPU, N: GPU N).
    A device this machine lacks is refused here, by name, rather than at the first forward."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise InvalidArgumentError(f"device must be None, a device name like 'cuda' or 'cpu', or a GPU index, got {device!r}")
    if isinstance(device, int):
        device = "cpu" if device == -1 else f"cuda:{device}"
    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError):
        raise InvalidArgumentError(f"unknown device {device!r}: expected 'cpu', 'cuda', 'cuda:N' or 'mps'") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgumentError(f"device={str(device)!r}, but torch sees no CUDA GPU here (torch {torch.__version__})")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise InvalidArgumentError(f"device={str(device)!r}, but torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    elif resolved.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidArgumentError(f"device={str(device)!r}, but this torch has no MPS backend here")
    elif resolved.type not in ("cpu", "cuda", "mps"):
        raise InvalidArgumentError(f"device={str(device)!r}: rag-speculate runs on 'cpu', 'cuda' or 'mps'")
    return resolved


# transformers' strategies for placing a model; on the one device the engine uses, all the default one.
_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one: torch.device("cuda") and a model's "cuda:0" are unequal as
    objects but the same GPU where the current one is GPU 0."""

    def index(device: torch.device) -> int | None:
        if device.type == "cuda" and device.index is None:
            return torch.cuda.current_device()
        return device.index

    return a.type == b.type and index(a) == index(b)


def device_from_map(device_map: str | dict | None, device: Device = None) -> Device:
    """The one device a `device_map` names (None or a placement strategy such as "auto": `device`,
    else the default device; "cpu", "cuda:0"...); the engine runs a model on one device, so a map
    that shards it across several is refused."""
    if device_map is None or device_map in _STRATEGIES:
        return device
    if device is not None:
        raise InvalidArgumentError(f"pass device={device!r} or device_map={device_map!r}, not both")
    if isinstance(device_map, str):
        return device_map
    devices = set(device_map.values()) if isinstance(device_map, dict) else {None}
    if len(devices) != 1:
        raise InvalidArgumentError(
            f"device_map {device_map!r} spreads the model over several devices; rag-speculate runs it on one "
            "(pass device='cuda' or device_map='auto')"
        )
    return devices.pop()


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (none elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return {flag for line in lines if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def processor(device: torch.device) -> str | list[str]:
    """Which chip computes on `device`, as far as its results and speed depend on it: the GPU's
    name, or the CPU's with its feature flags (its kernels round and run by them)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return [platform.processor() or platform.machine(), *sorted(cpu_flags())]
    return device.type


def default_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """bf16 where the hardware computes in it (GPUs, CPUs with AVX512-BF16 or AMX), else fp32.

    On an AVX2-only CPU bf16 matrix products are emulated, so a prefill or a forward over several
    tokens (every verification step) is several times slower than in fp32, which outweighs the
    little bf16 saves on a single-token step.
    """
    if torch.device(device).type != "cpu":
        return torch.bfloat16
    return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & cpu_flags() else torch.float32
