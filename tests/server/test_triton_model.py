"""server/triton_model.py in this process: its trtllm path, which needs tensorrt_llm (GPU) for real, and its torch path
on a tiny engine, against a stand-in for Triton's triton_python_backend_utils and for tensorrt_llm's
LLM.generate_async, both shaped after the real ones (tests/server/test_triton.py runs the torch path in tritonserver).

- pb_utils: InferenceResponse(output_tensors, error), TritonError(message, code) with TritonError.CANCELLED,
  INVALID_ARG and UNAVAILABLE,
  InferenceResponseSender.send(response, flags) / is_cancelled() (python_backend README, "Decoupled mode" and
  "Request Cancellation Handling").
- tensorrt_llm: generate_async(...) returns a RequestOutput that is async-iterable and has abort(); each item has
  .finished and .outputs[0] (text, finish_reason, request_perf_metrics.speculative_decoding with
  acceptance_rate / total_accepted_draft_tokens / total_draft_tokens), as TensorRT-LLM's own llmapi Triton model
  reads them (triton_backend/all_models/llmapi/tensorrt_llm/1/model.py, _create_response); SamplingParams takes
  return_perf_metrics (tensorrt_llm/sampling_params.py).
"""

from __future__ import annotations

import asyncio
import json
import importlib.util
import sys
import threading
import time
import types
from types import SimpleNamespace

import numpy as np
import pytest

FINAL = 1  # pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonError:
    INTERNAL, INVALID_ARG, UNAVAILABLE, CANCELLED = 1, 3, 4, 9

    def __init__(self, message, code=INTERNAL):
        self.message, self.code = message, code


class Tensor:
    def __init__(self, name, array):
        self.name, self.array = name, array

    def as_numpy(self):
        return self.array


class InferenceResponse:
    def __init__(self, output_tensors=(), error=None):
        self.outputs = {t.name: t.array for t in output_tensors}
        self.error = error


class Sender:
    def __init__(self, cancel_after: int | None = None):
        self.sent: list[tuple[InferenceResponse | None, int]] = []
        self.cancel_after = cancel_after  # is_cancelled() turns True after this many checks
        self.checks = 0
        self.threads: set[str] = set()  # the threads that sent
        self.errors: list[str] = []  # what a send after the final flag would have sent

    def send(self, response=None, flags=0):
        self.threads.add(threading.current_thread().name)
        if any(f == FINAL for _, f in self.sent):  # asserted by the tests (raised here, a model could swallow it)
            self.errors.append(f"sent after the final flag: {response and response.error and response.error.message}")
        self.sent.append((response, flags))

    def is_cancelled(self):
        self.checks += 1
        return self.cancel_after is not None and self.checks > self.cancel_after

    def wait_final(self, timeout=10.0):
        deadline = time.monotonic() + timeout
        while not any(f == FINAL for _, f in self.sent):
            assert time.monotonic() < deadline, f"no final response: {self.sent}"
            time.sleep(0.01)
        time.sleep(0.05)  # room for a send after the final one
        assert not self.errors and [f for _, f in self.sent].count(FINAL) == 1, self.sent
        return self.sent

    def text(self) -> str:
        return "".join(r.outputs["text_output"][0].decode() for r, _ in self.sent if r.error is None)


class Request:
    def __init__(self, sender: Sender, parameters: str = "{}", **inputs):
        self.sender, self.inputs, self._parameters = sender, inputs, parameters

    def get_response_sender(self):
        return self.sender

    def parameters(self) -> str:  # pb_utils' InferenceRequest: the request's parameters as a JSON object
        return self._parameters


class MetricFamily:
    COUNTER = 0

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels):  # noqa: N802 (pb_utils' spelling)
        return SimpleNamespace(increment=lambda n: None)


def _pb_utils() -> types.ModuleType:
    m = types.ModuleType("triton_python_backend_utils")
    m.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    m.TritonError, m.Tensor, m.InferenceResponse = TritonError, Tensor, InferenceResponse
    m.MetricFamily, m.Logger = MetricFamily, SimpleNamespace(log_warn=lambda message: None, log_error=print)
    m.get_input_tensor_by_name = lambda request, name: (Tensor(name, request.inputs[name])
                                                        if name in request.inputs else None)
    return m


