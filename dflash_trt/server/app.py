"""OpenAI-compatible HTTP routes over an EngineLoop: /v1/completions, /v1/chat/completions, /v1/responses (SSE
streaming and not), /v1/models, vLLM's /tokenize, /detokenize and /version, /health, /metrics. Every refusal is an
OpenAI-style JSON error."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dflash_trt import __version__
from dflash_trt.engine.detokenizer import IncrementalDetokenizer
from dflash_trt.engine.engine_loop import SHUTTING_DOWN, EngineLoop, LoopStopped, RequestUpdate
from dflash_trt.engine.grammar import GrammarError
from dflash_trt.engine.llm_engine import RequestOutput
from dflash_trt.engine.prompt_encoder import PromptTooLong, chat_chars
from dflash_trt.engine.scheduler import QueueFullError
from dflash_trt.sampling_params import ParamError, SamplingParams, choice_seed
from dflash_trt.server import protocol as p
from dflash_trt.server.access import Access
from dflash_trt.server.logprobs import TextOffsets, TokenText, chat_logprobs, completion_logprobs
from dflash_trt.server.latest_updates import LatestUpdates
from dflash_trt.server.metrics import ServerMetrics
from dflash_trt.server.prediction import prediction_tokens
from dflash_trt.server.prompt_lanes import PromptLanes
from dflash_trt.server.chat_answer import ChatAnswerSplitter
from dflash_trt.server.reasoning import ReasoningParser
from dflash_trt.server.responses import ResponseEvents, ResponseObject, chat_body
from dflash_trt.server.responses import usage as response_usage
from dflash_trt.server.structured import forced_functions
from dflash_trt.server.tool_calls import PARSERS, ForcedCallSplitter, ToolCallParser, ToolCallSplitter
from dflash_trt.structured_output import HARMONY_NAME, StructuredOutput

logger = logging.getLogger(__name__)

# The largest request body (serve --max-request-mb): a 1M-token prompt sent as ids is about 7 MB
MAX_REQUEST_BYTES = 32 * 2**20
MAX_ERROR_CHARS = 1000  # of an error's message, which may quote what the client sent


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


@dataclass
class _Submitted:
    request_ids: list[int]  # one per choice: prompt-major, n answers of each prompt in turn (OpenAI's indices)
    prompt_lens: list[int]
    updates: LatestUpdates  # by choice index
    detoks: list[IncrementalDetokenizer]
    n: int = 1
    prediction: list[int] | None = None  # the request's predicted output's tokens (server/prediction.py)


def _is_union_tag(loc: str | int) -> bool:
    return isinstance(loc, str) and (loc in {"str", "int", "float", "bool", "list", "dict"} or "[" in loc)


def _telling(err: dict) -> tuple[bool, int, bool]:
    """How much a validation error says. A union's branches each fail, and the first (a string's) may only say that
    a list is no string: the branch that took the value's type says what is wrong with it, by its validator ("not
    valid Unicode text"), by looking inside it (a content part's missing "text"), or by its own bound (too many stop
    strings). max() keeps the first of equals."""
    depth = sum(1 for part in err["loc"] if not _is_union_tag(part))
    return err["type"] == "value_error", depth, not err["type"].endswith("_type")


def create_app(loop: EngineLoop, model_name: str, metrics: ServerMetrics | None = None,
               allowed_origins: tuple[str, ...] = (), trust_request_chat_template: bool = False,
               api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES,
               allowed_hosts: tuple[str, ...] | None = (), reasoning: ReasoningParser | None = None,
               tool_parser: ToolCallParser | None = None) -> FastAPI:
    """allowed_origins: the web origins whose pages may call the API from a browser (CORS; "*" for any). None by
    default: a server on 127.0.0.1 would otherwise answer any web page the user opens. trust_request_chat_template:
    let a request bring its own chat template (vLLM's flag of that name): a template is a program, and one with nested
    loops holds the tokenizer, so every request, for as long as it runs. api_key: the /v1 routes, /tokenize and
    /detokenize answer only requests that bring it (server/access.py). max_request_bytes: a larger body is refused
    (413) before it is read: its JSON is parsed on the event loop, which every stream waits on (a 57 MB body held
    /health for 4 s). allowed_hosts: the Host names answered beside loopback ones (None: any, for a server other
    hosts reach; server/access.py). reasoning: a chat answer's thinking goes to its message's `reasoning` (and
    `reasoning_content`), not its content (server/reasoning.py). tool_parser: a chat request's tools may be called,
    the calls read out of the answer into its message's `tool_calls` (server/tool_calls.py)."""
    engine = loop.engine
    metrics = metrics or ServerMetrics(engine.scheduler, engine.max_draft_len, model_name)
    app = FastAPI(title="dflash-trt", docs_url=None, redoc_url=None)
    unauthorized = APIError(401, "this server needs its API key: send it as the header `Authorization: Bearer KEY`",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
    # added before CORS, which so wraps it: a browser's call refused for its key still reads as a 401
    app.add_middleware(Access, api_key=api_key, unauthorized=lambda: error_response(unauthorized),
                       misdirected=lambda host: error_response(APIError(
                           403, f"this server answers requests for localhost, not for {host[:100]!r} (a page whose "
                                "name was pointed at this machine: DNS rebinding); serve --allowed-host NAME answers "
                                "that name too", code="host_not_allowed")),
                       hosts=allowed_hosts)
    if allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    lanes = PromptLanes(engine.prompt_encoder)  # prompts tokenized off the event loop

    async def tokenized(chars: int, method: str, *args, **kwargs):
        encoder, thread = lanes.lane(chars)
        return await asyncio.get_running_loop().run_in_executor(thread, functools.partial(getattr(encoder, method),
                                                                                          *args, **kwargs))

    async def detokenized(ids: list[int]) -> str:
        """ids' text, decoded on a tokenizer's lane (a body's worth of ids takes seconds: on the big prompts' lane, as
        ids decode to a character or more each, but for special tokens and a character's bytes)."""
        encoder, thread = lanes.lane(len(ids))
        return await asyncio.get_running_loop().run_in_executor(thread, encoder.tokenizer.decode, ids)

    def error_response(e: APIError) -> JSONResponse:
        metrics.errors.labels(str(e.status)).inc()
        # a message may quote what the client sent (a model's name, a field's value): 10 MB came back in a 400
        message = e.message if len(e.message) <= MAX_ERROR_CHARS else e.message[:MAX_ERROR_CHARS] + "... (cut)"
        body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=e.type, param=e.param, code=e.code))
        return JSONResponse(body.model_dump(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error"))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {e}", "server_error"))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not loop.is_alive:
            return error_response(APIError(503, loop.stopped_because, "server_error"))
        return JSONResponse({"status": "ok"})

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    token_text = TokenText(engine.tokenizer)
    card = p.ModelCard(id=model_name, max_model_len=engine.max_model_len)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> JSONResponse:
        return JSONResponse(p.ModelList(data=[card]).model_dump())

    @app.api_route("/v1/models/{name:path}", methods=["GET", "HEAD"])
    async def model(name: str) -> JSONResponse:
        _check_model(name)
        return JSONResponse(card.model_dump())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await _parse(request, p.CompletionRequest)
        _check_model(req.model)
        raw = req.prompts()
        _check_capacity(req, len(raw), "prompt")
        prompts = [await _encode_prompt(x, req.add_special_tokens) for x in raw]
        # echo alone: the prompt's prefill scores it, and the one token generated with it is left out
        submitted = _submit(req, prompts, 1 if req.echo_only else req.max_tokens)
        if req.stream:
            return _sse(_stream_completion(req, submitted))
        outputs = await _wait_all(request, submitted)
        choices = [_completion_choice(i, o, prompt, req.echo, req.echo_only)
                   for i, (o, prompt) in enumerate(zip(outputs, [x for x in raw for _ in range(req.n)]))]
        usage = _usage(outputs, submitted)
        if req.echo_only:
            usage = usage.model_copy(update={"completion_tokens": 0, "total_tokens": usage.prompt_tokens})
        body = p.CompletionResponse(model=model_name, choices=choices, usage=usage)
        return JSONResponse(body.model_dump())

    def _completion_choice(index: int, o: RequestOutput, prompt: str | list[int], echo: bool,
                           echo_only: bool = False) -> p.CompletionChoice:
        """A whole completions choice; with echo, the prompt as sent (token ids decoded) comes before the answer (or
        alone, with echo_only), and with logprobs its tokens are scored before the answer's."""
        echoed = (prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt)) if echo else ""
        logprobs = None
        if o.logprobs is not None:
            answer = [] if echo_only else o.logprobs
            entries = [*(o.prompt_logprobs or []), *answer] if echo else answer
            logprobs = completion_logprobs(entries, token_text, echoed=o.prompt_token_ids if echo else None,
                                           echoed_text=echoed)
        text = echoed + ("" if echo_only else o.text)
        if echo_only:
            return p.CompletionChoice(index=index, text=text, finish_reason="length", logprobs=logprobs)
        return p.CompletionChoice(index=index, text=text, finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                                  acceptance=_acceptance(o), logprobs=logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await _parse(request, p.ChatCompletionRequest)
        _check_model(req.model)
        _check_capacity(req, 1, "messages")
        _check_tools(req)
        ids = await _encode_chat(req)
        await _read_prompt_reasoning(req, ids)
        submitted = _submit(req, [ids], req.max_new_tokens, req.max_tokens_param, prompt_param="messages",
                            prediction=await _prediction_ids(req))
        if req.stream:
            return _sse(_stream_chat(req, submitted))
        outputs = await _wait_all(request, submitted)
        splitters = [_splitter(req) for _ in outputs]
        choices = [_chat_choice(i, o, req, splitter) for i, (o, splitter) in enumerate(zip(outputs, splitters))]
        usage = _usage(outputs, submitted, await _reasoning_tokens(outputs, splitters),
                       await _prediction_counts(outputs, submitted))
        return JSONResponse(p.ChatCompletionResponse(model=model_name, choices=choices, usage=usage).model_dump())

    def _check_tools(req: p.ChatCompletionRequest) -> None:
        if req.calls_tools and tool_parser is None:
            raise APIError(400, "tool calling needs a server started with --tool-call-parser (hermes, qwen3_coder, "
                                'llama3_json, gpt_oss); with tool_choice "none" the template renders the tools and the '
                                "answer is text", param="tools")

    async def _prediction_ids(req: p.ChatCompletionRequest) -> list[int] | None:
        """The tokens of a chat request's predicted output (server/prediction.py), or None where it predicts none;
        APIError where it holds more than the context (no answer could repeat it; its index and its usage count
        would grow with it unbounded)."""
        if req.prediction is None or not req.prediction.text:
            return None
        text, limit = req.prediction.text, engine.max_model_len
        try:
            ids = await tokenized(len(text), "encode", text, add_special_tokens=False)
        except ValueError:  # (past what the server tokenizes: more characters than the context could hold)
            ids = None
        if ids is None or len(ids) > limit:
            size = f"{len(ids)} tokens" if ids is not None else f"{len(text)} characters"
            raise APIError(400, f"the prediction has {size}, more than this model's maximum context length ({limit} "
                                "tokens): no answer could repeat it", param="prediction")
        return ids

    async def _read_prompt_reasoning(req: p.ChatCompletionRequest, ids: list[int]) -> None:
        if reasoning is not None:  # (only deepseek_r1's closes in the prompt: the others read its last tokens)
            prompt = await detokenized(ids if reasoning.starts_thinking else ids[-16:])
            req.prompt_reasoning = "closed" if reasoning.closed_in(prompt) else (
                "opened" if reasoning.opened_by(prompt) else None)

    def _reasoning(req: p.ChatCompletionRequest) -> ReasoningParser | None:
        """The parser of a chat request's answer: the server's, none where the prompt closed the reasoning, reading
        it from the answer's start where the prompt opened it."""
        if req.prompt_reasoning == "closed":
            return None
        return reasoning.opened() if req.prompt_reasoning == "opened" and reasoning is not None else reasoning

    def _harmony_calls(req: p.ChatCompletionRequest) -> bool:
        """Whether the calls tool_choice forces come in harmony's form (gpt-oss's, as it is trained to call), not as
        JSON in its final channel: where the server reads gpt-oss's calls and channels."""
        parser = _reasoning(req)
        if not (req.forces_calls and tool_parser is PARSERS["gpt_oss"] and parser is not None
                and parser.name == "gpt_oss") or req.forced_calls_error():
            return False
        # (a name harmony's recipient cannot hold, "get weather", keeps the JSON form)
        return all(HARMONY_NAME.fullmatch(n) for n in forced_functions(req.template_tools, req.forced_function))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, answered as the chat completion its input makes (server/responses.py)."""
        try:
            req = await _parse(request, p.ChatCompletionRequest, chat_body)
        except ValueError as e:  # what the Responses API has and this server does not do
            raise APIError(400, str(e)) from e
        except APIError as e:
            raise _as_responses(e) from e
        _check_model(req.model)
        _check_tools(req)
        ids = await _encode_chat(req)
        await _read_prompt_reasoning(req, ids)
        try:
            submitted = _submit(req, [ids], req.max_new_tokens, "max_output_tokens", prompt_param="input")
        except APIError as e:
            raise _as_responses(e) from e
        response = ResponseObject(model_name, json.loads(request.state.body), req)
        if req.stream:
            return _sse(_stream_response(req, submitted, response), named=True)
        o = (await _wait_all(request, submitted))[0]
        events = ResponseEvents(response)  # the stream's last event holds the response: the same items, unstreamed
        splitter = _splitter(req)
        events.feed(splitter.parts(o.text, final=True), cut=o.finish_reason == "length")
        usage = await _response_usage(o, submitted, splitter)
        return JSONResponse(events.finish(o.finish_reason, usage)[-1]["response"])

    def _as_responses(e: APIError) -> APIError:
        """An error of the chat request a Responses body became, naming the Responses field (text.format for chat's
        response_format)."""
        if e.param == "response_format":
            e.param, e.message = "text.format", "text.format" + e.message.removeprefix("response_format")
        return e

    async def _response_usage(o: RequestOutput, s: _Submitted, splitter: ChatAnswerSplitter) -> dict:
        reasoned = await _reasoning_tokens([o], [splitter])
        return response_usage(s.prompt_lens[0], o.num_tokens, o.num_cached_tokens, reasoned)

    async def _prediction_counts(outputs: list[RequestOutput], s: _Submitted) -> tuple[int, int] | None:
        """(accepted, rejected) prediction tokens of the answers (server/prediction.py), counted on a tokenizer's lane
        (a diff of two sequences of up to the context's length: off the event loop); None without a prediction."""
        if not s.prediction:
            return None
        _, thread = lanes.lane(len(s.prediction))
        counts = [await asyncio.get_running_loop().run_in_executor(thread, prediction_tokens, s.prediction, o.token_ids)
                  for o in outputs]
        return sum(a for a, _ in counts), sum(r for _, r in counts)

    async def _reasoning_tokens(outputs: list[RequestOutput], splitters: list[ChatAnswerSplitter]) -> int:
        """The answers' tokens of reasoning (ChatAnswerSplitter.reasoning_tokens, each fed whole), counted on a
        tokenizer's lane (a few decodes an answer)."""
        total = 0
        for o, splitter in zip(outputs, splitters):
            if splitter.reasoning_chars:
                encoder, thread = lanes.lane(len(o.token_ids))
                ended_by_token = o.finish_reason == "stop" and not isinstance(o.stop_reason, str)
                total += await asyncio.get_running_loop().run_in_executor(
                    thread, splitter.reasoning_tokens, encoder.tokenizer, o.token_ids, ended_by_token)
        return total

    async def _stream_response(req: p.ChatCompletionRequest, s: _Submitted, response: ResponseObject):
        events, splitter = ResponseEvents(response), _splitter(req)
        for event in events.start():
            yield event
        try:
            async for _, text, out, _, _ in _updates(s):
                cut = out is not None and out.finish_reason == "length"
                for event in events.feed(splitter.parts(text, final=out is not None), cut=cut):
                    yield event
                if out is not None:
                    for event in events.finish(out.finish_reason, await _response_usage(out, s, splitter)):
                        yield event
        except APIError as e:  # the engine failed it mid-stream: the API's error and failed events end the stream
            metrics.errors.labels(str(e.status)).inc()
            for event in events.failed(e.message):
                yield event
        except Exception as e:  # (a client gone is no Exception: it ends the stream as _sse counts it)
            logger.exception("a stream failed")
            metrics.errors.labels("500").inc()
            for event in events.failed(f"internal error: {e}"):
                yield event

    def _chat_choice(index: int, o: RequestOutput, req: p.ChatCompletionRequest,
                     splitter: ChatAnswerSplitter) -> p.ChatChoice:
        thought, content, calls = splitter.split(o.text)
        message = p.AssistantMessage(content=content, reasoning=thought, reasoning_content=thought,
                                     tool_calls=[p.ToolCallOut.of(c) for c in calls] or None)
        return p.ChatChoice(index=index, message=message, finish_reason=_finish_reason(o, req, splitter),
                            stop_reason=o.stop_reason, acceptance=_acceptance(o),
                            logprobs=None if o.logprobs is None else chat_logprobs(o.logprobs, token_text))

    def _splitter(req: p.ChatCompletionRequest) -> ChatAnswerSplitter:
        """A choice's reader of reasoning and of tool calls (where its request's tools may be called)."""
        if req.forces_calls:
            harmony = list(forced_functions(req.template_tools, req.forced_function)) if _harmony_calls(req) else ()
            return ChatAnswerSplitter(_reasoning(req), ForcedCallSplitter(req.forced_function, harmony))
        calls = ToolCallSplitter(tool_parser, req.template_tools, req.call_limit) if req.calls_tools else None
        return ChatAnswerSplitter(_reasoning(req), calls)

    def _finish_reason(o: RequestOutput, req: p.ChatCompletionRequest, splitter: ChatAnswerSplitter) -> str:
        # OpenAI's: an answer that ended by itself after calling tools waits for their answers; one cut short says so
        # (by max_tokens, or by a stop string inside its last call: arguments no client could run); one whose
        # tool_choice named the function "stop"s
        cut = splitter.call_cut and isinstance(o.stop_reason, str)
        called = splitter.num_calls > 0 and req.forced_function is None and not cut
        return "tool_calls" if called and o.finish_reason == "stop" else o.finish_reason

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's: a prompt's or a conversation's token ids, as a completion or a chat completion would count them."""
        req = await _parse(request, p.TokenizeRequest)
        _check_model(req.model)
        if req.messages is not None:
            ids = await _encode_chat(await _parse(request, p.ChatCompletionRequest, p.tokenize_chat_fields))
        else:
            ids = await _encode_prompt(req.prompt, req.add_special_tokens is not False)
        return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                             "token_strs": None})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        req = await _parse(request, p.DetokenizeRequest)
        _check_model(req.model)
        vocab = engine.target.config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens must be in 0..{vocab - 1}, got {bad[:5]}", param="tokens")
        return JSONResponse({"prompt": await detokenized(req.tokens)})

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    # --- request -> engine ------------------------------------------------------------------------

    async def _encode_chat(req: p.ChatCompletionRequest) -> list[int]:
        """The conversation's prompt ids through the chat template (the tokenizer's, or a trusted request's own)."""
        if req.chat_template is not None and not trust_request_chat_template:
            raise APIError(400, "a request's own chat_template runs only on a server started with "
                                "--trust-request-chat-template", param="chat_template")
        try:
            messages = [m.for_template() for m in req.messages]
            return await tokenized(chat_chars(messages, req.template_tools), "encode_chat", messages,
                                   add_generation_prompt=req.add_generation_prompt,
                                   continue_final_message=req.continue_final_message, chat_template=req.chat_template,
                                   template_kwargs=req.template_variables, add_special_tokens=req.add_special_tokens,
                                   tools=req.template_tools)
        except PromptTooLong as e:
            raise APIError(400, str(e), param="messages", code="context_length_exceeded") from e
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from e
        except Exception as e:  # a template that rejects this conversation (roles, order), or the request's own
            if req.chat_template is not None:
                raise APIError(400, f"the request's chat_template failed: {e}", param="chat_template") from e
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from e

    async def _body(request: Request) -> bytes:
        if (read := getattr(request.state, "body", None)) is not None:  # a route that parses it twice (/tokenize)
            return read
        too_big = APIError(413, f"the body is larger than this server takes ({max_request_bytes:,} bytes: serve "
                                "--max-request-mb)")
        try:
            if int(request.headers.get("content-length") or 0) > max_request_bytes:
                raise too_big
            chunks, size = [], 0
            async for chunk in request.stream():  # a chunked body declares no length: counted as it comes
                size += len(chunk)
                if size > max_request_bytes:
                    raise too_big
                chunks.append(chunk)
        except ClientDisconnect as e:  # not a server error: counted and answered (to no one) as the other 499s
            raise APIError(499, "client disconnected while sending its body") from e
        except ValueError as e:  # a Content-Length that is no number
            raise APIError(400, f"invalid Content-Length: {e}") from e
        request.state.body = b"".join(chunks)
        return request.state.body

    async def _parse(request: Request, schema: type[BaseModel], fields: Callable[[dict], dict] | None = None):
        """The body as `schema` (taking only what `fields` picks of it, where given), or the APIError naming what
        in it is wrong."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json" and not kind.endswith("+json"):
            # text/plain, form bodies and bodies of no type (a Blob's) are what a web page may send any server without
            # asking (no CORS preflight): run, they would let any page the user opens make this server generate
            sent = f"not {kind!r}" if kind else "and this request had no Content-Type"
            raise APIError(415, f"the body must be JSON sent as Content-Type: application/json, {sent}")
        raw = await _body(request)
        try:
            data = json.loads(raw)
        # ValueError: a JSONDecodeError, or an integer of more digits than Python converts; RecursionError: too deep
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise APIError(400, f"invalid JSON body: {e}") from e
        if not isinstance(data, dict):
            raise APIError(400, "the JSON body must be an object")
        try:
            return schema.model_validate(fields(data) if fields is not None else data)
        except ValidationError as e:
            err = max(e.errors(), key=_telling)
            # a union's failed branch adds its type to the location ("prompt.str"): name the field alone
            param = ".".join(str(x) for x in err["loc"] if not _is_union_tag(x)) or None
            msg = err["msg"].removeprefix("Value error, ")
            raise APIError(400, f"{param}: {msg}" if param else msg, param=param) from e

    def _check_model(name: str | None) -> None:
        if name and name != model_name:  # vLLM's: an empty or absent name is the served model
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")

    async def _encode_prompt(prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            try:
                return await tokenized(len(prompt), "encode", prompt, add_special_tokens=add_special_tokens)
            except PromptTooLong as e:
                raise APIError(400, str(e), param="prompt", code="context_length_exceeded") from e
        try:  # here too, not only at submit: every prompt of a request is checked before any is queued
            engine.check_prompt_ids(prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from e
        return list(prompt)

    def _check_capacity(req: p._SamplingRequest, num_prompts: int, prompt_param: str) -> None:
        """Before the prompts are tokenized (200,000 of them took a core 56 s before this 400)."""
        capacity = engine.scheduler.capacity
        if num_prompts * req.n > capacity:  # would be refused however long the client waited
            asked = f"{num_prompts} prompt{'s' * (num_prompts > 1)}" + (f" x n={req.n} answers" if req.n > 1 else "")
            raise APIError(400, f"the request has {asked}; this server holds at most {capacity} requests at a time "
                                "(rows plus queue): send fewer per request",
                           param="n" if req.n > 1 else prompt_param)

    def _params(req: p._SamplingRequest, prompt_len: int, max_tokens: int | None, max_param: str,
                prompt_param: str, prediction: list[int] | None = None) -> SamplingParams:
        limit = engine.max_model_len
        if prompt_len == 0:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        if prompt_len >= limit:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this model's maximum context length is {limit} "
                                "tokens, which leaves no room to generate", param=prompt_param,
                           code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = limit - prompt_len
        if max_tokens <= 0:
            raise APIError(400, f"{max_param} must be > 0, got {max_tokens}", param=max_param)
        if prompt_len + max_tokens > limit:
            # vLLM's words (its _validate_input), which clients parse to ask again for what the context leaves
            raise APIError(400, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                                f"maximum context length is {limit} tokens and your request has {prompt_len} input "
                                f"tokens ({max_tokens} > {limit} - {prompt_len}).", param=max_param,
                           code="context_length_exceeded")
        if req.min_tokens > max_tokens:
            raise APIError(400, f"min_tokens ({req.min_tokens}) must be <= {max_param} ({max_tokens})",
                           param="min_tokens")
        vocab = engine.target.config.vocab_size
        stop_ids = None
        if req.stop_token_ids:
            bad = [t for t in req.stop_token_ids if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"stop_token_ids must be in 0..{vocab - 1}, got {bad[:5]}", param="stop_token_ids")
            # vLLM's meaning: in addition to the model's eos ids (unless ignore_eos), where the engine's replaces them
            stop_ids = [*(() if req.ignore_eos else engine.eos_token_ids), *req.stop_token_ids]
        # a top_k of the whole vocabulary or more keeps every token; passed on, a huge one overflows the engine's
        # int64 tensor and fails every request in the step
        top_k = req.top_k if 0 < req.top_k < vocab else 0
        field, structure = _structure(req)
        try:
            params = SamplingParams(max_new_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                                    top_k=top_k, seed=req.seed, stop=req.stop_list, stop_token_ids=stop_ids,
                                    ignore_eos=req.ignore_eos, acceptance=req.acceptance, logprobs=req.num_logprobs,
                                    prompt_logprobs=req.num_logprobs if req.echo else None,
                                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                                    repetition_penalty=req.repetition_penalty, min_tokens=req.min_tokens,
                                    logit_bias=req.biases, allowed_token_ids=req.allowed_token_ids,
                                    min_p=req.min_p, structured=structure, prediction=prediction)
            params.check_token_ids(vocab, engine.eos_token_ids)  # here too, to name the field
        except ParamError as e:
            raise APIError(400, str(e), param=e.param) from e
        except ValueError as e:
            raise APIError(400, str(e)) from e
        return params

    def _structure(req: p._SamplingRequest) -> tuple[str | None, StructuredOutput | None]:
        """(the field that asks for it, what the answer must match), or Nones; APIError naming the field that cannot be
        had."""
        chat = isinstance(req, p.ChatCompletionRequest)
        if chat and req.forces_calls and (why := req.forced_calls_error()):
            raise APIError(400, why, param="tool_choice")
        ways = req.structures()
        if len(ways) > 1:
            raise APIError(400, f"{ways[0][0]} and {ways[1][0]}: an answer takes one structure at a time",
                           param=ways[1][0])
        if not ways:
            return None, None
        field, structure = ways[0]
        if chat and _harmony_calls(req):
            # (harmony's one call a turn, as gpt-oss is trained: "required" is one call; max_tool_calls has no say)
            structure = StructuredOutput(calls=forced_functions(req.template_tools, req.forced_function),
                                         reasoning="gpt_oss")
        elif chat and (parser := _reasoning(req)) is not None:  # the model reasons first; the structure holds the rest
            structure = dataclasses.replace(structure, reasoning=parser.name)
        return field, structure

    def _submit(req: p._SamplingRequest, prompts: list[list[int]], max_tokens: int | None,
                max_param: str = "max_tokens", prompt_param: str = "prompt",
                prediction: list[int] | None = None) -> _Submitted:
        # validate all before queueing any
        params = [_params(req, len(ids), max_tokens, max_param, prompt_param, prediction) for ids in prompts]
        # n answers of each prompt, each sampled with a seed of its own (choice_seed), in OpenAI's order
        params = [sp if j == 0 or sp.seed is None else dataclasses.replace(sp, seed=choice_seed(sp.seed, j))
                  for sp in params for j in range(req.n)]
        prompts = [ids for ids in prompts for _ in range(req.n)]
        updates = LatestUpdates(asyncio.get_running_loop())
        try:  # all at once: the n answers of a prompt share its prefill
            ids = loop.submit_all([(prompt, sp, functools.partial(updates.put, i))
                                   for i, (prompt, sp) in enumerate(zip(prompts, params))])
        except QueueFullError as e:
            raise APIError(503, f"the server is busy: {e}", "server_busy", code="queue_full",
                           headers={"Retry-After": "1"}) from e
        except LoopStopped as e:
            if loop.failure is not None:  # its own bug (logged where it happened): /health says so too
                raise APIError(503, str(e), "server_error", code="engine_failed") from e
            # a kept-alive connection's request during shutdown
            raise APIError(503, "the server is shutting down", "server_error", code="shutting_down") from e
        except GrammarError as e:  # compiled as the request was queued: refused with its reason, nothing queued
            field = _structure(req)[0]
            raise APIError(400, f"{field}: {e}", param=field) from e
        except ValueError as e:
            raise APIError(400, str(e), param=prompt_param) from e
        detoks = [IncrementalDetokenizer(engine.tokenizer, req.stop_list, req.min_tokens) for _ in prompts]
        return _Submitted(ids, [len(x) for x in prompts], updates, detoks, req.n, prediction)

    # --- engine -> response -----------------------------------------------------------------------

    def _finished(update: RequestUpdate) -> RequestOutput:
        if update.error == SHUTTING_DOWN:  # not the server's fault, and said as a request after the stop is
            raise APIError(503, update.error, "server_error", code="shutting_down")
        if update.error is not None or update.output is None:
            raise APIError(500, update.error or "the request ended without output", "server_error")
        return update.output

    async def _wait_all(request: Request, s: _Submitted) -> list[RequestOutput]:
        outputs: list[RequestOutput | None] = [None] * len(s.request_ids)
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            while any(o is None for o in outputs):
                get = asyncio.ensure_future(s.updates.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    raise APIError(499, "client disconnected")
                i, update = get.result()
                if update.finished:
                    outputs[i] = _finished(update)
            return outputs  # type: ignore[return-value]
        finally:
            gone.cancel()
            for i, rid in enumerate(s.request_ids):
                if outputs[i] is None:
                    loop.abort(rid)

    async def _client_gone(request: Request) -> None:
        """Returns when the client closes the connection (the body is already read: nothing else arrives)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def _updates(s: _Submitted):
        """Yield (choice index, text delta, finished output or None, the logprobs of the tokens new since the last,
        the choice's tokens so far) until every choice has finished; abort the unfinished ones if the consumer stops
        early (client disconnect). Logprobs go with the update whose tokens they belong to, even where its text is
        held back."""
        done = [False] * len(s.request_ids)
        sent = [0] * len(s.request_ids)
        try:
            while not all(done):
                i, update = await s.updates.get()
                if update.error is not None:  # first the tokens since the update it replaced, unread (LatestUpdates)
                    try:
                        text = s.detoks[i].delta(update.token_ids, None)
                    except Exception:  # (a failure to detokenize may be the error itself): the error is what counts
                        text = ""
                    new, sent[i] = update.logprobs[sent[i]:], max(sent[i], len(update.logprobs))
                    if text or new:
                        yield i, text, None, new, len(update.token_ids)
                out = _finished(update) if update.finished else None
                done[i] = update.finished
                text = s.detoks[i].delta(update.token_ids, out.text if out is not None else None)
                new, sent[i] = update.logprobs[sent[i]:], max(sent[i], len(update.logprobs))
                if text or out is not None or new:
                    yield i, text, out, new, out.num_tokens if out is not None else len(update.token_ids)
        finally:
            for i, rid in enumerate(s.request_ids):
                if not done[i]:
                    loop.abort(rid)

    async def _stream_completion(req: p.CompletionRequest, s: _Submitted):
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        usage, no_usage, continuous = _include_usage(req)
        outputs: list[RequestOutput | None] = [None] * len(s.request_ids)  # by choice: _usage reads each prompt's first
        offsets = [TextOffsets(token_text) for _ in s.request_ids]  # where each choice's next token starts
        async for i, text, out, new, tokens in _updates(s):
            logprobs = completion_logprobs(new, token_text, offsets[i]) if req.num_logprobs is not None else None
            choice = p.CompletionChoice(index=i, text=text, finish_reason=out.finish_reason if out else None,
                                        stop_reason=out.stop_reason if out else None,
                                        acceptance=_acceptance(out) if out else None, logprobs=logprobs)
            chunk = p.CompletionResponse(id=rid, created=created, model=model_name, choices=[choice],
                                         usage=_choice_usage(s, i, tokens) if continuous else None)
            if out is not None:
                outputs[i] = out
            yield chunk.model_dump(exclude=no_usage)
        if usage:
            yield p.CompletionResponse(id=rid, created=created, model=model_name, choices=[],
                                       usage=_usage(outputs, s)).model_dump()

    async def _stream_chat(req: p.ChatCompletionRequest, s: _Submitted):
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        usage, no_usage, continuous = _include_usage(req)
        outputs: list[RequestOutput | None] = [None] * len(s.request_ids)  # by choice: _usage reads each prompt's first
        started = set()
        splitters = [_splitter(req) for _ in s.request_ids]
        calls_begun = [0] * len(s.request_ids)  # by choice
        async for i, text, out, new, tokens in _updates(s):
            if i not in started:
                # each choice's role with its first output, as vLLM's: benchmark clients time the first token from the
                # first chunk
                started.add(i)
                first = p.ChatChunkChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))
                yield p.ChatCompletionChunk(id=rid, created=created, model=model_name, choices=[first],
                                            usage=_choice_usage(s, i, 0) if continuous else None
                                            ).model_dump(exclude=no_usage)
            parts = splitters[i].parts(text, final=out is not None)
            thought, text = ("".join(v for k, v in parts if k == kind) for kind in ("reasoning", "content"))
            calls = _call_deltas(parts, calls_begun, i)
            if not (thought or text or calls or out is not None or new):  # all of it held back (a tag beginning)
                continue
            delta = p.DeltaMessage(content=text or None, reasoning=thought or None, reasoning_content=thought or None,
                                   tool_calls=calls or None)
            choice = p.ChatChunkChoice(index=i, delta=delta,
                                       finish_reason=_finish_reason(out, req, splitters[i]) if out else None,
                                       stop_reason=out.stop_reason if out else None,
                                       acceptance=_acceptance(out) if out else None,
                                       logprobs=chat_logprobs(new, token_text) if req.num_logprobs is not None else None)
            chunk = p.ChatCompletionChunk(id=rid, created=created, model=model_name, choices=[choice],
                                          usage=_choice_usage(s, i, tokens) if continuous else None)
            if out is not None:
                outputs[i] = out
            yield chunk.model_dump(exclude=no_usage)
        if usage:
            yield p.ChatCompletionChunk(id=rid, created=created, model=model_name, choices=[],
                                        usage=_usage(outputs, s, await _reasoning_tokens(outputs, splitters),
                                                     await _prediction_counts(outputs, s))).model_dump()

    def _call_deltas(parts: list[tuple[str, Any]], begun: list[int], choice: int) -> list[p.DeltaToolCall]:
        """A chunk's tool-call deltas: each call begun in it (whole, or its first delta), and the pieces of the
        arguments of a call streamed as they come (with its first delta where they come in one chunk)."""
        out: list[p.DeltaToolCall] = []
        for kind, value in parts:
            if kind in ("call", "call_opened"):
                out.append(p.DeltaToolCall.of(value, index=begun[choice]))
                begun[choice] += 1
            elif kind == "arguments" and out and out[-1].index == begun[choice] - 1:
                out[-1].function.arguments += value
            elif kind == "arguments":
                out.append(p.DeltaToolCall(index=begun[choice] - 1, function=p.DeltaFunction(arguments=value)))
        return out

    def _include_usage(req: p._SamplingRequest) -> tuple[bool, set[str] | None, bool]:
        """Whether a stream ends with a usage chunk, what its other chunks leave out (OpenAI's carry `"usage": null`
        when usage was asked for, and no usage key otherwise), and whether they carry their choice's usage so far
        (vLLM's continuous_usage_stats, which counts only with include_usage)."""
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return usage, None if usage else {"usage"}, usage and req.stream_options.continuous_usage_stats

    def _choice_usage(s: _Submitted, i: int, tokens: int) -> p.Usage:
        return p.Usage(prompt_tokens=s.prompt_lens[i], completion_tokens=tokens, total_tokens=s.prompt_lens[i] + tokens)

    def _sse(chunks, named: bool = False) -> StreamingResponse:
        """named: each event's type on an `event:` line too, as the Responses API sends its events."""
        async def events():
            try:
                async for chunk in chunks:
                    yield (f"event: {chunk['type']}\n" if named else "") + f"data: {json.dumps(chunk)}\n\n"
            except APIError as e:  # the engine failed this request mid-stream: say so, then end the stream
                yield _error_event(e)
            except (asyncio.CancelledError, GeneratorExit):  # the client went away mid-stream: a 499, as unstreamed
                metrics.errors.labels("499").inc()
                raise
            except Exception as e:  # this server's own bug: said, as unstreamed (a 500), not a cut connection
                logger.exception("a stream failed")
                yield _error_event(APIError(500, f"internal error: {e}", "server_error"))
            if not named:  # (the Responses API's streams end with their last event)
                yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def _error_event(e: APIError) -> str:
        metrics.errors.labels(str(e.status)).inc()
        err = p.ErrorResponse(error=p.ErrorInfo(message=e.message, type=e.type, code=e.code))
        return f"data: {json.dumps(err.model_dump())}\n\n"

    def _acceptance(out: RequestOutput) -> p.AcceptanceStats | None:
        if engine.drafter is None:
            return None
        drafted = out.total_draft_tokens
        accepted = out.total_accepted_draft_tokens
        steps = len(out.acceptance_lengths)
        # no speculative step (one-token answers, adaptive plain steps only): no figure rather than a made-up 0
        return p.AcceptanceStats(
            tau=out.tau if steps else None, num_steps=steps, acceptance_histogram=out.acceptance_histogram,
            total_draft_tokens=drafted, total_accepted_draft_tokens=accepted,
            acceptance_rate=accepted / drafted if drafted else None,
            draft_time_s=out.draft_time, verify_time_s=out.verify_time,
        )

    def _usage(outputs: list[RequestOutput], s: _Submitted, reasoning_tokens: int | None = None,
               predicted: tuple[int, int] | None = None) -> p.Usage:
        """outputs: in choice order, n answers a prompt (the first of each reports the prompt's reuse).
        reasoning_tokens: a chat request's (None for completions, whose usage has no completion_tokens_details);
        predicted: its accepted and rejected prediction tokens, where it predicted its output."""
        prompt = sum(s.prompt_lens[:: s.n])  # each prompt once, however many answers it got (OpenAI's count)
        completion = sum(o.num_tokens for o in outputs)
        cached = p.PromptTokensDetails(cached_tokens=sum(o.num_cached_tokens for o in outputs[:: s.n]))
        details = None if reasoning_tokens is None else p.CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
        if details is not None and predicted is not None:
            details.accepted_prediction_tokens, details.rejected_prediction_tokens = predicted
        return p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=cached, completion_tokens_details=details)

    return app
