"""EngineLoop.spawn: the engine is built on the thread that steps it, and build errors reach the caller."""

import threading
import time

import pytest

from dflash_trt import SamplingParams
from dflash_trt.engine.engine_loop import EngineLoop
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine
from dflash_trt.engine.scheduler import QueueFullError
from tests.forward_widths import record_forward_widths


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


def _collector(expected: int):
    """-> (finals {request_id: final RequestUpdate}, an Event set once `expected` are answered, the callback)."""
    finals, done = {}, threading.Event()

    def callback(update):
        if update.finished:
            finals[update.request_id] = update
            if len(finals) == expected:
                done.set()

    return finals, done, callback


def _finals(loop, prompts, params, timeout=30.0):
    """Submit prompts; -> {request_id: final RequestUpdate} once all are answered (or the timeout passes)."""
    finals, done = {}, threading.Event()
    ids = []

    def callback(update):
        if update.finished:
            finals[update.request_id] = update
            if len(finals) == len(ids):
                done.set()

    ids.extend(loop.submit(p, params, callback) for p in prompts)
    done.wait(timeout)
    return ids, finals


def test_a_prompt_with_an_out_of_range_token_id_is_refused_and_never_fails_the_others(tiny_dirs):
    from tests.engine.test_lossless import _engine, _prompts, hf_greedy

    engine = _engine(tiny_dirs, "qwen3", 3, rows=2)
    loop = EngineLoop(engine)  # started below: the bad prompt would otherwise share the good one's first step
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompt = _prompts(1)[0]
    finals, done, callback = _collector(1)
    good = loop.submit(prompt, params, callback)
    vocab = engine.target.config.vocab_size
    for bad in ([5, vocab, 6], [-1, 5]):
        with pytest.raises(ValueError, match="token ids"):
            loop.submit(bad, params, lambda u: None)
    with loop:
        assert done.wait(30)
    assert finals[good].error is None
    assert list(finals[good].token_ids) == hf_greedy(tiny_dirs["qwen3"], prompt, new=12)


def test_requests_submitted_together_to_a_waiting_loop_share_one_prefill(tiny_dirs, monkeypatch):
    """A request's n answers are queued in one go, so the loop, woken by the first, cannot take it alone into a step:
    their prompt is prefilled once (one forward of its 16-token chunk), and each answers as the target does."""
    from tests.engine.test_lossless import _engine, _prompts, hf_greedy

    engine = _engine(tiny_dirs, "qwen3", 3, rows=4)
    prompt, params = _prompts(2)[1][:16], SamplingParams(max_new_tokens=12, ignore_eos=True)
    widths = record_forward_widths(engine.target, monkeypatch)
    finals, done, callback = _collector(4)
    with EngineLoop(engine) as loop:
        time.sleep(0.05)  # waiting for work
        ids = loop.submit_all([(prompt, params, callback)] * 4)
        assert done.wait(30)
    assert widths.count(16) == 1
    assert all(list(finals[i].token_ids) == hf_greedy(tiny_dirs["qwen3"], prompt, new=12) for i in ids)


def test_requests_submitted_together_are_queued_all_or_none(tiny_dirs):
    from tests.engine.test_lossless import _engine

    engine = _engine(tiny_dirs, "qwen3", 3, rows=2, max_queue_len=1)
    loop = EngineLoop(engine)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    with pytest.raises(QueueFullError, match="4 more do not fit"):
        loop.submit_all([([5, 6, 7], params, lambda u: None)] * 4)  # 2 rows and 1 queue place
    with pytest.raises(ValueError, match="token ids"):
        loop.submit_all([([5, 6, 7], params, lambda u: None), ([-1], params, lambda u: None)])
    assert engine.scheduler.num_waiting == 0 and not loop._callbacks
    finals, done, callback = _collector(3)
    ids = loop.submit_all([([5, 6, 7], params, callback)] * 3)
    with loop:
        assert done.wait(30)
    assert sorted(finals) == sorted(ids)


