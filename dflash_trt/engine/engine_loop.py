"""EngineLoop: runs LLMEngine.step() on one background thread and routes each request's progress to
its callback. Requests and aborts come from any thread (HTTP handlers, Triton's python backend).

Callbacks run on the engine thread with an immutable `RequestUpdate` snapshot, so a consumer on
another thread never sees a sequence being mutated; they must return quickly (hand off, don't work).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from dflash_trt.engine import heap
from dflash_trt.engine.llm_engine import LLMEngine, RequestOutput, StepResult
from dflash_trt.engine.logprobs import TokenLogprob
from dflash_trt.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestUpdate:
    request_id: int
    token_ids: tuple[int, ...]  # all generated ids so far
    finished: bool
    output: RequestOutput | None = None  # set when finished (text cut at stop strings, statistics)
    error: str | None = None  # set when the engine failed this request
    logprobs: tuple[TokenLogprob, ...] = ()  # one per generated id so far, where the request asked for them


Callback = Callable[[RequestUpdate], None]


SHUTTING_DOWN = "server shutting down"  # the error of requests the loop's stop() ended


def _failed(seq, error: str) -> RequestUpdate:
    """A request's last update where it ended in `error`: its tokens and logprobs so far, for a reader that had not
    taken them yet (server/latest_updates.py)."""
    return RequestUpdate(seq.request_id, tuple(seq.output_ids), True, None, error, tuple(seq.output_logprobs))


class LoopStopped(RuntimeError):
    """A request came after stop(): the server is shutting down."""


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_step: Callable[[StepResult], None] | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None,
                 on_idle: Callable[[], object] | None = heap.trim) -> None:
        self.engine = engine
        # Metrics hooks, called on the engine thread: every step, and every request that ends
        # (finished, aborted, failed), whether or not its client is still there.
        self.on_step = on_step
        self.on_finish = on_finish
        self.on_idle = on_idle  # once each time the engine runs out of work (heap.trim: give freed memory back)
        self._callbacks: dict[int, Callback] = {}
        self._lock = threading.Lock()
        # Held while a request is checked and queued: the thread, stopped, takes it once before answering everything
        # left, so a request either lands before that or sees the stop (checked then queued unlocked, one could land
        # after the answers and wait forever).
        self._intake = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.failure: Exception | None = None  # what ended the loop where it was not stopped: its own bug
        self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)

    def start(self) -> "EngineLoop":
        """Start stepping; a started loop (spawn's) is left as it is, so `with EngineLoop.spawn(...)` works."""
        if self._thread.ident is None:
            self._thread.start()
        return self

    @classmethod
    def spawn(cls, factory: Callable[[], LLMEngine]) -> "EngineLoop":
        """Build the engine ON the loop thread, then run it there; returns once the engine exists (a build
        error is raised here). Measured on this CPU: an engine built on one thread and stepped on another
        decodes 1.5x slower (torch's OpenMP pool belongs to the thread that first ran parallel work), so a
        server must not load in its main thread and decode in a background one."""
        loop = cls(None)  # type: ignore[arg-type]  # the engine is set on its thread below
        ready, failure = threading.Event(), []

        def build_then_run() -> None:
            try:
                loop.engine = factory()
            except BaseException as e:  # handed to the caller
                failure.append(e)
                return
            finally:
                ready.set()
            loop._run()

        loop._thread = threading.Thread(target=build_then_run, name="dflash-engine", daemon=True)
        loop._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return loop

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def __enter__(self) -> "EngineLoop":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stopped_because(self) -> str:
        if self.failure is None:
            return "the engine loop is stopped"
        return f"the engine loop failed: {type(self.failure).__name__}: {self.failure}"

    def submit(self, prompt_ids: list[int], params: SamplingParams, callback: Callback) -> int:
        """Queue a request; raises ValueError (bad input), QueueFullError, or LoopStopped once stop() was called."""
        (request_id,) = self.submit_all([(prompt_ids, params, callback)])
        return request_id

    def submit_all(self, requests: list[tuple[list[int], SamplingParams, Callback]]) -> list[int]:
        """Queue requests all or none (one that is refused queues none), in one go: a request's n answers share
        their prompt's prefill. Raises as submit does."""
        requests = list(requests)
        seqs = [self.engine.make_sequence(prompt_ids, params) for prompt_ids, params, _ in requests]
        with self._intake:
            if self._stop.is_set():
                raise LoopStopped(self.stopped_because)
            with self._lock:
                self._callbacks.update((s.request_id, cb) for s, (_, _, cb) in zip(seqs, requests))
            try:
                self.engine.scheduler.add(*seqs)
            except Exception:
                with self._lock:
                    for s in seqs:
                        self._callbacks.pop(s.request_id, None)
                raise
        self._wake.set()
        return [s.request_id for s in seqs]

    def abort(self, request_id: int) -> bool:
        """Cancel a request: it is answered with finish_reason "abort" and its row is freed at the next step."""
        found = self.engine.abort(request_id)
        self._wake.set()
        return found

    def _run(self) -> None:
        try:
            self._step_until_stopped()
        except Exception as e:  # the loop's own bug: it stops, and still answers every request it took
            logger.exception("engine loop failed")
            self.failure = e
        finally:
            self._stop.set()  # an ended loop takes no more requests (submit raises LoopStopped: /health says so)
            self._answer_the_rest()

    def _step_until_stopped(self) -> None:
        busy = False
        while not self._stop.is_set():
            if not self.engine.has_unfinished():
                if busy:
                    busy = False
                    self._hook(self.on_idle)
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            busy = True
            try:
                result = self.engine.step()
            except Exception as e:  # one bad step fails the requests running in it, never the loop (those it
                # finished before it failed are answered by the next step, or at the stop)
                logger.exception("engine step failed")
                for seq in self.engine.scheduler.fail_running("error"):
                    self._answer(seq, f"engine error: {e}" if seq.finish_reason == "error" else None)
                continue
            # Metrics first: a client that reads /metrics right after its last token must see this step counted.
            self._hook(self.on_step, result)
            for seq in result.updated:
                if seq.is_finished:
                    self._answer(seq, seq.error)
                else:
                    self._deliver(RequestUpdate(seq.request_id, tuple(seq.output_ids), False,
                                                logprobs=tuple(seq.output_logprobs)))

    def _answer_the_rest(self) -> None:
        """Shutting down: answer whatever is left so no caller waits forever."""
        with self._intake:  # the loop ends only with _stop set: a submit past this point sees it
            pass
        for seq in self.engine.scheduler.take_aborted():  # aborted while the last step ran, or finished by a failed one
            self._answer(seq)
        # a stop's requests are the server's to retry elsewhere; a failure's are told what failed
        reason = SHUTTING_DOWN if self.failure is None else self.stopped_because
        for seq in self.engine.scheduler.fail_running("abort"):
            self._deliver(_failed(seq, reason))
        while self.engine.scheduler.waiting:
            seq = self.engine.scheduler.waiting.popleft()
            self._deliver(RequestUpdate(seq.request_id, (), True, None, reason))

    def _answer(self, seq, error: str | None = None) -> None:
        """A request's last update: its output (passed to on_finish), or `error` where given (its output still passed
        to on_finish) or where the output fails to build (detokenizing one request's: uncaught, it ended the thread,
        in a failed step's handler too, and every later request waited for ever)."""
        try:
            output = self.engine.make_output(seq)
        except Exception as e:
            logger.exception("output of request %d failed", seq.request_id)
            self._deliver(_failed(seq, error or f"engine error: {e}"))
            return
        self._hook(self.on_finish, output)
        self._deliver(_failed(seq, error) if error else RequestUpdate(
            seq.request_id, tuple(seq.output_ids), True, output, logprobs=tuple(seq.output_logprobs)))

    @staticmethod
    def _hook(hook, *args) -> None:
        if hook is None:
            return
        try:
            hook(*args)
        except Exception:
            logger.exception("engine loop hook failed")

    def _deliver(self, update: RequestUpdate) -> None:
        with self._lock:
            callback = self._callbacks.pop(update.request_id, None) if update.finished else self._callbacks.get(update.request_id)
        if callback is None:
            return
        try:
            callback(update)
        except Exception:
            logger.exception("callback for request %d failed", update.request_id)
