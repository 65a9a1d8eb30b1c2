"""Where the torch runtime runs, and in which dtype, when no engine directory says (--target runs)."""

from __future__ import annotations

DEVICE_HELP = ("Where the torch runtime runs: cpu or cuda (default: the engine's with ENGINE, else cuda where torch sees "
               "a GPU, else cpu).")
DTYPE_HELP = "Default: the engine's dtype with ENGINE, else bfloat16 on cuda and float32 on the CPU."


def target_runtime(device: str | None, dtype: str | None) -> tuple[str, str]:
    """(device, dtype) for --target runs: a GPU where torch sees one, in bf16 there (fp32 would double the weights'
    memory and halve the speed); fp32 on the CPU, the exactness tests' dtype."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, dtype or ("bfloat16" if device == "cuda" else "float32")
