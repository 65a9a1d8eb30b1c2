"""heap.trim gives the C heap's free memory back: the resident set falls after a large allocation is freed."""

import os
import subprocess
import sys

import pytest

from dflash_trt.engine import heap

CHILD = r"""
import ctypes, os
from dflash_trt.engine import heap

def rss_mb():
    for line in open(f"/proc/{os.getpid()}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

# many mid-sized blocks below mmap's threshold land in the heap, freed all but the last: glibc keeps the pages
blocks = [ctypes.create_string_buffer(100_000) for _ in range(2000)]
keep = blocks[-1]
del blocks
before = rss_mb()
heap.trim()
print(before, rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or heap._malloc_trim() is None, reason="glibc's malloc_trim")
def test_trim_returns_freed_heap_memory_to_the_system():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True,
                         env={**os.environ, "MALLOC_TRIM_THRESHOLD_": str(2**40)})  # glibc would trim at free
    before, after = map(float, out.stdout.split())
    assert before - after > 100  # of the ~200 MB freed