class Generation:
    """tensorrt_llm's RequestOutput promise: async-iterable, abort(); not streamed, it yields once, at the end (its
    _handle_response)."""

    def __init__(self, outputs, streaming, step_s=0.0):
        self.outputs, self.streaming = outputs, streaming
        self.aborted, self.step_s = False, step_s

    def abort(self):
        self.aborted = True

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        for out in self.outputs:
            await asyncio.sleep(self.step_s)  # a step
            if self.aborted:
                return
            if self.streaming or out.finished:
                yield out


def _output(text, finished, accepted=0, drafted=0):
    spec = SimpleNamespace(acceptance_rate=accepted / drafted if drafted else 0.0,
                           total_accepted_draft_tokens=accepted, total_draft_tokens=drafted)
    seq = SimpleNamespace(text=text, finish_reason="length" if finished else None, token_ids=list(range(len(text))),
                          request_perf_metrics=SimpleNamespace(speculative_decoding=spec) if finished else None)
    return SimpleNamespace(finished=finished, outputs=[seq])


HELLO = [_output("Hel", False), _output("Hello wor", False), _output("Hello world", True, accepted=7, drafted=10)]


@pytest.fixture
def trtllm_model(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _pb_utils())
    from dflash_trt.server.triton import ModelSettings

    model = _model_module().TritonPythonModel()  # initialize() would load tensorrt_llm: set up its state by hand
    model.settings = ModelSettings(engine_dir="/nonexistent-engine", backend="trtllm")
    model.counters = SimpleNamespace(finished=lambda *counts: None)
    model._finalized = threading.Event()
    sampling_calls, generations = [], []
    model.outputs, model.step_s = HELLO, 0.0  # what the next generations yield

    def sampling_params(**kw):
        sampling_calls.append(kw)
        return SimpleNamespace(**kw)

    def generate_async(text, sampling, streaming=False):
        if isinstance(model.outputs, Exception):
            raise model.outputs
        generation = Generation(model.outputs, streaming, model.step_s)
        generations.append(generation)
        return generation

    model._trtllm = SimpleNamespace(SamplingParams=sampling_params)
    model._llm = SimpleNamespace(generate_async=generate_async)
    model._start_aio()
    yield model, sampling_calls, generations
    model.finalize()