def test_a_request_aborted_before_a_failing_step_is_still_answered_and_the_loop_serves_on(tiny_dirs):
    from tests.engine.test_lossless import _engine, _prompts, hf_greedy

    engine = _engine(tiny_dirs, "qwen3", 3, rows=2)
    real, failures = engine.runner.prefill, [RuntimeError("injected")]

    def prefill(*args):
        if failures:
            raise failures.pop()
        return real(*args)

    engine.runner.prefill = prefill
    loop = EngineLoop(engine)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    prompts = _prompts(3)
    finals, done, callback = _collector(2)
    kept = loop.submit(prompts[0], params, callback)
    aborted = loop.submit(prompts[1], params, callback)
    assert loop.abort(aborted)  # queued: the first step, which fails, takes it
    with loop:
        assert done.wait(30), f"answered: {sorted(finals)}"
        assert finals[kept].error is not None
        assert finals[aborted].error is None and finals[aborted].output.finish_reason == "abort"
        ids, later = _finals(loop, [prompts[2]], params)
        assert list(later[ids[0]].token_ids) == hf_greedy(tiny_dirs["qwen3"], prompts[2], new=10)
    assert engine.scheduler.slots.num_free == 2


def test_a_request_a_failing_step_finished_before_it_failed_is_answered_with_its_output(tiny_dirs):
    """Its one token came from the step's first prompt chunk, the second chunk's forward raised: it is answered as
    finished, the other request with the error, and the loop serves on."""
    from tests.engine.test_lossless import _engine, _prompts, hf_greedy

    engine = _engine(tiny_dirs, "qwen3", 3, rows=2)
    real, calls = engine.runner.prefill, []

    def prefill(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(*args)

    engine.runner.prefill = prefill
    loop = EngineLoop(engine)
    prompts = _prompts(3)
    finals, done, callback = _collector(2)
    one = loop.submit(prompts[0], SamplingParams(max_new_tokens=1, ignore_eos=True), callback)
    failed = loop.submit(prompts[1], SamplingParams(max_new_tokens=10, ignore_eos=True), callback)
    with loop:
        assert done.wait(30), f"answered: {sorted(finals)}"
        assert finals[failed].error is not None
        assert finals[one].error is None and finals[one].output.finish_reason == "length"
        assert list(finals[one].output.token_ids) == hf_greedy(tiny_dirs["qwen3"], prompts[0], new=1)
        params = SamplingParams(max_new_tokens=10, ignore_eos=True)
        ids, later = _finals(loop, [prompts[2]], params)
        assert list(later[ids[0]].token_ids) == hf_greedy(tiny_dirs["qwen3"], prompts[2], new=10)
    assert engine.scheduler.slots.num_free == 2


def test_a_running_request_whose_abort_was_pending_when_its_step_failed_is_answered_as_aborted(tiny_dirs):
    """Its caller asked to abort it and is gone: it is answered and counted "abort", not "error" (the failure is the
    other request's to report)."""
    from tests.engine.test_lossless import _engine, _prompts

    engine = _engine(tiny_dirs, "qwen3", 3, rows=2)
    real, calls, counted = engine.runner.prefill, [], []
    finals, done, callback = _collector(2)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)

    def prefill(*args):
        calls.append(1)
        if len(calls) == 2:  # both hold rows now: the first one's abort waits for the next step
            assert loop.abort(aborted)
            raise RuntimeError("injected")
        return real(*args)

    engine.runner.prefill = prefill
    loop = EngineLoop(engine, on_finish=counted.append)
    prompts = _prompts(2)
    aborted = loop.submit(prompts[0], params, callback)
    failed = loop.submit(prompts[1], params, callback)
    with loop:
        assert done.wait(30), f"answered: {sorted(finals)}"
    assert finals[aborted].error is None and finals[aborted].output.finish_reason == "abort"
    assert "injected" in finals[failed].error
    assert sorted(o.finish_reason for o in counted) == ["abort", "error"]
    assert engine.scheduler.slots.num_free == 2


