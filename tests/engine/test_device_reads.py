"""A decoding step reads back from the device once, and copies host data there only through device_copy: on a GPU
every read (`int(t)`, `bool(t)`, `t.tolist()`, `t.cpu()`, ...) and every copy from pageable host memory
(`torch.tensor(x, device=...)`, `t.to(device)`) waits for every kernel queued before it, so the host cannot run ahead
of the GPU.

The torch path the runtime takes on CUDA runs here with the CPU kernels off; the drafter's block attention, a
Triton kernel there that reads nothing back, runs uncounted through its torch reference, and `dflash::verify_block`'s
reference stands in for its Triton launch (both read the batch's sampling facts through target_probs, once)."""

import sys
from contextlib import contextmanager

import pytest
import torch

from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.kernels import cpu_ops
from dflash_trt.models import dflash
from dflash_trt.models.dflash import load_drafter
from dflash_trt.models.registry import load_target
from dflash_trt.sampling_params import SamplingParams

READS = ("__int__", "__index__", "__float__", "__bool__", "item", "tolist", "numpy")


class DeviceReads:
    """Counts reads of tensor values by the host while `counting`; a tensor `.cpu()` returned is the host's copy, and
    reading that counts no further. `copies` counts tensors made from host data or moved by `.to()` outside
    dflash_trt/device_copy.py (a GPU would copy them from pageable memory)."""

    def __init__(self, monkeypatch) -> None:
        self.counting = False
        self.count = self.copies = 0
        self._host: set[int] = set()
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._wrap(getattr(torch.Tensor, name)))
        for owner, name in ((torch, "tensor"), (torch.Tensor, "to")):
            monkeypatch.setattr(owner, name, self._copy(getattr(owner, name)))
        real_cpu = torch.Tensor.cpu

        def cpu(t, *args, **kwargs):
            self._read(t)
            out = real_cpu(t, *args, **kwargs)
            self._host.add(id(out))
            return out

        monkeypatch.setattr(torch.Tensor, "cpu", cpu)
        real_attention = dflash.draft_attention

        def draft_attention(*args, **kwargs):
            with self.paused():
                return real_attention(*args, **kwargs)

        monkeypatch.setattr(dflash, "draft_attention", draft_attention)

    def _wrap(self, method):
        def read(t, *args, **kwargs):
            self._read(t)
            return method(t, *args, **kwargs)
        return read

    def _copy(self, make):
        def copy(*args, **kwargs):
            moves = make is torch.tensor or "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args)
            if self.counting and moves and not sys._getframe(1).f_code.co_filename.endswith("device_copy.py"):
                self.copies += 1
            return make(*args, **kwargs)
        return copy

    def _read(self, t: torch.Tensor) -> None:
        if self.counting and id(t) not in self._host:
            self.count += 1

    @contextmanager
    def paused(self):
        counting, self.counting = self.counting, False
        try:
            yield
        finally:
            self.counting = counting


@pytest.fixture
def reads(monkeypatch) -> DeviceReads:
    monkeypatch.setattr(cpu_ops, "for_tensors", lambda *tensors, **kw: None)
    return DeviceReads(monkeypatch)


def _reads_per_step(tiny_dirs, reads: DeviceReads, rows: int, sampling: dict | None = None,
                    **cfg) -> tuple[list[int], str]:
    """Each step's reads while `rows` requests decode together (after their prompts and a first step), greedy or
    sampled by `sampling` (SamplingParams fields), and the runner's step that ran."""
    config = EngineConfig(max_batch_size=rows, max_draft_len=3, pack_weights=False, screen_head=False, **cfg)
    target = load_target(tiny_dirs["qwen3"], config.torch_dtype)
    drafter = load_drafter(tiny_dirs["qwen3_drafter"], target.config, config.torch_dtype)
    engine = LLMEngine(target, None, drafter, config)
    kinds = []
    for kind in ("decode_step", "spec_step", "tree_step"):
        real = getattr(engine.runner, kind)

        def step(*args, _real=real, _kind=kind, **kwargs):
            kinds.append(_kind)
            return _real(*args, **kwargs)
        setattr(engine.runner, kind, step)
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, **(sampling or {}))
    for _ in range(rows):
        engine.add_request(torch.randint(3, 90, (9,), generator=g).tolist(), params)
    while len(kinds) < 2:  # prompts, a first step (the rotary table grows once)
        engine.step()
    counts = []
    while engine.has_unfinished():
        reads.count, reads.copies, reads.counting = 0, 0, True
        engine.step()
        reads.counting = False
        counts.append(reads.count)
        assert reads.copies == 0
    return counts, kinds[-1]


MATCH = {"temperature": 0.8, "top_p": 0.9, "seed": 1}
REJECTION = {"temperature": 0.8, "top_k": 20, "seed": 1, "acceptance": "rejection"}


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("sampling", [None, MATCH])
def test_a_plain_step_reads_its_tokens_alone(tiny_dirs, reads, rows, sampling):
    counts, kind = _reads_per_step(tiny_dirs, reads, rows, sampling, speculative=False)
    assert kind == "decode_step" and set(counts) == {1}


@pytest.mark.parametrize("rows", [1, 3])
def test_a_chain_step_reads_its_emitted_tokens_alone(tiny_dirs, reads, rows):
    counts, kind = _reads_per_step(tiny_dirs, reads, rows)
    assert kind == "spec_step" and set(counts) == {1}


@pytest.mark.parametrize("sampling", [MATCH, REJECTION])
def test_a_sampled_chain_step_reads_what_the_batch_samples_by_and_its_emitted_tokens(tiny_dirs, reads, sampling):
    counts, kind = _reads_per_step(tiny_dirs, reads, 3, sampling)
    assert kind == "spec_step" and set(counts) == {2}


@pytest.mark.parametrize("sampling", [None, MATCH])
def test_a_tree_step_reads_the_drafters_choices_and_the_targets(tiny_dirs, reads, sampling):
    counts, kind = _reads_per_step(tiny_dirs, reads, 1, sampling, draft_tree={1: 5})
    assert kind == "tree_step" and set(counts) == {2}

