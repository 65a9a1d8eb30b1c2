"""Triton python-backend model (copied as REPO/NAME/1/model.py by `dflash-trt triton export`).

Decoupled: each request gets its text as deltas (streaming=true) or in one response, the last one
flagged final; exported --unary, one response a request. Inputs and outputs follow TensorRT-LLM's llmapi Triton
model; generation counters join Triton's own on its metrics endpoint. The torch backend runs
this project's EngineLoop (continuous batching); the trtllm backend runs tensorrt_llm.LLM with the
engine's trtllm/config.yaml. Only Triton imports this file (triton_python_backend_utils exists there).
"""

import asyncio
import json
import os
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from dflash_trt.server.triton import STOP_FILE_ENV, ModelSettings, located

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _text(value: bytes, name: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: not UTF-8 text ({e})") from None


def _scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    value = tensor.as_numpy().reshape(-1)[0]
    return _text(value, name) if isinstance(value, bytes) else value.item()


def _strings(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return []
    return [_text(v, name) if isinstance(v, bytes) else str(v) for v in tensor.as_numpy().reshape(-1)]


def _refuse_parameters(request):
    """Triton's generate endpoint passes JSON keys that name no input as request parameters (max_tokens, stop_words:
    the names of TensorRT-LLM's ensemble): refused, where they would be ignored."""
    given = json.loads(request.parameters() or "{}")
    if given:
        raise ValueError(f"unknown parameters {sorted(given)}: this model's inputs are text_input, streaming and "
                         "sampling_param_* (max_tokens is sampling_param_max_tokens, stop words sampling_param_stop)")


PENALTIES = ("frequency_penalty", "presence_penalty")


class Counters:
    """What the model generated, as counters on Triton's metrics endpoint (the python backend's custom metrics),
    labelled by model and version like Triton's nv_inference_* ones: `dflash-trt serve`'s /metrics and vLLM's
    spec-decode counters, counted as requests finish."""

    KINDS = {
        "dflash_requests": "Requests finished, failed ones included",
        "dflash_generation_tokens": "Tokens generated",
        "dflash_spec_decode_num_drafts": "Speculative steps, one per request per step",
        "dflash_spec_decode_num_draft_tokens": "Draft tokens verified",
        "dflash_spec_decode_num_accepted_tokens": "Draft tokens accepted",
    }

    def __init__(self, model: str, version: str) -> None:
        labels = {"model": model, "version": version}
        # the families are kept: one that is collected takes its metrics with it (an increment then raises)
        self.families = {name: pb_utils.MetricFamily(name=name, description=doc, kind=pb_utils.MetricFamily.COUNTER)
                         for name, doc in self.KINDS.items()}
        self.metrics = {name: family.Metric(labels=labels) for name, family in self.families.items()}

    def finished(self, tokens: int = 0, steps: int = 0, drafted: int = 0, accepted: int = 0) -> None:
        """Counted after the request's last response went out: a metric that fails costs no answer."""
        try:
            for name, n in (("dflash_requests", 1), ("dflash_generation_tokens", tokens),
                            ("dflash_spec_decode_num_drafts", steps), ("dflash_spec_decode_num_draft_tokens", drafted),
                            ("dflash_spec_decode_num_accepted_tokens", accepted)):
                if n:
                    self.metrics[name].increment(n)
        except Exception as e:  # Triton's metrics are a report, not the service
            pb_utils.Logger.log_warn(f"dflash metrics: {e}")


def _refuse_unhonoured(request, penalties):
    """TensorRT-LLM's model takes these inputs too; a value this model would have to ignore is an error.

    Accepted as they are: return_finish_reason (finish_reason is always sent), sampling_param_return_perf_metrics
    (the acceptance outputs are always sent) and sampling_param_exclude_input_from_output (text_output is the
    generated text either way, as the llmapi model's CompletionOutput.text is). Penalties reach tensorrt_llm or
    this project's runtime, within OpenAI's [-2, 2]."""
    best_of = _scalar(request, "sampling_param_best_of", 1)
    if best_of != 1:
        raise ValueError(f"sampling_param_best_of={best_of}: only 1 is supported")
    for name, value in penalties.items():
        if not -2 <= value <= 2:
            raise ValueError(f"sampling_param_{name}={value}: penalties must be in [-2, 2]")
    for name, output in (("return_stop_reason", "stop_reason"), ("return_cumulative_logprob", "cumulative_logprob")):
        if _scalar(request, name, False):
            raise ValueError(f"{name}: this model has no {output} output")


# SamplingParams' fields as this model's inputs name them (its errors begin with the field's name)
INPUT_OF = {"max_new_tokens": "sampling_param_max_tokens", "temperature": "sampling_param_temperature",
            "top_p": "sampling_param_top_p", "top_k": "sampling_param_top_k", "stop": "sampling_param_stop"}


def _sampling_params(cls, params: dict):
    """cls(**params) (this project's SamplingParams), a ValueError naming the Triton input a client sent."""
    try:
        return cls(**params)
    except ValueError as e:
        field, _, rest = str(e).partition(" ")
        raise ValueError(f"{INPUT_OF[field]} {rest}" if field in INPUT_OF else str(e)) from None


def _response(text, finish_reason="", accepted=0, drafted=0):
    rate = accepted / drafted if drafted else 0.0
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("finish_reason", np.array([finish_reason.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("acceptance_rate", np.array([rate], dtype=np.float32)),
        pb_utils.Tensor("total_accepted_draft_tokens", np.array([accepted], dtype=np.int32)),
        pb_utils.Tensor("total_draft_tokens", np.array([drafted], dtype=np.int32)),
    ])


def _error(message, code=None):
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def _cancelled():
    # python_backend README, "Decoupled mode": the FINAL flag is still needed when the request is cancelled;
    # without it the model never unloads ("Found 1 live models" until the exit timeout). TensorRT-LLM's llmapi
    # model answers a cancelled request the same way (triton_backend/all_models/llmapi/tensorrt_llm/1/model.py).
    return _error("request cancelled by the client", pb_utils.TritonError.CANCELLED)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.settings = ModelSettings.from_parameters(located(params, args["model_repository"]))
        self.counters = Counters(args["model_name"], args["model_version"])
        if self.settings.backend == "trtllm":
            self._init_trtllm()
            return
        from dflash_trt.engine.engine_loop import EngineLoop

        self.loop = EngineLoop.spawn(self.settings.open_engine)  # built and stepped on one thread
        self.engine = self.loop.engine
        self._finalized = threading.Event()
        marker = os.environ.get(STOP_FILE_ENV)
        if marker:
            threading.Thread(target=self._stop_when_marked, args=(marker,), daemon=True).start()

    def _stop_when_marked(self, marker):
        """`dflash-trt triton serve` marks a stop before it signals tritonserver, which waits for requests in flight
        (finalize comes only after them): the loop stops now, so each ends with an error ("server shutting down"),
        as `dflash-trt serve` ends them, and new ones are refused."""
        while not os.path.exists(marker):
            if self._finalized.wait(0.2):  # unloaded otherwise (tritonserver's own model control)
                return
        self.loop.stop()

    def execute(self, requests):
        from dflash_trt.engine.engine_loop import LoopStopped
        from dflash_trt.engine.scheduler import QueueFullError

        for request in requests:
            sender = request.get_response_sender()
            try:
                self._start(request, sender)
            # answer this request, keep serving the others; the code tells clients whose fault it is (Triton answers
            # INVALID_ARG with HTTP 400, UNAVAILABLE with 503; no code is INTERNAL, a 500)
            except ValueError as e:  # bad input
                sender.send(_error(str(e), pb_utils.TritonError.INVALID_ARG), flags=FINAL)
            except (QueueFullError, LoopStopped) as e:  # retry later, or elsewhere
                sender.send(_error(str(e), pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
            except Exception as e:
                sender.send(_error(str(e)), flags=FINAL)
        return None  # responses go through the senders (one each where the model is not decoupled)

    def finalize(self):
        if self.settings.backend == "trtllm":
            self._aio.call_soon_threadsafe(self._aio.stop)
            return
        self._finalized.set()
        self.loop.stop()

    # --- torch backend: this project's runtime ------------------------------------------------------

    def _start(self, request, sender):
        from dflash_trt.engine.detokenizer import IncrementalDetokenizer
        from dflash_trt.sampling_params import SamplingParams

        _refuse_parameters(request)
        texts = _strings(request, "text_input")
        if len(texts) != 1:  # TensorRT-LLM's llmapi model reads the first and drops the rest
            raise ValueError(f"text_input holds {len(texts)} strings: this model takes one prompt a request")
        text = texts[0]
        streaming = bool(_scalar(request, "streaming", False))
        if streaming and not self.settings.decoupled:  # Triton would fail the request at its second response
            raise ValueError("streaming needs the decoupled model: this one was exported with --unary (one response "
                             "a request); export another without it, or send streaming false")
        stop = _strings(request, "sampling_param_stop")
        max_tokens = int(_scalar(request, "sampling_param_max_tokens", 64))
        params = dict(max_new_tokens=max_tokens, temperature=float(_scalar(request, "sampling_param_temperature", 0.0)),
                      top_p=float(_scalar(request, "sampling_param_top_p", 1.0)),
                      top_k=int(_scalar(request, "sampling_param_top_k", 0)),
                      seed=_scalar(request, "sampling_param_seed", None), stop=stop)
        penalties = {name: float(_scalar(request, f"sampling_param_{name}", 0.0)) for name in PENALTIES}
        _refuse_unhonoured(request, penalties)
        params |= penalties
        sampling = _sampling_params(SamplingParams, params)  # checked on either backend, named as clients send them
        if self.settings.backend == "trtllm":
            self._start_trtllm(text, streaming, params, sender)
            return
        prompt = self.engine.encode(text)
        limit = self.engine.max_model_len
        if len(prompt) + max_tokens > limit:
            raise ValueError(f"prompt ({len(prompt)} tokens) + sampling_param_max_tokens ({max_tokens}) exceeds "
                             f"the model's maximum context length {limit}")
        detok = IncrementalDetokenizer(self.engine.tokenizer, stop)
        closed = []  # set once the request is answered as cancelled

        def on_update(update):
            if closed:  # the engine's own final update for the aborted request goes nowhere
                return
            if sender.is_cancelled():
                closed.append(True)
                if not update.finished:
                    self.loop.abort(update.request_id)
                sender.send(_cancelled(), flags=FINAL)
                self.counters.finished()
                return
            if update.error is not None:
                sender.send(_error(update.error), flags=FINAL)
                self.counters.finished()
                return
            out = update.output
            if streaming:
                delta = detok.delta(update.token_ids, out.text if out is not None else None)
                if out is None:
                    if delta:
                        sender.send(_response(delta))
                    return
                sender.send(_response(delta, out.finish_reason, out.total_accepted_draft_tokens, out.total_draft_tokens),
                            flags=FINAL)
            elif out is not None:
                sender.send(_response(out.text, out.finish_reason, out.total_accepted_draft_tokens, out.total_draft_tokens),
                            flags=FINAL)
            if out is not None:
                self.counters.finished(out.num_tokens, len(out.acceptance_lengths), out.total_draft_tokens,
                                       out.total_accepted_draft_tokens)

        self.loop.submit(prompt, sampling, on_update)

    # --- trtllm backend: TensorRT-LLM's LLM API with the engine's config -----------------------------

    def _init_trtllm(self):
        from dflash_trt.engine_dir import EngineDir
        from dflash_trt.trtllm.launch import open_llm

        engine = EngineDir(self.settings.engine_dir)
        engine.verify()
        self._trtllm, self._llm = open_llm(engine)
        self._aio = asyncio.new_event_loop()
        threading.Thread(target=self._aio.run_forever, daemon=True).start()

    def _start_trtllm(self, text, streaming, params, sender):
        # return_perf_metrics: the request's speculative-decoding counts come back in
        # outputs[0].request_perf_metrics.speculative_decoding, which is where TensorRT-LLM's own llmapi Triton
        # model reads acceptance_rate / total_accepted_draft_tokens / total_draft_tokens from.
        sampling = self._trtllm.SamplingParams(max_tokens=params["max_new_tokens"], temperature=params["temperature"],
                                               top_p=params["top_p"], top_k=params["top_k"] or None,
                                               seed=params["seed"], stop=params["stop"] or None,
                                               frequency_penalty=params["frequency_penalty"],
                                               presence_penalty=params["presence_penalty"], return_perf_metrics=True)

        async def run():
            sent = 0
            try:
                generation = self._llm.generate_async(text, sampling, streaming=streaming)
                async for out in generation:
                    if sender.is_cancelled():
                        generation.abort()
                        sender.send(_cancelled(), flags=FINAL)
                        self.counters.finished()
                        return
                    seq = out.outputs[0]
                    if not out.finished and not streaming:
                        continue
                    delta = seq.text[sent:] if streaming else seq.text
                    sent = len(seq.text)
                    if out.finished:
                        accepted, drafted = _trtllm_acceptance(seq)
                        sender.send(_response(delta, str(seq.finish_reason or ""), accepted, drafted), flags=FINAL)
                        self.counters.finished(len(seq.token_ids), 0, drafted, accepted)
                    elif delta:
                        sender.send(_response(delta))
            except Exception as e:
                sender.send(_error(str(e)), flags=FINAL)
                self.counters.finished()

        asyncio.run_coroutine_threadsafe(run(), self._aio)


def _trtllm_acceptance(seq):
    """(accepted, drafted) draft tokens of a finished tensorrt_llm CompletionOutput; (0, 0) without perf metrics."""
    metrics = getattr(seq, "request_perf_metrics", None)
    spec = getattr(metrics, "speculative_decoding", None) if metrics is not None else None
    if spec is None:
        return 0, 0
    return int(spec.total_accepted_draft_tokens), int(spec.total_draft_tokens)
