"""Where --target runs go without an engine to say: a GPU where torch sees one (in bf16), else the CPU (in fp32); a
device torch cannot use is refused naming it, before any weight loads. --threads sizes the OpenMP team of the thread
that steps the engine, in generate, serve and a Triton model."""

import ctypes
import os
import threading

import pytest
import torch
from click.testing import CliRunner

from dflash_trt.cli import main
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.runtime_device import target_runtime
from dflash_trt.server import cli as server_cli
from dflash_trt.server.triton import ModelSettings
from tests.server.conftest import free_port


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


def omp_team() -> int:
    """The team size a parallel region opened on the calling thread gets: the C kernels' `#pragma omp parallel`
    asks libgomp (the one torch loaded, which shares its soname) for nothing else."""
    return ctypes.CDLL("libgomp.so.1").omp_get_max_threads()


@pytest.fixture
def one_core_machine():
    """A team of two before --threads 1 asks for one (the suite's workers may each run one thread already); threads
    are a process setting: the test's are given back."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


ONE_CORE = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a machine where one thread is the default")


@ONE_CORE
def test_generate_threads_size_the_team_its_steps_run_on(tiny_dirs, one_core_machine):
    r = CliRunner().invoke(main, ["generate", "--target", str(tiny_dirs["qwen3"]), "--no-spec", "-p", "x",
                                  "--max-new-tokens", "2", "--threads", "1"])
    assert r.exit_code == 0, r.output
    assert omp_team() == 1


@ONE_CORE
def test_serve_threads_size_the_team_of_the_engines_own_thread(monkeypatch, one_core_machine):
    seen = {}

    def load_engine(*args, **overrides):
        seen["team"], seen["thread"] = omp_team(), threading.current_thread()
        raise ValueError("stop before serving")

    monkeypatch.setattr(server_cli, "load_engine", load_engine)
    r = CliRunner().invoke(server_cli.serve, ["--threads", "1", "--port", str(free_port())])
    assert r.exit_code == 1 and "stop before serving" in r.output
    assert seen["thread"] is not threading.main_thread() and seen["team"] == 1


@ONE_CORE
def test_a_triton_models_threads_reach_the_thread_that_opens_its_engine(monkeypatch, tmp_path, one_core_machine):
    settings = ModelSettings.from_parameters(ModelSettings(target_dir=str(tmp_path), speculative=False,
                                                           threads=1).to_parameters())
    seen = []
    monkeypatch.setattr(LLMEngine, "from_dirs", lambda *a: seen.append(omp_team()))
    opened = threading.Thread(target=settings.open_engine)  # as EngineLoop.spawn opens it
    opened.start()
    opened.join()
    assert seen == [1]


def test_more_threads_than_cores_is_warned_of(monkeypatch, caplog, one_core_machine):
    from dflash_trt.runtime_device import use_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    with caplog.at_level("WARNING", logger="dflash_trt.runtime_device"):
        use_threads(2)
        assert not caplog.records
        use_threads(8)
    assert "8 threads on 2 cores" in caplog.text and "give at most 2" in caplog.text
