"""hardware: this CPU's flags, and where bf16 matrix products run natively (the trainer's precision follows it)."""

import json
import re
from pathlib import Path

import pytest
import torch

from dflash_trt import hardware

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flags, native", [({"avx2", "fma"}, False), ({"avx512f", "avx512bw"}, False),
                                           ({"avx512f", "avx512_bf16"}, True), ({"amx_tile", "amx_bf16"}, True)])
def test_bf16_is_native_on_cpus_with_bf16_dot_products(monkeypatch, flags, native):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    assert hardware.native_bf16("cpu") is native


@pytest.mark.parametrize("supported", [True, False])  # an Ampere or later GPU; a Turing one (a T4) emulates bf16
def test_bf16_is_native_on_gpus_that_multiply_it(monkeypatch, supported):
    seen = {}

    def is_bf16_supported(including_emulation=True):
        seen["including_emulation"] = including_emulation
        return supported

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    assert hardware.native_bf16("cuda") is supported
    assert seen == {"including_emulation": False}


def test_cpu_flags_are_the_cpuinfo_flags_line(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\nbugs\t\t: spectre_v1\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path, *a, **k))
    assert hardware.cpu_flags() == {"fpu", "sse2", "avx2", "fma"}


@pytest.mark.parametrize("flags, fit", [({"avx2", "fma"}, "avx2"), ({"avx512f", "avx512_bf16"}, "avx512_bf16"),
                                        ({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, "amx")])
def test_the_cpu_profile_takes_the_fit_of_cpus_like_this_one(monkeypatch, flags, fit):
    """Verify rows cost the least with AMX tiles, the most with AVX2: each CPU gets the fit measured on one of its
    kind (an AVX-512 BF16 EPYC took the AVX2 fit)."""
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    cpu, want = hardware.profile("cpu"), hardware.CPU_FITS[fit]
    assert (cpu.dense_flops, cpu.step_overhead_s, cpu.draft_overhead_s) == (want.dense_flops, want.step_overhead_s,
                                                                           want.draft_overhead_s)
    assert cpu.perf_source == want.source


@pytest.mark.parametrize("fit", ["amx", "avx512_bf16", "avx2"])
def test_each_cpu_fit_is_the_one_its_calibration_record_holds(fit):
    want = hardware.CPU_FITS[fit]
    record = json.loads((ROOT / re.search(r"benchmarks/results/\S+\.json", want.source).group()).read_text())
    assert record["valid"]
    got = record["fitted_profile"]
    for key in ("mem_bandwidth_bytes_s", "dense_flops", "step_overhead_s", "draft_overhead_s"):
        assert getattr(want, key) == pytest.approx(got[key], rel=0.01), key
    assert f"{100 * record['mean_abs_relative_error']:.1f}% mean error" in want.source


@pytest.mark.parametrize("files, left", [
    ({"memory.max": "8000000000\n", "memory.current": "3000000000\n"}, 5_000_000_000),  # v2, a container's limit
    ({"memory.max": "max\n", "memory.current": "3000000000\n"}, None),  # v2 without a limit
    ({"memory/memory.limit_in_bytes": "4000000000\n", "memory/memory.usage_in_bytes": "1000000000\n"}, 3_000_000_000),
    ({"memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": "1\n"}, None),  # v1's
    ({}, None),
    # the page cache the kernel reclaims at the limit is not in use: a container that had read 2.5 GB of model files
    # had 0.5 GB left by memory.current alone
    ({"memory.max": "8000000000\n", "memory.current": "7500000000\n",
      "memory.stat": "anon 5000000000\nfile 2500000000\nactive_file 500000000\ninactive_file 2000000000\n"},
     2_500_000_000),
    ({"memory/memory.limit_in_bytes": "4000000000\n", "memory/memory.usage_in_bytes": "3900000000\n",
      "memory/memory.stat": "cache 3000000000\ninactive_file 9\ntotal_inactive_file 2000000000\n"}, 2_100_000_000),
    ({"memory.max": "8000000000\n", "memory.current": "3000000000\n", "memory.stat": "inactive_file x\n"},
     5_000_000_000),  # an unreadable counter counts nothing
])
def test_a_containers_memory_limit_bounds_what_is_available(tmp_path, files, left):
    """MemAvailable counts the whole machine's memory: in a container of 8 GB on a 64 GB host, a cache it allowed was
    killed by the kernel."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert hardware.cgroup_memory_left(str(tmp_path)) == left
