"""EngineLoop.spawn: the engine is built on the thread that steps it, and build errors reach the caller."""

import threading

import pytest

from dflash_trt import SamplingParams
from dflash_trt.engine.engine_loop import EngineLoop
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine


def test_spawn_builds_and_steps_on_one_thread_and_serves_requests(tiny_dirs):
    threads = {}

    def build():
        threads["build"] = threading.current_thread()
        return LLMEngine.from_dirs(tiny_dirs["qwen3"], tiny_dirs["qwen3_drafter"], EngineConfig(max_batch_size=2))

    loop = EngineLoop.spawn(build)
    try:
        loop.on_step = lambda result: threads.setdefault("step", threading.current_thread())
        done = threading.Event()
        updates = []

        def callback(update):
            updates.append(update)
            if update.finished:
                done.set()

        loop.submit([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True), callback)
        assert done.wait(30)
        assert updates[-1].output.num_tokens == 6
        assert threads["build"] is threads["step"] is not threading.main_thread()
    finally:
        loop.stop()


def test_spawn_raises_the_build_error_in_the_caller():
    def build():
        raise FileNotFoundError("no/such/target: config.json missing")

    with pytest.raises(FileNotFoundError, match="no/such/target"):
        EngineLoop.spawn(build)
