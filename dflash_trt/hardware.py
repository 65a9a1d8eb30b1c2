"""Hardware profiles the planner checks a build against: memory per device and device count.

GPU capacities are NVIDIA's published HBM sizes in decimal gigabytes (B300 288 GB, H200 141 GB),
which is at or below what the driver reports, so a plan that fits here fits on the device. The CPU
profile reads this machine's RAM when the plan is made.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

GB = 10**9
GiB = 2**30


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    kind: str  # "gpu" | "cpu"
    memory_bytes: int  # per device
    max_devices: int  # devices in one node of this kind
    # Driver/CUDA context, NCCL and library workspaces, allocator slack: an estimate per device that
    # the planner never hands to weights or caches.
    reserve_bytes: int
    # DFlash's TRTLLM drafter attention backend needs SM100/SM103 (trtllm.md 1.7.5); others use VANILLA.
    supports_trtllm_dflash_attention: bool = False
    description: str = ""

    @property
    def device(self) -> str:
        return "cuda" if self.kind == "gpu" else "cpu"

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def profile(name: str) -> HardwareProfile:
    """The profile called `name` (b300, h200, cpu); ValueError naming the choices otherwise."""
    if name == "b300":
        return HardwareProfile("b300", "gpu", 288 * GB, 8, 3 * GiB, True, "NVIDIA B300 (DGX B300: 8 per node)")
    if name == "h200":
        return HardwareProfile("h200", "gpu", 141 * GB, 8, 3 * GiB, False, "NVIDIA H200 (HGX H200: 8 per node)")
    if name == "cpu":
        return HardwareProfile("cpu", "cpu", cpu_ram_bytes(), 1, 2 * GiB, False, "this machine's CPU and RAM")
    raise ValueError(f"hardware={name!r} is not a known profile; choose one of {PROFILE_NAMES}")


PROFILE_NAMES = ("b300", "h200", "cpu")
