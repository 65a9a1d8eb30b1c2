"""Where the torch runtime runs, and in which dtype, when no engine directory says (--target runs)."""

from __future__ import annotations

import logging

DEVICE_HELP = ("Where the torch runtime runs: cpu or cuda (default: the engine's with ENGINE, else cuda where torch sees "
               "a GPU, else cpu).")
DTYPE_HELP = "Default: the engine's dtype with ENGINE, else bfloat16 on cuda and float32 on the CPU."


def target_runtime(device: str | None, dtype: str | None) -> tuple[str, str]:
    """(device, dtype) for --target runs: a GPU where torch sees one, in bf16 there (fp32 would double the weights'
    memory and halve the speed); fp32 on the CPU, the exactness tests' dtype."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, dtype or ("bfloat16" if device == "cuda" else "float32")


THREADS_HELP = ("CPU threads of the runtime (default: torch's, one per core). On a machine busy with other work, give "
                "no more than the cores it leaves free: each layer's threads wait for the slowest, and one the OS "
                "has set aside stalls them all.")


def use_threads(threads: int | None) -> None:
    """Size the OpenMP team of the calling thread (torch's ops and the C kernels share one OpenMP runtime). OpenMP
    keeps this setting per thread: call it on the thread that steps the engine."""
    if threads:
        import os

        import torch

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if cores and threads > cores:  # measured: 64 threads on 2 cores decoded 8x slower
            logging.getLogger(__name__).warning(
                "%d threads on %d cores: every layer waits for threads the cores take turns to run; give at most %d",
                threads, cores, cores)
        torch.set_num_threads(threads)
