"""Where --target runs go without an engine to say: a GPU where torch sees one (in bf16), else the CPU (in fp32); a
device torch cannot use is refused naming it, before any weight loads."""

import pytest
import torch
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.engine.llm_engine import EngineConfig
from dflash_trt.runtime_device import target_runtime


@pytest.mark.parametrize("cuda, asked, want", [
    (True, (None, None), ("cuda", "bfloat16")),
    (False, (None, None), ("cpu", "float32")),
    (True, ("cpu", None), ("cpu", "float32")),
    (True, (None, "float32"), ("cuda", "float32")),
    (False, ("cuda", "float16"), ("cuda", "float16")),  # asked for: EngineConfig then says why not
])
def test_target_runs_take_a_gpu_where_torch_sees_one(monkeypatch, cuda, asked, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert target_runtime(*asked) == want


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_naming_the_device(tiny_dirs):
    with pytest.raises(ValueError, match="device='cuda'.*no CUDA device"):
        EngineConfig(device="cuda")
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "-p", "x",
                                  "--device", "cuda"])
    assert r.exit_code == 1 and "no CUDA device" in r.output and "--device cpu" in r.output


@pytest.mark.parametrize("device", ["tpu", "mps", "cuda:x"])
def test_devices_the_runtime_does_not_run_on_are_refused(device):
    with pytest.raises(ValueError, match=f"device='{device}'"):
        EngineConfig(device=device)


def test_a_cuda_device_past_the_machines_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="device='cuda:7', but this machine has 1 CUDA device"):
        EngineConfig(device="cuda:7")
