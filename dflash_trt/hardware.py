"""Hardware profiles the planner checks a build against: memory per device and device count, and the
figures the roofline performance model (perf_model.py) needs.

GPU capacities are NVIDIA's published HBM sizes in decimal gigabytes (B300 288 GB, H200 141 GB),
which is at or below what the driver reports, so a plan that fits here fits on the device. The CPU
profile reads this machine's RAM when the plan is made.

Performance figures. GPU bandwidth, FLOP/s and NVLink are published peaks (an achieved fraction is
lower, so GPU predictions are optimistic bounds); the fixed costs are estimates, labelled as such:
- B300: HBM3e 8 TB/s, BF16 dense 2.25 PFLOP/s (4.5 with sparsity), NVLink 5 1.8 TB/s per GPU total =
  0.9 TB/s per direction (glennklockwood.com/garden/processors/B300, HGX B300 figures; yobitel.com
  knowledge-base/nvidia-b300 gives the same 8 TB/s and 1.8 TB/s).
- H200: HBM3e 4.8 TB/s, BF16 dense 989 TFLOP/s (NVIDIA's 1,979 is "with sparsity"), NVLink 4 900 GB/s
  total = 450 GB/s per direction (NVIDIA H200 datasheet; saulelectric.com/nvidia-h200.html lists
  450 GB/s unidirectional).
- The CPU's figures are effective values of this runtime, not peaks: fitted to measured step times by
  benchmarks/calibrate_perf_model.py, one fit for CPUs with AMX tiles (an Intel Xeon; record
  benchmarks/results/perf_model_cpu.json) and one for CPUs without (an AMD EPYC with AVX2;
  perf_model_cpu_avx2.json), where a verify step's rows cost their dot products; `profile("cpu")` takes the one
  this CPU's flags call for.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

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
    # DFlash's TRTLLM drafter attention backend needs SM100/SM103 (TRT-LLM dflash_attention.py); others use VANILLA.
    supports_trtllm_dflash_attention: bool = False
    description: str = ""
    # Roofline figures (per device; see the module docstring for sources).
    mem_bandwidth_bytes_s: float = 0.0  # memory bandwidth
    dense_flops: float = 0.0  # bf16 dense matrix FLOP/s
    interconnect_bytes_s: float = 0.0  # per direction, per device (NVLink); 0: a single device
    interconnect_latency_s: float = 0.0  # fixed cost of one collective (launch + synchronisation)
    step_overhead_s: float = 0.0  # fixed cost of one engine step (scheduling, sampling, launches)
    layer_overhead_s: float = 0.0  # fixed cost of one decoder layer's forward (kernel floors, dispatch)
    draft_overhead_s: float = 0.0  # fixed cost a speculative step adds besides the drafter's layers (acceptance, bookkeeping)
    perf_source: str = ""  # where the figures above come from
    # FP4 tensor cores (Blackwell): TensorRT-LLM's NVFP4 KV cache (kv_cache_config.dtype nvfp4) needs them
    supports_nvfp4: bool = False
    # TensorRT-LLM's TRTLLM MoE backend (trtllm-gen kernels) runs on SM100/SM103 only: Hopper takes TRITON, as the
    # gpt-oss deployment guide has it (../shared/reference/trtllm.md, MoE backends)
    supports_trtllm_moe: bool = False

    @property
    def device(self) -> str:
        return "cuda" if self.kind == "gpu" else "cpu"

    def to_dict(self) -> dict:
        return asdict(self)


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def native_bf16(device_type: str) -> bool:
    """Whether bf16 matrix products run natively: a GPU from Ampere on, or a CPU with AMX or AVX512-BF16 (elsewhere
    they are emulated, slower than fp32: a drafter training step 19.7 s against 1.8 s on an AVX2 EPYC, README: Train a
    drafter)."""
    if device_type == "cuda":
        import torch

        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    return device_type == "cpu" and bool({"amx_bf16", "avx512_bf16"} & cpu_flags())


def cpu_ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_available_bytes() -> int | None:
    """Memory a new allocation can take without swapping or being killed: Linux's MemAvailable (free pages and the
    page cache it can reclaim), else the free pages, and no more than a container's memory limit leaves (cgroup v2 or
    v1: MemAvailable counts the whole machine's); None where nothing is known."""
    available = None
    try:
        with open("/proc/meminfo") as f:
            available = next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError):  # macOS has no SC_AVPHYS_PAGES
            pass
    left = cgroup_memory_left()
    return left if available is None else available if left is None else min(available, left)


