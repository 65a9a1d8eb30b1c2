"""A K/V cache that would not fit the GPU's or the machine's free memory is refused before it is allocated, saying
which rows or length would."""

import pytest
import torch

from dflash_trt.engine import kv_cache
from dflash_trt.engine.kv_cache import KVCache
from dflash_trt.hardware import cpu_available_bytes, cpu_ram_bytes


def test_a_cache_past_the_gpus_free_memory_is_refused_saying_what_fits(monkeypatch):
    # Qwen3-8B's target cache (36 layers, 8 kv heads of 128, bf16: 147,456 bytes a position) for 32 rows x 32k
    # positions: 154.6 GB, where an H100 has about 60 GB free after the weights.
    # 40 GB free on the device, and 20 GB that torch's allocator holds unused (reserved 30, allocated 10): 60 GB
    free = 60e9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(40e9), int(80e9)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: int(30e9))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: int(10e9))
    with pytest.raises(ValueError) as e:
        KVCache(36, 32, 32768, 8, 128, torch.bfloat16, "cuda")
    per_position = 2 * 36 * 8 * 128 * 2
    usable = int(free * 0.9)
    message = str(e.value)
    assert "32 rows x 32,768 positions needs 154.6 GB" in message and "60.0 GB free" in message
    assert f"at most {usable // (per_position * 32768)} rows at this length (--max-batch-size)" in message
    assert f"{usable // (per_position * 32):,} positions a row at 32 rows (--max-model-len)" in message


def test_the_cpu_cache_is_not_checked_against_gpu_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: pytest.fail("read GPU memory for a CPU cache"))
    cache = KVCache(2, 3, 16, 2, 8, torch.float32, "cpu")
    assert cache.nbytes() == 2 * 2 * 3 * 2 * 16 * 8 * 4


def test_a_cpu_cache_past_the_available_memory_is_refused_saying_what_fits(monkeypatch):
    """On a laptop the same cache swapped or was killed by the kernel without a word (or torch's allocator named
    neither rows nor length): 8 GB available, SmolLM2's cache (30 layers, 3 kv heads of 64, bf16) at 64 x 131,072."""
    monkeypatch.setattr(kv_cache, "cpu_available_bytes", lambda: int(8e9))
    with pytest.raises(ValueError) as e:
        KVCache(30, 64, 131072, 3, 64, torch.bfloat16, "cpu")
    per_position = 2 * 30 * 3 * 64 * 2
    usable = int(8e9 * 0.9)
    message = str(e.value)
    assert "64 rows x 131,072 positions needs 193.3 GB" in message and "8.0 GB of memory available" in message
    assert f"at most {usable // (per_position * 131072)} rows at this length (--max-batch-size)" in message
    assert f"{usable // (per_position * 64):,} positions a row at 64 rows (--max-model-len)" in message
    monkeypatch.setattr(kv_cache, "cpu_available_bytes", lambda: None)  # nothing known: as before, allocated
    assert KVCache(2, 3, 16, 2, 8, torch.float32, "cpu").nbytes() == 2 * 2 * 3 * 2 * 16 * 8 * 4


def test_the_available_memory_is_some_of_the_machines():
    assert 0 < cpu_available_bytes() <= cpu_ram_bytes()


def test_a_hybrid_targets_recurrent_states_count_in_what_must_fit(monkeypatch):
    """Qwen3.5-27B-like: 16 attention layers' K/V (4 heads of 256, bf16) for 8 rows x 32k positions is 17.2 GB, and
    each row's recurrent states another 2.4 GB: 36.4 GB with them, past 20 GB free, though the K/V alone fit; 3 rows
    would."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(20e9), int(80e9)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    row = int(2.4e9)
    kv_cache.check_fits((16, 8, 4, 32768, 256), torch.bfloat16, "cuda")  # the K/V alone
    with pytest.raises(ValueError) as e:
        kv_cache.check_fits((16, 8, 4, 32768, 256), torch.bfloat16, "cuda", row_bytes=row)
    per_position = 2 * 16 * 4 * 256 * 2
    message = str(e.value)
    assert "and 2.40 GB a row of recurrent states for 8 rows x 32,768 positions needs 36.4 GB" in message
    assert int(20e9 * 0.9) // (per_position * 32768 + row) == 3 and "at most 3 rows at this length" in message
