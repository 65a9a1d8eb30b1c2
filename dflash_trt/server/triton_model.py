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
import queue
import threading
import time
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

from dflash_trt.server.prompt_lanes import PromptLanes
from dflash_trt.server.triton import FAILED_FILE_ENV, STOP_FILE_ENV, ModelSettings, located

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# how often live requests are asked whether their client cancelled (TensorRT-LLM's llmapi model's
# cancellation_check_period_ms default)
CANCEL_POLL_S = 0.1


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


def _sampling_rule(temperature, top_p, top_k) -> dict:
    """TensorRT-LLM's SamplingParams rule for the three, None where a client left one out: greedy where none is
    given, or top_k is 1, top_p 0 or temperature 0 (its params_imply_greedy_decoding); otherwise a top_p or top_k
    given alone samples at temperature 1 (its docstring: "temperature will default to temperature = 1"). A client of
    TensorRT-LLM's own Triton model that sends only top_p samples, and samples here too."""
    given = [v for v in (temperature, top_p, top_k) if v is not None]
    if not given or top_k == 1 or top_p == 0 or temperature == 0:
        # the others still checked as given: a temperature of -1 beside top_k 1 is refused, as TensorRT-LLM's is
        return dict(temperature=0.0 if temperature is None or temperature >= 0 else float(temperature),
                    top_p=1.0 if top_p is None or top_p == 0 else float(top_p),
                    top_k=0 if top_k is None or top_k == 1 else int(top_k))
    return dict(temperature=1.0 if temperature is None else float(temperature),
                top_p=1.0 if top_p is None else float(top_p), top_k=0 if top_k is None else int(top_k))


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


def _refusal(e):
    """The response to a request refused before it ran: the code tells clients whose fault it is (Triton answers
    INVALID_ARG with HTTP 400, UNAVAILABLE with 503; no code is INTERNAL, a 500)."""
    from dflash_trt.engine.engine_loop import LoopStopped
    from dflash_trt.engine.scheduler import QueueFullError

    if isinstance(e, ValueError):  # bad input
        return _error(str(e), pb_utils.TritonError.INVALID_ARG)
    if isinstance(e, (QueueFullError, LoopStopped)):  # retry later, or elsewhere
        return _error(str(e), pb_utils.TritonError.UNAVAILABLE)
    return _error(str(e))


def _cancelled():
    # python_backend README, "Decoupled mode": the FINAL flag is still needed when the request is cancelled;
    # without it the model never unloads ("Found 1 live models" until the exit timeout). TensorRT-LLM's llmapi
    # model answers a cancelled request the same way (triton_backend/all_models/llmapi/tensorrt_llm/1/model.py).
    return _error("request cancelled by the client", pb_utils.TritonError.CANCELLED)


class Answer:
    """A request as the thread that answers it sees it (the torch backend's Responder, the trtllm backend's loop)."""

    def __init__(self, sender, detok, streaming):
        self.sender, self.detok, self.streaming = sender, detok, streaming
        self.request_id = None
        self.done = False  # answered with the final flag