def test_a_request_a_failing_step_finished_as_the_loop_stops_is_answered_and_counted(tiny_dirs):
    """Answered at the stop with its output, and passed to on_finish (the metrics) as a step's answers are."""
    from tests.engine.test_lossless import _engine, _prompts

    engine = _engine(tiny_dirs, "qwen3", 3, rows=2)
    real, calls, counted = engine.runner.prefill, [], []

    def prefill(*args):
        calls.append(1)
        if len(calls) == 2:
            loop._stop.set()  # a stop that comes while the step runs
            raise RuntimeError("injected")
        return real(*args)

    engine.runner.prefill = prefill
    loop = EngineLoop(engine, on_finish=counted.append)
    prompts = _prompts(2)
    finals, done, callback = _collector(2)
    one = loop.submit(prompts[0], SamplingParams(max_new_tokens=1, ignore_eos=True), callback)
    loop.submit(prompts[1], SamplingParams(max_new_tokens=10, ignore_eos=True), callback)
    loop.start()
    assert done.wait(30), f"answered: {sorted(finals)}"
    assert finals[one].error is None and finals[one].output.finish_reason == "length"
    assert sorted(o.finish_reason for o in counted) == ["error", "length"]


def test_an_output_that_fails_to_build_fails_its_request_only(tiny_dirs):
    """make_output detokenizes (a slow tokenizer raises on an id past its vocabulary, which a padded embedding can
    sample): that request is answered with an error, the loop thread lives on and the others finish."""
    from tests.engine.test_lossless import _engine, _prompts, hf_greedy

    engine = _engine(tiny_dirs, "qwen3", 3, rows=2)
    loop = EngineLoop(engine)
    real, broken = engine.make_output, set()

    def make_output(seq):
        if seq.request_id in broken:
            raise IndexError("piece id is out of range")
        return real(seq)

    engine.make_output = make_output
    prompts = _prompts(2)
    finals, done, callback = _collector(2)
    short = loop.submit(prompts[0], SamplingParams(max_new_tokens=3, ignore_eos=True), callback)
    long = loop.submit(prompts[1], SamplingParams(max_new_tokens=20, ignore_eos=True), callback)
    broken.add(short)
    with loop:
        assert done.wait(30), f"answered: {sorted(finals)}"
        assert "out of range" in finals[short].error
        assert finals[long].error is None
        assert list(finals[long].token_ids) == hf_greedy(tiny_dirs["qwen3"], prompts[1], new=20)
        assert loop.is_alive


def test_an_output_that_fails_to_build_after_a_failed_step_fails_its_request_only(tiny_dirs):
    """The failed step's handler built each failed request's output unguarded: a second exception there ended the
    loop thread, and every request after it waited for ever."""
    from tests.engine.test_lossless import _engine, _prompts, hf_greedy

    engine = _engine(tiny_dirs, "qwen3", 3, rows=2)
    real_prefill, real_output, failures = engine.runner.prefill, engine.make_output, [RuntimeError("injected")]

    def prefill(*args):
        if failures:
            raise failures.pop()
        return real_prefill(*args)

    def make_output(seq):
        if seq.request_id == broken:
            raise IndexError("piece id is out of range")
        return real_output(seq)

    engine.runner.prefill, engine.make_output = prefill, make_output
    loop = EngineLoop(engine)
    prompts = _prompts(2)
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    finals, done, callback = _collector(1)
    broken = loop.submit(prompts[0], params, callback)
    with loop:
        assert done.wait(30) and "engine error: injected" in finals[broken].error
        ids, later = _finals(loop, [prompts[1]], params)
        assert list(later[ids[0]].token_ids) == hf_greedy(tiny_dirs["qwen3"], prompts[1], new=10)
        assert loop.is_alive


def test_a_loop_that_ends_on_its_own_bug_answers_what_it_took_and_refuses_more(tiny_dirs):
    """A loop thread that died kept taking requests (only stop() was checked), which then waited for ever."""
    from dflash_trt.engine.engine_loop import LoopStopped
    from tests.engine.test_lossless import _engine, _prompts

    engine = _engine(tiny_dirs, "qwen3", 3, rows=2)
    engine.has_unfinished = lambda: 1 / 0  # a bug outside any step
    loop = EngineLoop(engine)
    finals, done, callback = _collector(1)
    taken = loop.submit(_prompts(1)[0], SamplingParams(max_new_tokens=4, ignore_eos=True), callback)
    loop.start()
    assert done.wait(30) and finals[taken].error == "the engine loop failed: ZeroDivisionError: division by zero"
    loop._thread.join(10)
    assert not loop.is_alive
    with pytest.raises(LoopStopped, match="the engine loop failed: ZeroDivisionError: division by zero"):
        loop.submit(_prompts(1)[0], SamplingParams(max_new_tokens=4), callback)


