"""Host data onto the runtime's device without making the host wait.

On CUDA a copy from ordinary (pageable) host memory synchronizes: the host waits until every kernel queued before it
has run, and cannot queue the step's next kernels meanwhile. Copied from pinned memory, the copy is queued like a
kernel (PyTorch's caching host allocator keeps the pinned block until the copy has run). Elsewhere these are plain
copies.
"""

from __future__ import annotations

import torch


def to_device(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.tensor(data, dtype=dtype) on `device`."""
    if torch.device(device).type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def host_to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`. `t` should be contiguous (else the copy goes through a pageable temporary) and left
    unwritten after the call: a `t` already pinned is copied from in place, asynchronously."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