class Responder:
    """Answers the torch backend's requests on a thread of its own. The engine thread only queues each update: a
    send is a round trip to Triton's process (0.1-0.4 ms measured on tritonserver 2.51 here), which each row's would
    add to every step, and the detokenizer's work goes with it. Every CANCEL_POLL_S, each request not yet answered is
    asked whether its client cancelled (as TensorRT-LLM's llmapi model polls), so one still waiting for a row is
    aborted at once, not once it has one; an answer that fails is still ended with the final flag. A stream's updates
    queued while the thread was sending go out as one response: a send per row per step would fall ever further
    behind the engine once rows times a send's round trip passes a step."""

    def __init__(self, loop, counters):
        from dflash_trt.engine.engine_loop import SHUTTING_DOWN

        self.loop, self.counters, self._shutting_down = loop, counters, SHUTTING_DOWN
        self._inbox = queue.SimpleQueue()  # (answer, update); (answer, None): polled from now on; None: stop
        self._live = set()
        self._unsent = {}  # a stream's text not yet sent, by answer: sent once the queued updates are read
        self._thread = threading.Thread(target=self._run, name="dflash-triton-responder", daemon=True)
        self._thread.start()

    def submit(self, prompt, sampling, answer):
        answer.request_id = self.loop.submit(prompt, sampling, lambda update: self._inbox.put((answer, update)))
        self._inbox.put((answer, None))

    def close(self, timeout=10.0):
        """After the loop's stop: its last updates (each request it ended) are answered first."""
        deadline = time.monotonic() + timeout
        while self.loop.is_alive and time.monotonic() < deadline:  # a step longer than stop()'s wait: its updates
            time.sleep(0.05)
        self._inbox.put(None)
        self._thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self):
        poll_at = time.monotonic() + CANCEL_POLL_S
        while True:
            try:
                items = [self._inbox.get(timeout=max(0.0, poll_at - time.monotonic()))]
            except queue.Empty:
                items = []
            while items and items[-1] is not None:  # all that is queued (None, the stop, comes last)
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for item in items:
                if item is not None:
                    self._guarded(self._take, *item)
            for answer in list(self._unsent):
                self._guarded(self._send_unsent, answer)
            if time.monotonic() >= poll_at:
                for answer in list(self._live):
                    self._guarded(self._poll, answer)
                poll_at = time.monotonic() + CANCEL_POLL_S
            if items and items[-1] is None:
                return

    @staticmethod
    def _guarded(method, *args):
        try:  # one request's failure is its own: this thread answers every request
            method(*args)
        except Exception:
            pb_utils.Logger.log_error(f"dflash: answering a request failed:\n{traceback.format_exc()}")

    def _take(self, answer, update):
        if update is not None:
            self._update(answer, update)
        elif not answer.done:
            self._live.add(answer)

    def _send_unsent(self, answer):
        text = self._unsent.pop(answer)
        if answer.done:
            return
        try:
            answer.sender.send(_response(text))
        except Exception as e:
            self._failed(answer, e)

    def _poll(self, answer):
        if _cancelled_by_client(answer):
            self.loop.abort(answer.request_id)  # waiting or running (its own final update then goes nowhere)
            self._finish(answer, _cancelled())

    def _update(self, answer, update):
        if answer.done:  # cancelled: the engine's own final update for it goes nowhere
            return
        try:
            if update.error is not None:
                # ended by a stop: UNAVAILABLE (HTTP 503), as a request that comes after it is answered
                code = pb_utils.TritonError.UNAVAILABLE if update.error == self._shutting_down else None
                if answer in self._unsent:  # the text it was given before
                    self._send_unsent(answer)
                if not answer.done:  # (the send failed: ended already)
                    self._finish(answer, _error(update.error, code))
                return
            out = update.output
            if answer.streaming:
                delta = answer.detok.delta(update.token_ids, out.text if out is not None else None)
                if out is None:
                    if delta:
                        self._unsent[answer] = self._unsent.get(answer, "") + delta
                    return
                text = self._unsent.pop(answer, "") + delta
            elif out is None:
                return
            else:
                text = out.text
            self._finish(answer, _response(text, out.finish_reason, out.total_accepted_draft_tokens,
                                           out.total_draft_tokens), out)
        except Exception as e:
            self._failed(answer, e)

    def _failed(self, answer, e):
        pb_utils.Logger.log_error(f"dflash: request {answer.request_id}:\n{traceback.format_exc()}")
        if not answer.done:
            self._finish(answer, _error(f"answering the request failed: {e}"))
            self.loop.abort(answer.request_id)

    def _finish(self, answer, response, out=None):
        self._live.discard(answer)
        self._unsent.pop(answer, None)
        counts = () if out is None else (out.num_tokens, len(out.acceptance_lengths), out.total_draft_tokens,
                                         out.total_accepted_draft_tokens)
        _final(answer, response, self.counters, *counts)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.settings = ModelSettings.from_parameters(located(params, args["model_repository"]))
        self.counters = Counters(args["model_name"], args["model_version"])
        self._finalized = threading.Event()
        if self.settings.backend == "trtllm":
            self._init_trtllm()
        else:
            self._init_torch()
        stop_file, failed_file = os.environ.get(STOP_FILE_ENV), os.environ.get(FAILED_FILE_ENV)
        if stop_file or failed_file:
            threading.Thread(target=self._watch_files, args=(stop_file, failed_file), daemon=True).start()

    def _init_torch(self):
        from dflash_trt.engine.engine_loop import EngineLoop

        self.loop = EngineLoop.spawn(self.settings.open_engine)  # built and stepped on one thread
        self.engine = self.loop.engine
        self.responder = Responder(self.loop, self.counters)
        self.lanes = PromptLanes(self.engine.prompt_encoder)

    def _watch_files(self, stop_file, failed_file):
        """`dflash-trt triton serve` marks a stop before it signals tritonserver, which waits for requests in flight
        (finalize comes only after them): they end now, each with an error ("server shutting down"), as
        `dflash-trt serve` ends them, and new ones are refused. An engine loop that failed on its own bug (it answered
        what it took, and refuses the rest) is marked for `triton serve` to stop the server: Triton would go on
        reporting this model ready."""
        while not self._finalized.wait(0.2):  # (or unloaded by tritonserver's own model control)
            if stop_file and os.path.exists(stop_file):
                self._stop_generating()
                return
            if failed_file and self.settings.backend != "trtllm" and self.loop.failure is not None:
                pb_utils.Logger.log_error(f"dflash: {self.loop.stopped_because}")
                with open(f"{failed_file}.writing", "w") as f:  # whole or not there: it is read as it appears
                    f.write(self.loop.stopped_because)
                os.replace(f"{failed_file}.writing", failed_file)
                return

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._start(request, sender)
            except Exception as e:  # answer this request, keep serving the others
                sender.send(_refusal(e), flags=FINAL)
        return None  # responses go through the senders (one each where the model is not decoupled)

    def finalize(self):
        self._finalized.set()
        if self.settings.backend == "trtllm":
            self._aio.call_soon_threadsafe(self._aio.stop)
            return
        self.lanes.shutdown()  # prompts being tokenized are admitted, then ended by the stop
        self.loop.stop()  # the requests it ends are answered before the responder's last item
        self.responder.close()

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
        params = dict(max_new_tokens=max_tokens, **_sampling_rule(*(_scalar(request, f"sampling_param_{name}", None)
                                                                     for name in ("temperature", "top_p", "top_k"))),
                      seed=_scalar(request, "sampling_param_seed", None), stop=stop)
        penalties = {name: float(_scalar(request, f"sampling_param_{name}", 0.0)) for name in PENALTIES}
        _refuse_unhonoured(request, penalties)
        params |= penalties
        sampling = _sampling_params(SamplingParams, params)  # checked on either backend, named as clients send them
        if self.settings.backend == "trtllm":
            self._start_trtllm(text, streaming, params, sender)
            return
        answer = Answer(sender, IncrementalDetokenizer(self.engine.tokenizer, stop), streaming)
        encoder, lane = self.lanes.lane(len(text))
        lane.submit(self._admit, encoder, text, max_tokens, sampling, answer)

    def _admit(self, encoder, text, max_tokens, sampling, answer):
        """On a tokenizer's lane: Triton calls execute one batch at a time, and a long prompt's tokenization there
        held up every request behind it."""
        try:
            prompt = encoder.encode(text, False)
            limit = self.engine.max_model_len
            if len(prompt) + max_tokens > limit:
                raise ValueError(f"prompt ({len(prompt)} tokens) + sampling_param_max_tokens ({max_tokens}) exceeds "
                                 f"the model's maximum context length {limit}")
            self.responder.submit(prompt, sampling, answer)
        except Exception as e:
            answer.done = True
            try:
                answer.sender.send(_refusal(e), flags=FINAL)
            except Exception as sent:
                pb_utils.Logger.log_warn(f"dflash: a refused request: {sent}")

    # --- trtllm backend: TensorRT-LLM's LLM API with the engine's config -----------------------------

    def _init_trtllm(self):
        from dflash_trt.engine_dir import EngineDir
        from dflash_trt.trtllm.launch import open_llm

        engine = EngineDir(self.settings.engine_dir)
        engine.verify()
        self._trtllm, self._llm = open_llm(engine)
        self._start_aio()

    def _start_aio(self):
        """The asyncio loop the trtllm backend's requests run on, and what ends them at a stop."""
        self._aio = asyncio.new_event_loop()
        threading.Thread(target=self._aio.run_forever, daemon=True).start()
        self._generations = {}  # Answer -> its tensorrt_llm generation, while it runs
        self._stopping = threading.Event()

    def _stop_generating(self):
        """A stop: requests still generating end at once with "server shutting down" (UNAVAILABLE), new ones are
        refused, on either backend."""
        if self.settings.backend != "trtllm":
            self.loop.stop()
            return
        self._stopping.set()
        asyncio.run_coroutine_threadsafe(self._end_generations(), self._aio).result(10)

    async def _end_generations(self):
        from dflash_trt.engine.engine_loop import SHUTTING_DOWN

        for answer, generation in list(self._generations.items()):
            generation.abort()
            if not answer.done:
                _final(answer, _error(SHUTTING_DOWN, pb_utils.TritonError.UNAVAILABLE), self.counters)

    def _start_trtllm(self, text, streaming, params, sender):
        from dflash_trt.engine.detokenizer import IncrementalDetokenizer
        from dflash_trt.engine.engine_loop import SHUTTING_DOWN, LoopStopped

        if self._stopping.is_set():
            raise LoopStopped(SHUTTING_DOWN)
        # return_perf_metrics: the request's speculative-decoding counts come back in
        # outputs[0].request_perf_metrics.speculative_decoding, which is where TensorRT-LLM's own llmapi Triton
        # model reads acceptance_rate / total_accepted_draft_tokens / total_draft_tokens from.
        sampling = self._trtllm.SamplingParams(max_tokens=params["max_new_tokens"], temperature=params["temperature"],
                                               top_p=params["top_p"], top_k=params["top_k"] or None,
                                               seed=params["seed"], stop=params["stop"] or None,
                                               frequency_penalty=params["frequency_penalty"],
                                               presence_penalty=params["presence_penalty"], return_perf_metrics=True)
        # TensorRT-LLM cuts a stop string's tokens from the finished text only: a stream holds back what may begin one
        answer = Answer(sender, IncrementalDetokenizer(None, params["stop"]), streaming)
        asyncio.run_coroutine_threadsafe(self._generate(text, sampling, answer), self._aio)

    async def _generate(self, text, sampling, answer):
        from dflash_trt.engine.engine_loop import SHUTTING_DOWN

        if self._stopping.is_set():  # a stop between execute and here: _end_generations has run or runs after this
            _final(answer, _error(SHUTTING_DOWN, pb_utils.TritonError.UNAVAILABLE), self.counters)
            return
        try:
            generation = self._llm.generate_async(text, sampling, streaming=answer.streaming)
        except ValueError as e:  # TensorRT-LLM's checks of the request (a prompt past max_seq_len): the client's
            _final(answer, _error(str(e), pb_utils.TritonError.INVALID_ARG), self.counters)
            return
        except Exception as e:
            _final(answer, _error(str(e)), self.counters)
            return
        self._generations[answer] = generation
        # a request that is not streamed yields once, at its end: its cancellation is polled beside it
        watch = asyncio.ensure_future(self._watch(answer, generation))
        try:
            async for out in generation:
                if answer.done:  # cancelled, or ended by a stop
                    break
                seq = out.outputs[0]
                if out.finished:
                    accepted, drafted = _trtllm_acceptance(seq)
                    body = answer.detok.text_delta(seq.text, seq.text) if answer.streaming else seq.text
                    _final(answer, _response(body, str(seq.finish_reason or ""), accepted, drafted), self.counters,
                           len(seq.token_ids), 0, drafted, accepted)
                elif answer.streaming and (delta := answer.detok.text_delta(seq.text)):
                    answer.sender.send(_response(delta))
        except Exception as e:
            pb_utils.Logger.log_error(f"dflash: a request on TensorRT-LLM:\n{traceback.format_exc()}")
            generation.abort()  # else it generates on for nobody
            if not answer.done:
                _final(answer, _error(str(e)), self.counters)
        finally:
            self._generations.pop(answer, None)
            watch.cancel()
        if not answer.done:
            _final(answer, _error("TensorRT-LLM ended the request without a finished output"), self.counters)

    async def _watch(self, answer, generation):
        while not answer.done:
            await asyncio.sleep(CANCEL_POLL_S)
            if not answer.done and _cancelled_by_client(answer):
                generation.abort()
                _final(answer, _cancelled(), self.counters)


def _cancelled_by_client(answer):
    try:
        return answer.sender.is_cancelled()
    except Exception as e:  # a sender Triton has closed: nothing more can reach its client
        pb_utils.Logger.log_warn(f"dflash: request {answer.request_id}: {e}")
        return True


def _final(answer, response, counters, tokens=0, steps=0, drafted=0, accepted=0):
    """A request's last response, with the final flag (once), then its counters."""
    answer.done = True
    try:
        answer.sender.send(response, flags=FINAL)
    except Exception as e:  # its client is gone: nothing more can reach it
        pb_utils.Logger.log_warn(f"dflash: request {answer.request_id}: {e}")
    counters.finished(tokens, steps, drafted, accepted)


def _trtllm_acceptance(seq):
    """(accepted, drafted) draft tokens of a finished tensorrt_llm CompletionOutput; (0, 0) without perf metrics."""
    metrics = getattr(seq, "request_perf_metrics", None)
    spec = getattr(metrics, "speculative_decoding", None) if metrics is not None else None
    if spec is None:
        return 0, 0
    return int(spec.total_accepted_draft_tokens), int(spec.total_draft_tokens)
