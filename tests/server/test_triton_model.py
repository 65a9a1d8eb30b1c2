"""server/triton_model.py's trtllm path, which needs tensorrt_llm (GPU) for real: run here against a stand-in for
Triton's triton_python_backend_utils and for tensorrt_llm's LLM.generate_async, both shaped after the real ones.

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

    def send(self, response=None, flags=0):
        assert not any(f == FINAL for _, f in self.sent), "sent after the final flag"
        self.sent.append((response, flags))

    def is_cancelled(self):
        self.checks += 1
        return self.cancel_after is not None and self.checks > self.cancel_after

    def wait_final(self, timeout=10.0):
        deadline = time.monotonic() + timeout
        while not any(f == FINAL for _, f in self.sent):
            assert time.monotonic() < deadline, f"no final response: {self.sent}"
            time.sleep(0.01)
        return self.sent


class Request:
    def __init__(self, sender: Sender, parameters: str = "{}", **inputs):
        self.sender, self.inputs, self._parameters = sender, inputs, parameters

    def get_response_sender(self):
        return self.sender

    def parameters(self) -> str:  # pb_utils' InferenceRequest: the request's parameters as a JSON object
        return self._parameters


def _pb_utils() -> types.ModuleType:
    m = types.ModuleType("triton_python_backend_utils")
    m.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    m.TritonError, m.Tensor, m.InferenceResponse = TritonError, Tensor, InferenceResponse
    m.get_input_tensor_by_name = lambda request, name: (Tensor(name, request.inputs[name])
                                                        if name in request.inputs else None)
    return m


class Generation:
    """tensorrt_llm's RequestOutput promise: async-iterable, abort()."""

    def __init__(self, outputs):
        self.outputs, self.aborted = outputs, False

    def abort(self):
        self.aborted = True

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        for out in self.outputs:
            if self.aborted:
                return
            await asyncio.sleep(0)
            yield out


def _output(text, finished, accepted=0, drafted=0):
    spec = SimpleNamespace(acceptance_rate=accepted / drafted if drafted else 0.0,
                           total_accepted_draft_tokens=accepted, total_draft_tokens=drafted)
    seq = SimpleNamespace(text=text, finish_reason="length" if finished else None,
                          request_perf_metrics=SimpleNamespace(speculative_decoding=spec) if finished else None)
    return SimpleNamespace(finished=finished, outputs=[seq])


@pytest.fixture
def trtllm_model(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _pb_utils())
    from dflash_trt.server.triton import MODEL_TEMPLATE, ModelSettings

    spec = importlib.util.spec_from_file_location("dflash_triton_model_under_test", MODEL_TEMPLATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()  # initialize() would load tensorrt_llm: set up its state by hand
    model.settings = ModelSettings(engine_dir="/nonexistent-engine", backend="trtllm")
    sampling_calls, generations = [], []

    def sampling_params(**kw):
        sampling_calls.append(kw)
        return SimpleNamespace(**kw)

    def generate_async(text, sampling, streaming=False):
        generation = Generation([_output("Hel", False), _output("Hello wor", False),
                                 _output("Hello world", True, accepted=7, drafted=10)])
        generations.append(generation)
        return generation

    model._trtllm = SimpleNamespace(SamplingParams=sampling_params)
    model._llm = SimpleNamespace(generate_async=generate_async)
    model._aio = asyncio.new_event_loop()
    thread = threading.Thread(target=model._aio.run_forever, daemon=True)
    thread.start()
    yield model, sampling_calls, generations
    model.finalize()
    thread.join(5)


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


def test_trtllm_backend_cancelled_request_is_aborted_and_finalized(trtllm_model):
    model, _, generations = trtllm_model
    sender = Sender(cancel_after=1)  # cancelled by its client after the first output
    model.execute([_request(sender, True)])
    sent = sender.wait_final()
    assert generations[-1].aborted  # the engine stops working for it
    final, flags = sent[-1]
    assert flags == FINAL and final.error is not None and final.error.code == TritonError.CANCELLED
    assert sum(1 for _, f in sent if f == FINAL) == 1


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
