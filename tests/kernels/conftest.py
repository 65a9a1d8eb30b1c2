"""Kernel tests run the Triton kernels under the interpreter on the CPU (fp32/fp16 only: interpreted
bf16 tl.dot multiplies raw bits). TRITON_INTERPRET is read when a kernel is decorated, so it is set
here, before any test module imports dflash_trt.kernels.*_triton."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def triton_device() -> str:
    pytest.importorskip("triton", reason="the `kernels` extra (triton==3.7.1) is not installed")
    return "cuda" if torch.cuda.is_available() else "cpu"
