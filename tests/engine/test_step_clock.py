"""StepClock: a speculative step's time splits at the end of drafting, read from the host clock on the CPU and from
CUDA events on a GPU (where the host clock reads when the drafter's kernels were queued, not done)."""

import torch

from dflash_trt.engine import step_clock


def _host_clock(monkeypatch, readings):
    readings = iter(readings)
    monkeypatch.setattr(step_clock.time, "perf_counter", lambda: next(readings))


def test_on_the_cpu_drafting_is_the_host_time_until_drafted_and_verifying_the_rest(monkeypatch):
    _host_clock(monkeypatch, [10.0, 10.3, 11.0])
    clock = step_clock.StepClock(torch.device("cpu"))
    clock.drafted()
    draft, verify = clock.split()
    assert abs(draft - 0.3) < 1e-9 and abs(verify - 0.7) < 1e-9


def test_on_a_gpu_drafting_is_the_time_between_events_and_the_step_ends_on_the_host(monkeypatch):
    recorded = []

    class Event:  # the GPU's clock: events complete when the device reaches them
        def __init__(self, enable_timing):
            assert enable_timing
            self.at = None

        def record(self, stream):
            assert stream == ("stream of", torch.device("cuda:1"))  # the model's device, not the current one
            self.at = {0: 0.0, 1: 250.0}[len(recorded)]  # ms: the drafter's kernels ran 0.25 s
            recorded.append(self)

        def synchronize(self):
            assert self.at is not None

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(step_clock.torch.cuda, "Event", Event)
    monkeypatch.setattr(step_clock.torch.cuda, "current_stream", lambda device: ("stream of", device))
    _host_clock(monkeypatch, [5.0, 5.4])  # the host read 'drafted' early (queued work): it must not be used
    clock = step_clock.StepClock(torch.device("cuda:1"))
    clock.drafted()
    draft, verify = clock.split()
    assert len(recorded) == 2
    assert abs(draft - 0.25) < 1e-9 and abs(verify - 0.15) < 1e-9
