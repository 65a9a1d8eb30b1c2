"""Custom ops with a torch reference (`*_ref`, the semantics, run on the CPU) and a Triton kernel (run on CUDA).

`dflash::draft_attention` (draft_attention.py) and `dflash::verify_block` (verify_block.py) are
`torch.library` custom ops: the runtime calls them, so the CPU path runs the references through the
same interface the GPU path runs the kernels through. Triton is imported only when a kernel launches.
"""

from __future__ import annotations


def require_triton():
    """Import triton or say how to get it (the `kernels` extra; CUDA torch wheels already pull it)."""
    try:
        import triton
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "triton is not importable: install it with `pip install 'dflash-trt[kernels]'` (triton==3.7.1, the "
            "version torch 2.13.0's CUDA wheel pins)"
        ) from error
    return triton


def on_device_of(tensor):
    """A context in which Triton launches on `tensor`'s GPU: Triton launches on the current CUDA device, not the
    arguments', so a kernel given cuda:1's tensors would run on cuda:0's stream with pointers it cannot read."""
    import contextlib

    import torch

    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()