def test_a_request_aborted_during_the_last_step_before_shutdown_is_answered(tiny_dirs):
    from tests.engine.test_lossless import _engine, _prompts

    engine = _engine(tiny_dirs, "qwen3", 3, rows=1)
    real, entered, release = engine.runner.prefill, threading.Event(), threading.Event()

    def prefill(*args):
        entered.set()
        release.wait(30)
        return real(*args)

    engine.runner.prefill = prefill
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    finals, lock = {}, threading.Lock()

    def callback(update):
        if update.finished:
            with lock:
                finals[update.request_id] = update

    loop = EngineLoop(engine).start()
    running = loop.submit(_prompts(1)[0], params, callback)
    assert entered.wait(30)
    queued = loop.submit([5, 6, 7], params, callback)  # one row: it waits
    assert loop.abort(queued)
    stopper = threading.Thread(target=loop.stop)
    stopper.start()
    assert loop._stop.wait(30)  # stop() set it; the step it waits for is still blocked
    release.set()
    stopper.join(30)
    assert not loop.is_alive
    assert sorted(finals) == sorted([running, queued])
    assert finals[queued].output.finish_reason == "abort"
    assert engine.scheduler.slots.num_used == 0


def test_a_stopped_loop_refuses_requests_and_answers_every_one_it_took(tiny_dirs):
    from dflash_trt.engine.engine_loop import LoopStopped

    def build():
        return LLMEngine.from_dirs(tiny_dirs["qwen3"], None, EngineConfig(max_batch_size=1, speculative=False))

    loop = EngineLoop.spawn(build)
    finals = []
    ids = [loop.submit([5, 6, 7], SamplingParams(max_new_tokens=200, ignore_eos=True),
                       lambda u: u.finished and finals.append(u)) for _ in range(3)]  # one row: two wait
    loop.stop()
    with pytest.raises(LoopStopped, match="stopped"):
        loop.submit([5, 6, 7], SamplingParams(max_new_tokens=2), lambda u: None)
    assert sorted(u.request_id for u in finals) == sorted(ids)


def test_the_loop_calls_on_idle_once_each_time_it_runs_out_of_work(tiny_dirs):
    loop = EngineLoop.spawn(lambda: LLMEngine.from_dirs(tiny_dirs["qwen3"], None, EngineConfig(max_batch_size=2,
                                                                                                speculative=False)))
    idle, done = [], threading.Event()
    loop.on_idle = lambda: (idle.append(threading.current_thread()), done.set())
    try:
        for _ in range(2):
            done.clear()
            finished = threading.Event()
            loop.submit([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True),
                        lambda u: u.finished and finished.set())
            assert finished.wait(30) and done.wait(5)
            threading.Event().wait(1.2)  # two more idle waits of the loop: no second call while nothing runs
        assert len(idle) == 2 and all(t is loop._thread for t in idle)
    finally:
        loop.stop()


def test_a_spawned_or_started_loop_serves_as_a_context_manager(tiny_dirs):
    def build():
        return LLMEngine.from_dirs(tiny_dirs["qwen3"], None, EngineConfig(max_batch_size=1, speculative=False))

    done = threading.Event()
    with EngineLoop.spawn(build) as loop:
        loop.submit([5, 6, 7], SamplingParams(max_new_tokens=2), lambda u: u.finished and done.set())
        assert done.wait(30)
    assert not loop.is_alive


def test_a_requests_first_token_and_latency_are_timed_from_its_arrival_queueing_included(tiny_dirs):
    engine = LLMEngine.from_dirs(tiny_dirs["qwen3"], None, EngineConfig(max_batch_size=1, speculative=False))
    start = time.perf_counter()
    first, second = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=8, ignore_eos=True))
    wall = time.perf_counter() - start
    for out in (first, second):
        assert 0 < out.time_to_first_token <= out.latency <= wall
        assert out.latency >= out.time_to_first_token + out.decode_time - 1e-6
    assert second.time_to_first_token >= first.latency  # one row: it waited for the first to finish