def cgroup_memory_left(root: str = "/sys/fs/cgroup") -> int | None:
    """What this process's memory cgroup still allows (its limit less its use), or None without a limit. The use
    leaves out the inactive page cache, as `docker stats` does: the kernel reclaims it at the limit, and a container
    that had read its model files counted them as used."""
    for limit_file, usage_file, stat_file, inactive in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),  # v2
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
             "total_inactive_file")):  # v1
        try:
            limit = Path(root, limit_file).read_text().strip()
            usage = int(Path(root, usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 1 << 60:  # "max" (v2) or a huge number (v1): no limit
            return max(0, int(limit) - usage + min(usage, _cgroup_stat(Path(root, stat_file), inactive)))
    return None


def _cgroup_stat(path: Path, key: str) -> int:
    """One counter of a cgroup's memory.stat, 0 where it cannot be read."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


# GPU fixed costs (estimates, to be replaced by a measurement on the device): one NCCL/TRT-LLM all-reduce
# of a small message over NVLink costs a few microseconds; a CUDA-graph replay of a decoder layer is bounded
# below by its dozen or so kernels at a few microseconds each; the step cost is TRT-LLM's per-iteration
# sampling and bookkeeping that the overlap scheduler does not hide. Together they put gpt-oss-120b at TP8
# on a B300, batch 1, near 3 ms per autoregressive step (about 330 tok/s/user), consistent with NVIDIA's
# report that DFlash at 500-600 tok/s/user more than doubles batch-1 interactivity (NVIDIA DFlash blog, 2026-06-23).
GPU_ALLREDUCE_LATENCY_S = 5e-6
GPU_LAYER_OVERHEAD_S = 60e-6
GPU_STEP_OVERHEAD_S = 300e-6
GPU_PERF_SOURCE = "published peaks (hardware.py docstring); fixed costs are estimates (GPU_* constants)"


@dataclass(frozen=True)
class CpuFit:
    """Effective figures of this runtime on one kind of CPU, fitted by benchmarks/calibrate_perf_model.py."""

    mem_bandwidth_bytes_s: float
    dense_flops: float
    step_overhead_s: float
    draft_overhead_s: float
    source: str
    # One target model only: a per-layer cost cannot be told apart from the per-step cost, so it is folded in.
    layer_overhead_s: float = 0.0


# 15 measured engine steps each (SmolLM2-135M bf16, 2 threads, batch 1-16, K 0/3/7) with the CPU kernels of
# kernels/cpu_ops.c. Not peaks: weight bytes do not change with the batch, so bandwidth and fixed cost are not
# separately identifiable (the AMX fit's bandwidth is its grid's edge); each puts the weight read into the step cost,
# the batch-dependent work at the fitted FLOP/s, and a drafter forward's fixed cost into the draft overhead (the
# calibration's random drafter drafts among the shipped 2,048-token draft vocabulary, as the runtime does). These
# machines' speed drifts with their hosts by up to ~25%.
# - AMX (2026-12-02 00:13 UTC, an Intel Xeon: AMX linears, every layer in one call, the drafter's step in one call
#   with int8 projections, greedy tokens through the head's int8 screen; mean |error| 4.0%, max 10.4%): 9.7 ms a
#   step, ~630 GFLOP/s, 0.45 ms a draft. The fit of 2026-12-01 19:55 UTC, before the screen and the int8 drafter:
#   10.9 ms, 580 GFLOP/s, 0.65 ms.
# - No AMX (2026-12-04 22:37 UTC, an AMD EPYC with AVX2 and FMA: the kernel's AVX2 panels, the head's int8 screen
#   on VPMADDWD, bf16 drafter tables; mean |error| 2.4%, max 5.4%): 3.5 ms a step, ~166 GFLOP/s, 1.0 ms a draft. Past
#   one row K=3 costs 2.3x a plain step at 2 rows and 3.2x at 4 (19.1 / 31.2 ms against 8.3 / 9.8).
# - AVX-512 BF16 without AMX (2026-12-06 17:42 UTC, an AMD EPYC: the kernel's VDPBF16PS dot products; mean |error|
#   3.0%, max 8.2%): 5.4 ms a step, ~305 GFLOP/s, 2.1 ms a draft. K=3 costs 1.6x a plain step at 2 rows and 2.3x at 4
#   (14.9 / 22.8 ms against 9.6 / 10.1); it had taken the AVX2 fit.
#   A repeat on the same quiet machine fitted 52 GB/s, 327 GFLOP/s, 4.0 ms and 1.2 ms (4.4% mean error): bandwidth
#   and fixed cost trade against each other, as above.
CPU_FITS = {
    "amx": CpuFit(3.16e11, 6.31e11, 9.68e-3, 4.5e-4, "fitted on an Intel Xeon with AMX: "
                  "benchmarks/results/perf_model_cpu.json (calibrate_perf_model.py, 2026-12-02, 4.0% mean error)"),
    "avx512_bf16": CpuFit(6.76e10, 3.05e11, 5.44e-3, 2.08e-3, "fitted on an AMD EPYC with AVX-512 BF16 (no AMX): "
                          "benchmarks/results/perf_model_cpu_avx512bf16.json (calibrate_perf_model.py, 2026-12-06, "
                          "3.0% mean error)"),
    "avx2": CpuFit(5.75e10, 1.66e11, 3.46e-3, 1.00e-3, "fitted on an AMD EPYC with AVX2 (no AMX): "
                   "benchmarks/results/perf_model_cpu_avx2.json (calibrate_perf_model.py, 2026-12-04, 2.4% mean "
                   "error)"),
}


def has_amx_tiles() -> bool:
    """Whether this CPU has AMX tiles, by its flags. Plans go by this; the runtime by the layout its kernels chose
    (layers/linear.py kernel_layout), which differs where DFLASH_TRT_AMX=0 or the target is not bf16."""
    return "amx_tile" in cpu_flags()


def cpu_fit() -> CpuFit:
    """The fitted figures for this CPU, by the instructions its bf16 kernel multiplies with (a verify step's rows
    cost the least with AMX tiles, the most with AVX2's FMAs)."""
    if has_amx_tiles():
        return CPU_FITS["amx"]
    return CPU_FITS["avx512_bf16" if "avx512_bf16" in cpu_flags() else "avx2"]


def profile(name: str) -> HardwareProfile:
    """The profile called `name` (b300, h200, cpu); ValueError naming the choices otherwise."""
    gpu = dict(kind="gpu", max_devices=8, reserve_bytes=3 * GiB, interconnect_latency_s=GPU_ALLREDUCE_LATENCY_S,
               step_overhead_s=GPU_STEP_OVERHEAD_S, layer_overhead_s=GPU_LAYER_OVERHEAD_S, perf_source=GPU_PERF_SOURCE)
    if name == "b300":
        return HardwareProfile("b300", memory_bytes=288 * GB, supports_trtllm_dflash_attention=True,
                               description="NVIDIA B300 (DGX B300: 8 per node)", mem_bandwidth_bytes_s=8e12,
                               dense_flops=2.25e15, interconnect_bytes_s=0.9e12, supports_nvfp4=True,
                               supports_trtllm_moe=True, **gpu)
    if name == "h200":
        return HardwareProfile("h200", memory_bytes=141 * GB, supports_trtllm_dflash_attention=False,
                               description="NVIDIA H200 (HGX H200: 8 per node)", mem_bandwidth_bytes_s=4.8e12,
                               dense_flops=989e12, interconnect_bytes_s=450e9, **gpu)
    if name == "cpu":
        return cpu_profile(cpu_fit())
    raise ValueError(f"hardware={name!r} is not a known profile; choose one of {PROFILE_NAMES}")


def cpu_profile(fit: CpuFit) -> HardwareProfile:
    """This machine's CPU and RAM, its steps priced by `fit` (cpu_fit(): the fit of this CPU's kind)."""
    return HardwareProfile("cpu", "cpu", cpu_ram_bytes(), 1, 2 * GiB, False, "the building machine's CPU and RAM",
                           mem_bandwidth_bytes_s=fit.mem_bandwidth_bytes_s, dense_flops=fit.dense_flops,
                           step_overhead_s=fit.step_overhead_s, layer_overhead_s=fit.layer_overhead_s,
                           draft_overhead_s=fit.draft_overhead_s, perf_source=fit.source)


PROFILE_NAMES = ("b300", "h200", "cpu")
