"""The accelerator a peer computes on: which one, how much memory it has, how many CPU threads to use.

``--device auto`` takes CUDA when present, then Apple's MPS, then the CPU. A device asked for by name
that this machine does not have is an error naming what it has, never a silent fall back to the CPU.
Host <-> device copies go through pinned memory with non-blocking copies (:func:`to_device`), so a
request's transfer overlaps the decode of the next one.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

DEVICE_PATTERN = re.compile(r"^(auto|cpu|mps|cuda(:\d{1,2})?)$")


class DeviceError(ValueError):
    """A device this machine does not have, or a name that is no device."""


@dataclass(frozen=True)
class DeviceInfo:
    name: str  # "cpu", "cuda:0", "mps"
    label: str  # the accelerator's name ("NVIDIA H200") or the CPU's
    total_bytes: int
    free_bytes: int

    def describe(self) -> str:
        return f"{self.name} ({self.label}, {self.free_bytes / 2**30:.1f} of {self.total_bytes / 2**30:.1f} GiB free)"


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def resolve_device(text: str) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N`` | ``mps`` to a device this machine has."""
    text = (text or "auto").strip().lower()
    if not DEVICE_PATTERN.match(text):
        raise DeviceError(f"--device {text!r}: expected auto, cpu, cuda, cuda:N or mps")
    if text == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    device = torch.device(text)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise DeviceError(f"--device {text}: this machine has no CUDA device (torch {torch.__version__})")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= count:
            raise DeviceError(f"--device {text}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")
        return torch.device("cuda", index)
    if device.type == "mps" and not _mps_available():
        raise DeviceError("--device mps: MPS is not available on this machine")
    return device


def device_info(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceInfo(str(device), torch.cuda.get_device_name(device), int(total), int(free))
    if device.type == "mps":
        total = int(torch.mps.recommended_max_memory())
        return DeviceInfo("mps", "Apple MPS", total, max(0, total - int(torch.mps.current_allocated_memory())))
    total, free = _host_memory()
    return DeviceInfo("cpu", _cpu_label(), total, free)


def memory_in_use(device: torch.device) -> int:
    """Bytes this process holds on the device (on the CPU: its resident memory)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.current_allocated_memory())
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: through pinned memory with a non-blocking copy on CUDA (the stream
    orders it before the compute that reads it); unchanged on the CPU."""
    if device.type == "cpu" or t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A result leaving the peer: on the CPU (the reply's encoder reads its bytes)."""
    return t if t.device.type == "cpu" else t.to("cpu")


def _host_memory() -> tuple[int, int]:
    total = free = 0
    try:
        with open("/proc/meminfo") as f:
            fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if ":" in line}
        total, free = fields.get("MemTotal", 0), fields.get("MemAvailable", 0)
    except (OSError, ValueError, IndexError):
        pass
    if not total:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        total = free = pages * size
    return total, free


def _cpu_label() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"