def _model_module():
    from dflash_trt.server.triton import MODEL_TEMPLATE

    spec = importlib.util.spec_from_file_location("dflash_triton_model_under_test", MODEL_TEMPLATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _request(sender, streaming):
    return Request(sender, text_input=np.array([b"hi"], dtype=np.object_), streaming=np.array([streaming]),
                   sampling_param_max_tokens=np.array([8], dtype=np.int32))


@pytest.mark.parametrize("streaming", [False, True])
def test_trtllm_backend_reports_the_requests_acceptance(trtllm_model, streaming):
    model, sampling_calls, _ = trtllm_model
    sender = Sender()
    model.execute([_request(sender, streaming)])
    sent = sender.wait_final()
    assert sampling_calls[-1]["return_perf_metrics"] is True
    final, flags = sent[-1]
    assert flags == FINAL and final.error is None
    assert int(final.outputs["total_accepted_draft_tokens"][0]) == 7
    assert int(final.outputs["total_draft_tokens"][0]) == 10
    assert float(final.outputs["acceptance_rate"][0]) == pytest.approx(0.7)
    texts = [r.outputs["text_output"][0].decode() for r, _ in sent]
    assert ("".join(texts) if streaming else texts[-1]) == "Hello world"


@pytest.mark.parametrize("streaming", [True, False])
def test_trtllm_backend_cancelled_request_is_aborted_and_finalized(trtllm_model, streaming):
    """Not streamed, TensorRT-LLM yields a request's output once, at its end: cancelled, it is aborted all the same
    (it ran to max_tokens before being answered CANCELLED)."""
    model, _, generations = trtllm_model
    model.outputs, model.step_s = [_output("x" * n, n == 100) for n in range(1, 101)], 0.05  # 5 s in all
    sender = Sender(cancel_after=1)  # cancelled by its client after the first check
    model.execute([_request(sender, streaming)])
    sent = sender.wait_final(timeout=3.0)
    assert generations[-1].aborted  # the engine stops working for it
    final, flags = sent[-1]
    assert flags == FINAL and final.error is not None and final.error.code == TritonError.CANCELLED


def test_trtllm_backend_streams_no_text_its_final_answer_cuts_at_a_stop_string(trtllm_model):
    """TensorRT-LLM drops a stop string's tokens from the finished output only (executor/result.py): the stream held
    back "\n" of the stop string "\n\n" until the answer ended without it."""
    model, sampling_calls, _ = trtllm_model
    model.outputs = [_output("Hi", False), _output("Hi\n", False), _output("Hi", True)]
    sender = Sender()
    request = _request(sender, True)
    request.inputs["sampling_param_stop"] = np.array([b"\n\n"], dtype=np.object_)
    model.execute([request])
    sender.wait_final()
    assert sampling_calls[-1]["stop"] == ["\n\n"]
    assert sender.text() == "Hi"


@pytest.mark.parametrize("error, code", [(ValueError("prompt length (9000) exceeds max_seq_len (8192)"),
                                          TritonError.INVALID_ARG),
                                         (RuntimeError("executor died"), TritonError.INTERNAL)])
def test_trtllm_backend_tells_a_request_tensorrt_llm_refused_from_its_own_failure(trtllm_model, error, code):
    model, _, _ = trtllm_model
    model.outputs = error
    sender = Sender()
    model.execute([_request(sender, False)])
    (response, flags), = sender.wait_final()
    assert response.error.code == code and str(error) in response.error.message


def test_trtllm_backend_ends_its_requests_at_a_stop_and_refuses_new_ones(trtllm_model):
    """`triton serve` marks a stop, then tritonserver waits 10 s for requests in flight before it is killed: they
    end at once with "server shutting down", as on the torch backend, and nothing more starts."""
    model, _, generations = trtllm_model
    model.outputs, model.step_s = [_output("x" * n, n == 100) for n in range(1, 101)], 0.05
    running = Sender()
    model.execute([_request(running, True)])
    _wait_until(lambda: generations and running.sent)  # under way
    model._stop_generating()
    (response, flags) = running.wait_final(timeout=2.0)[-1]
    assert response.error.code == TritonError.UNAVAILABLE and "server shutting down" in response.error.message
    assert generations[-1].aborted
    late = Sender()
    model.execute([_request(late, False)])
    (response, _), = late.wait_final()
    assert response.error.code == TritonError.UNAVAILABLE and len(generations) == 1


# TensorRT-LLM's SamplingParams: greedy where none of the three is given, or top_k 1, top_p 0 or temperature 0
# (params_imply_greedy_decoding); a top_p or top_k given alone samples at temperature 1 (its docstring)
@pytest.mark.parametrize("given, expected", [
    ({}, (0.0, 1.0, 0)),
    ({"top_p": 0.9}, (1.0, 0.9, 0)),
    ({"top_k": 50}, (1.0, 1.0, 50)),
    ({"temperature": 0.7}, (0.7, 1.0, 0)),
    ({"temperature": 0.7, "top_k": 1}, (0.0, 1.0, 0)),
    ({"top_p": 0.0}, (0.0, 1.0, 0)),
    ({"temperature": 0.0, "top_p": 0.5}, (0.0, 0.5, 0)),
])
def test_sampling_inputs_follow_tensorrt_llms_defaults(trtllm_model, given, expected):
    model, sampling_calls, _ = trtllm_model
    sender = Sender()
    request = _request(sender, False)
    dtypes = {"temperature": np.float32, "top_p": np.float32, "top_k": np.int32}
    request.inputs.update({f"sampling_param_{k}": np.array([v], dtype=dtypes[k]) for k, v in given.items()})
    model.execute([request])
    assert sender.wait_final()[-1][0].error is None
    call = sampling_calls[-1]
    assert (call["temperature"], call["top_p"], call["top_k"] or 0) == pytest.approx(expected)


def test_trtllm_backend_passes_penalties_to_tensorrt_llm(trtllm_model):
    # the llmapi model maps sampling_param_{frequency,presence}_penalty onto SamplingParams' fields of those names
    model, sampling_calls, _ = trtllm_model
    sender = Sender()
    request = _request(sender, False)
    request.inputs["sampling_param_frequency_penalty"] = np.array([0.5], dtype=np.float32)
    request.inputs["sampling_param_presence_penalty"] = np.array([0.25], dtype=np.float32)
    model.execute([request])
    assert sender.wait_final()[-1][0].error is None
    assert sampling_calls[-1]["frequency_penalty"] == 0.5 and sampling_calls[-1]["presence_penalty"] == 0.25


@pytest.mark.parametrize("name, value, message", [
    ("sampling_param_best_of", np.array([2], dtype=np.int32), "sampling_param_best_of=2"),
    ("return_cumulative_logprob", np.array([True]), "no cumulative_logprob output"),
    # out of range: named as the client sends them, not as this project's SamplingParams spells its fields
    ("sampling_param_max_tokens", np.array([-5], dtype=np.int32), "sampling_param_max_tokens must be > 0, got -5"),
    ("sampling_param_top_p", np.array([2.0], dtype=np.float32), "sampling_param_top_p must be in (0, 1], got 2.0"),
    ("sampling_param_top_k", np.array([-1], dtype=np.int32), "sampling_param_top_k must be >= 0, got -1"),
    ("sampling_param_temperature", np.array([-1.0], dtype=np.float32), "sampling_param_temperature must be a"),
    ("sampling_param_stop", np.array([b""], dtype=np.object_), "sampling_param_stop strings must not be empty"),
    ("sampling_param_stop", np.array([b"s%d" % i for i in range(300)], dtype=np.object_),
     "sampling_param_stop holds 300 strings, more than the 256"),
    # one prompt a request: TensorRT-LLM's llmapi model silently drops all but the first
    ("text_input", np.array([b"one", b"two"], dtype=np.object_), "text_input holds 2 strings: this model takes one"),
    ("text_input", np.array([], dtype=np.object_), "text_input holds 0 strings"),
])
def test_inputs_it_cannot_honour_are_refused_naming_them(trtllm_model, name, value, message):
    model, sampling_calls, _ = trtllm_model
    sender = Sender()
    request = _request(sender, False)
    request.inputs[name] = value
    model.execute([request])
    (response, flags), = sender.wait_final()
    assert flags == FINAL and message in response.error.message and not sampling_calls
    assert response.error.code == TritonError.INVALID_ARG  # the client's doing: Triton answers 400, not 500


@pytest.fixture
def torch_model(monkeypatch, tiny_dirs, tmp_path):
    """The torch backend as Triton loads it (initialize with a model config's parameters), on a tiny engine of one
    row, whose steps wait for `gate` once it is cleared."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _pb_utils())
    from dflash_trt.server.triton import FAILED_FILE_ENV, ModelSettings

    monkeypatch.setenv(FAILED_FILE_ENV, str(tmp_path / "failed"))  # as `triton serve` starts tritonserver

    settings = ModelSettings(target_dir=str(tiny_dirs["qwen3"]), drafter_dir=str(tiny_dirs["qwen3_drafter"]),
                             max_batch_size=1, max_model_len=256, dtype="float32")
    model = _model_module().TritonPythonModel()
    model.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": v}
                                                                 for k, v in settings.to_parameters().items()}}),
                      "model_repository": str(tmp_path), "model_name": "dflash", "model_version": "1"})
    gate = threading.Event()
    gate.set()
    step = model.engine.step
    monkeypatch.setattr(model.engine, "step", lambda: (gate.wait(30), step())[1])
    yield model, gate
    gate.set()
    model.finalize()


def _wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_torch_backend_aborts_a_request_cancelled_while_it_waits_for_a_row(torch_model):
    """Cancellation was checked only as a request's updates came: one waiting for a row was answered once the
    requests before it had finished, then prefilled for nothing."""
    model, gate = torch_model
    gate.clear()  # the engine holds still
    running, waiting = Sender(), Sender(cancel_after=0)
    model.execute([_request(running, True)])
    model.execute([_request(waiting, True)])
    (response, flags), = waiting.wait_final(timeout=5.0)
    assert response.error.code == TritonError.CANCELLED
    assert not running.sent
    gate.set()
    assert running.wait_final()[-1][0].error is None


def test_torch_backend_answers_off_the_engine_thread(torch_model):
    """A send is a round trip to Triton's process: made on the engine thread, every row's would lengthen each step."""
    model, _ = torch_model
    sender = Sender()
    model.execute([_request(sender, True)])
    sender.wait_final()
    assert sender.threads == {"dflash-triton-responder"}


def test_torch_backend_sends_a_streams_queued_updates_as_one_response(torch_model):
    """A send is a round trip to Triton: one per row per step fell ever further behind the engine once rows times a
    send's cost passed a step. What queued while a send was out goes in one response, the text unchanged."""
    model, _ = torch_model
    sending, release = threading.Event(), threading.Event()

    class SlowSender(Sender):
        def send(self, response=None, flags=0):
            sending.set()
            release.wait(30)
            super().send(response, flags)

    def request(sender, streaming):
        r = _request(sender, streaming)
        r.inputs["sampling_param_max_tokens"] = np.array([24], dtype=np.int32)
        return r

    whole = Sender()
    model.execute([request(whole, False)])
    whole.wait_final()
    slow = SlowSender()
    model.execute([request(slow, True)])
    assert sending.wait(10)
    _wait_until(lambda: not model.engine.has_unfinished())  # every step's update queued behind the first send
    release.set()
    sent = slow.wait_final()
    assert slow.text() == whole.text() and len(whole.text()) > 0
    assert len(sent) <= 3, [r.outputs["text_output"][0] for r, _ in sent]


def test_torch_backend_answers_its_requests_unavailable_at_a_stop(torch_model):
    """Ended by a stop, a request is the server's to retry elsewhere (UNAVAILABLE: HTTP 503), not a failure (500), as
    a request that comes after the stop is answered."""
    model, gate = torch_model
    gate.clear()
    sender = Sender()
    model.execute([_request(sender, True)])
    _wait_until(model.engine.has_unfinished)  # admitted: its prompt is tokenized on a lane of its own
    stopping = threading.Thread(target=model._stop_generating)
    stopping.start()
    time.sleep(0.2)
    gate.set()
    stopping.join(10)
    response, _ = sender.wait_final()[-1]  # after the step in flight's text
    assert response.error.code == TritonError.UNAVAILABLE and "server shutting down" in response.error.message
    late = Sender()
    model.execute([_request(late, True)])
    assert late.wait_final()[-1][0].error.code == TritonError.UNAVAILABLE


def test_torch_backend_marks_an_engine_loop_that_failed_for_triton_serve(torch_model, tmp_path):
    """Triton has no way for a python model to become unready: a loop that failed on its own bug refused every
    request while Triton reported the model ready, for as long as the server ran. The model marks the failure (with
    its reason) for `triton serve`, which stops the server."""
    model, _ = torch_model
    model.engine.has_unfinished = lambda: 1 / 0  # a bug outside any step: the idle loop asks it within 0.5 s
    failed = tmp_path / "failed"
    _wait_until(failed.exists)
    assert failed.read_text() == "the engine loop failed: ZeroDivisionError: division by zero"
    late = Sender()
    model.execute([_request(late, True)])
    response = late.wait_final()[-1][0]
    assert response.error.code == TritonError.UNAVAILABLE and "ZeroDivisionError" in response.error.message


def test_torch_backend_marks_no_failure_at_a_stop(torch_model, tmp_path):
    model, _ = torch_model
    model._stop_generating()
    time.sleep(0.5)  # the watcher looks every 0.2 s
    assert not model.loop.is_alive and not (tmp_path / "failed").exists()


def test_torch_backend_samples_a_request_that_sends_top_p_alone(torch_model, monkeypatch):
    model, _ = torch_model
    submitted = []
    submit = model.responder.submit
    monkeypatch.setattr(model.responder, "submit", lambda prompt, sampling, answer: (
        submitted.append(sampling), submit(prompt, sampling, answer)))
    sender = Sender()
    request = _request(sender, False)
    request.inputs["sampling_param_top_p"] = np.array([0.9], dtype=np.float32)
    model.execute([request])
    sender.wait_final()
    assert (submitted[0].temperature, submitted[0].top_p) == (1.0, pytest.approx(0.9))


def test_torch_backend_tokenizes_a_long_prompt_without_holding_up_other_requests(torch_model, monkeypatch):
    """Triton calls execute one batch at a time: a prompt tokenized there (seconds for megabytes) held up every
    request behind it. A big one now takes a lane of its own, and is refused from there by its length."""
    from dflash_trt.engine.prompt_encoder import PromptEncoder
    from dflash_trt.server.prompt_lanes import BIG_PROMPT_CHARS

    model, _ = torch_model
    release = threading.Event()
    encode = PromptEncoder.encode
    monkeypatch.setattr(PromptEncoder, "encode", lambda self, prompt, *a, **k: (
        len(prompt) > BIG_PROMPT_CHARS and release.wait(30), encode(self, prompt, *a, **k))[1])
    big, small = Sender(), Sender()
    request = _request(big, False)
    request.inputs["text_input"] = np.array([b"x" * (BIG_PROMPT_CHARS + 1)], dtype=np.object_)
    taking = threading.Thread(target=model.execute, args=([request],))
    taking.start()
    taking.join(5)
    assert not taking.is_alive()  # Triton's next batch is not kept waiting
    model.execute([_request(small, False)])
    assert small.wait_final()[-1][0].error is None and not big.sent
    release.set()
    (response, _), = big.wait_final()
    assert response.error.code == TritonError.INVALID_ARG and "maximum context length" in response.error.message
