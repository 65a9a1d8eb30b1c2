"""OpenAI-compatible request and response schemas (OpenAI field names unchanged; no torch).

Extensions beyond OpenAI, in the vLLM spelling where one exists: `top_k`, `ignore_eos`, `stop_token_ids`,
`min_tokens`, `min_p`, `allowed_token_ids`, `repetition_penalty`, the chat template's
`add_generation_prompt`, `continue_final_message`, `chat_template` and `chat_template_kwargs`, and `acceptance` (the
lossless sampling rule) on requests; per-choice `acceptance` statistics (tau, histogram, draft and accepted counts) on
responses. vLLM's other sampling extensions are refused unless neutral, as are OpenAI features this server lacks.
"""

from __future__ import annotations

import functools
import inspect
import json
import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, StrictBool,
                      StrictFloat, StrictInt, ValidationInfo, field_validator, model_serializer, model_validator)

from dflash_trt.sampling_params import MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, check_stop_strings, is_int
from dflash_trt.server.structured import (GUIDED_FIELDS, forced_call_schema, from_guided, from_response_format,
                                          from_structured_outputs)
from dflash_trt.structured_output import StructuredOutput


def _whole(v: Any) -> Any:
    return int(v) if isinstance(v, float) and v.is_integer() else v


# An integer, or a float that is one (16.0: JavaScript clients and vLLM's lax parsing); never a string or a bool
WholeInt = Annotated[StrictInt, BeforeValidator(_whole)]


def _unicode(v: str) -> str:
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:  # JSON's \ud800 escapes decode to lone surrogates, which no tokenizer takes
        raise ValueError(f"not valid Unicode text: a lone surrogate {v[e.start]!r} at character {e.start}") from None
    return v


# Text a tokenizer can take: a JSON string with no lone surrogate
Text = Annotated[str, AfterValidator(_unicode)]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# null here means "no limit" (up to the context), as vLLM reads it, not the completions default of 16
_NULL_MEANS_NONE = frozenset({"max_tokens", "max_completion_tokens"})


def _null_is_unset(data: Any) -> Any:
    """OpenAI clients send `null` for a field they leave unset: take the default, as OpenAI does."""
    if not isinstance(data, dict):
        return data
    return {k: v for k, v in data.items() if v is not None or k in _NULL_MEANS_NONE}


def _refuse_set(*fields: str, message: str):
    """A validator for OpenAI fields this server does not implement: unset, null, false, 0 or empty pass; anything
    else is refused with `message`, rather than silently ignored."""
    def refuse(cls, v: Any) -> Any:
        if v:
            raise ValueError(message)
        return v

    return field_validator(*fields)(classmethod(refuse))


def _refuse_unless(field: str, neutral: Any, message: str):
    """A validator for a vLLM sampling extension this server does not implement: only its neutral value passes."""
    def refuse(cls, v: Any) -> Any:
        if v != neutral:
            raise ValueError(message)
        return v

    return field_validator(field)(classmethod(refuse))


class _NullIsUnset(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _null_is_unset(data)


class StreamOptions(_NullIsUnset):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: with include_usage, every chunk carries its choice's usage


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")  # what else a client says of it (strict, ...) reaches the template

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDefinition


class _SamplingRequest(_NullIsUnset):
    # Unknown OpenAI fields (user, metadata ...) are accepted and ignored, as OpenAI servers do; those that would
    # change the answer's content or shape and are not implemented (tools, ...) are refused
    # below rather than silently dropped. Numbers and booleans are strict: "5" or true is no max_tokens.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # vLLM's: absent or null is the served model (OpenAI requires it)
    temperature: StrictFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0)
    n: WholeInt = Field(1, ge=1)  # answers per prompt (the server's rows plus queue bound them)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: WholeInt | None = None
    echo: StrictBool = False  # completions: the prompt before the answer (and its logprobs); refused on chat
    presence_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, StrictFloat | StrictInt] | None = None  # token id (as a string) -> bias in [-100, 100]
    # structured output (server/structured.py): one of response_format, vLLM's guided_* and structured_outputs (and
    # chat's tool_choice where it forces calls)
    response_format: dict[str, Any] | None = None
    tool_choice: Any = None  # before tools, whose validator reads it
    function_call: Any = None  # the deprecated spelling of tool_choice
    tools: list[Tool] | None = None  # chat's: read by the chat template, called where a tool-call parser serves
    functions: list[FunctionDefinition] | None = None  # the deprecated spelling of tools: rendered, never called
    parallel_tool_calls: StrictBool = True  # false: only an answer's first call is returned
    # extensions
    top_k: WholeInt = Field(0, ge=-1)  # 0 or -1: no top-k
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None  # vLLM's: stop at these ids as well as at the model's eos
    min_tokens: WholeInt = Field(0, ge=0)  # vLLM's; checked against max_tokens and stop in the app
    min_p: StrictFloat = Field(0.0, ge=0.0, le=1.0)  # vLLM's
    acceptance: Literal["match", "rejection"] = "match"
    # vLLM extensions clients send (benchmark tools' --extra-body) that would change the answer: refused unless
    # neutral, rather than ignored as unknown fields are
    repetition_penalty: StrictFloat = Field(1.0, gt=0.0, allow_inf_nan=False)  # vLLM's
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    use_beam_search: StrictBool = False
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[Annotated[WholeInt, Field(ge=0)]] | None = Field(None, min_length=1)
    logits_processors: list[Any] | None = None
    truncate_prompt_tokens: Any = None
    prompt_logprobs: Any = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, v: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # as OpenAI and vLLM: set without stream it would ask for a usage chunk that never comes
        if v is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed with stream=true")
        return v

    @field_validator("stop")
    @classmethod
    def _sendable_stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        check_stop_strings([v] if isinstance(v, str) else v or [])  # (their count past the limit: max_length's words)
        return v

    @field_validator("logit_bias")
    @classmethod
    def _biases_of_token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            # ASCII digits only ("²" and "٣" are digits to isdigit, and not int's), and few of them (no vocabulary
            # holds ids of more than ten digits; int() refuses over 4,300)
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"keys must be token ids, got {key[:20]!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    @property
    def biases(self) -> dict[int, float] | None:
        return {int(k): float(b) for k, b in self.logit_bias.items()} if self.logit_bias else None

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            from_response_format(v)
        return v

    @field_validator(*GUIDED_FIELDS)
    @classmethod
    def _guided(cls, v: Any, info: ValidationInfo) -> Any:
        if v is not None:
            from_guided(info.field_name, v)
        return v

    @field_validator("structured_outputs")
    @classmethod
    def _structured_outputs(cls, v: Any) -> Any:
        if v is not None:
            from_structured_outputs(v)
        return v

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        named = isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) and \
            isinstance(v["function"].get("name"), str)
        if v not in (None, "none", "auto", "required") and not named:
            raise ValueError('must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
                             f"got {v!r:.80}")
        return v

    @field_validator("function_call")
    @classmethod
    def _function_call_unforced(cls, v: Any) -> Any:
        if v not in (None, "none", "auto"):
            raise ValueError(f'{v!r:.80}: the deprecated functions are rendered only; send tools, with tool_choice')
        return v

    def structures(self) -> list[tuple[str, StructuredOutput]]:
        """(field, what the answer must match) for each field that asks for a structure (the app takes one)."""
        out = [(f, from_guided(f, getattr(self, f))) for f in GUIDED_FIELDS if getattr(self, f) is not None]
        if self.structured_outputs is not None:
            out.append(("structured_outputs", from_structured_outputs(self.structured_outputs)))
        if self.response_format is not None and (spec := from_response_format(self.response_format)):
            out.append(("response_format", spec))
        return out

    @field_validator("tools", "functions")
    @classmethod
    def _tools_for_chat(cls, v: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        if v and not cls.reads_tools:
            raise ValueError(f"{info.field_name} are for chat completions, whose template renders them")
        if v and info.field_name == "functions" and info.data.get("function_call") != "none":
            # its answers would come in the message's function_call, a form this server does not write
            raise ValueError('the deprecated functions are rendered only, with function_call "none": send tools for '
                             "the model to call")
        return v

    reads_tools: ClassVar[bool] = False  # whether tools reach a chat template

    _no_stop_str = _refuse_set("include_stop_str_in_output", message="include_stop_str_in_output is not supported")
    _no_beam_search = _refuse_set("use_beam_search", message="beam search is not supported")
    _no_vocab_limits = _refuse_set("bad_words", "logits_processors",
                                   message="bad_words and logits_processors are not supported (they would change the "
                                   "target's distribution)")
    _no_truncation = _refuse_set("truncate_prompt_tokens", message="truncate_prompt_tokens is not supported")

    @field_validator("prompt_logprobs")
    @classmethod
    def _no_prompt_logprobs(cls, v: Any) -> Any:
        if v is not None and v is not False:  # vLLM's 0 asks for the prompt's own logprobs: not "off"
            raise ValueError("prompt_logprobs are not supported (completions' echo with logprobs scores the prompt)")
        return v

    _skip_special = _refuse_unless("skip_special_tokens", True, "skip_special_tokens=false is not supported: answers "
                                   "are decoded without special tokens")

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingRequest):
    prompt: Text | list[StrictInt] | list[Text] | list[list[StrictInt]]
    max_tokens: WholeInt | None = 16
    # how many alternatives each token's logprobs list (0: the token's own only); false or null: no logprobs
    logprobs: StrictBool | WholeInt | None = None
    top_logprobs: StrictInt | None = None  # chat's field: refused here, where logprobs holds the count
    best_of: WholeInt | None = None
    suffix: str | None = None
    add_special_tokens: StrictBool = True  # vLLM's: the tokenizer's own (a BOS) before a text prompt

    @field_validator("prompt", mode="before")
    @classmethod
    def _some_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("the prompt is empty")
        ok = isinstance(v, str) or isinstance(v, list) and (
            all(isinstance(x, str) for x in v) or all(is_int(x) for x in v)
            or all(isinstance(x, list) and all(is_int(t) for t in x) for x in v))
        if not ok:
            raise ValueError("the prompt must be a string, a list of strings, a list of token ids or a list of lists "
                             "of token ids")
        return v

    @field_validator("logprobs")
    @classmethod
    def _logprobs_count(cls, v: bool | int | None) -> bool | int | None:
        # 0 is not "off": OpenAI then still returns each sampled token's logprob
        if v is True or isinstance(v, int) and not isinstance(v, bool) and not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs is how many alternatives to list per token, 0..{MAX_TOP_LOGPROBS}; got {v}")
        return v

    _no_top_logprobs = _refuse_set("top_logprobs", message="top_logprobs is chat's field; completions take the "
                                   "count as logprobs")

    @property
    def num_logprobs(self) -> int | None:
        """The alternatives each token lists, or None for no logprobs."""
        return None if self.logprobs is None or self.logprobs is False else self.logprobs

    @field_validator("echo")
    @classmethod
    def _echo_whole(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("stream"):
            raise ValueError("echo is supported without stream")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if v not in (None, n):  # best_of == n returns every answer made: n's own meaning
            raise ValueError(f"only best_of=n ({n}) is supported, got {v}")
        return v

    _no_suffix = _refuse_set("suffix", message="suffix (insertion) is not supported")

    @property
    def echo_only(self) -> bool:
        """vLLM's echo without generation: the prompt (and its logprobs) alone, as scoring harnesses ask for it."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    type: Literal["text"]
    text: Text


# the text parts vLLM reads as text (renderers/chat_utils.py TEXT_PART_TYPES, less its "thinking"), by their text field
_TEXT_PART_FIELDS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def _as_text_part(part: Any) -> Any:
    """A plain string, or a text part of another name (the Responses API's), as a {"type": "text"} part."""
    if isinstance(part, str):
        return {"type": "text", "text": part}
    if isinstance(part, dict) and part.get("type") in _TEXT_PART_FIELDS:
        return {"type": "text", "text": part.get(_TEXT_PART_FIELDS[part["type"]])}
    return part


class Prediction(BaseModel):
    """OpenAI's predicted output (server/prediction.py): text the answer is expected to repeat much of."""
    model_config = ConfigDict(extra="ignore")

    type: Literal["content"]
    content: Text | list[Annotated[ContentPart, BeforeValidator(_as_text_part)]]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI's: a JSON string


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # not JSON: the template gets the string as sent
        call = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        return {"id": self.id, **call} if self.id is not None else call


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # "function": OpenAI's deprecated form of "tool" (a function's answer, named by `name`), still sent by clients
    role: Literal["system", "user", "assistant", "developer", "tool", "function"]
    content: Text | list[ContentPart] | None = Field(default=None, validate_default=True)  # checked when absent too
    # a conversation's history of tool use (an assistant's calls, a tool's answer to one), rendered by the template
    tool_calls: list[ToolCall] | None = None
    function_call: CalledFunction | None = None  # the deprecated form of one tool call
    tool_call_id: str | None = None
    name: str | None = None
    # an assistant's reasoning as a reasoning parser answered it (vLLM's name, DeepSeek's): Qwen3's and gpt-oss's
    # templates render it in a tool-calling turn (transformers passes it as gpt-oss's `thinking` too), others drop it
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            v = [_as_text_part(part) for part in v]
            kinds = {part.get("type") if isinstance(part, dict) else type(part).__name__ for part in v} - {"text"}
            if kinds:
                raise ValueError(f"only text content parts are supported, got {sorted(map(str, kinds))}")
        return v

    @field_validator("content")
    @classmethod
    def _content_unless_assistant(cls, v: Any, info: ValidationInfo) -> Any:
        # OpenAI's schema: only an assistant's message may come without content (where it made tool calls)
        if v is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"a {info.data['role']} message needs content")
        return v

    @model_validator(mode="after")
    def _function_answer_named(self) -> "ChatMessage":
        if self.role == "function" and not self.name:
            raise ValueError("a function message needs the name of the function that answered")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # vLLM's joint

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it: its text, and its tool use where it has some (a call's arguments
        as an object, as vLLM passes them: templates write them out as JSON)."""
        # templates know tool calls and tool answers only: the deprecated forms are rendered as what they are (a
        # function's answer as a tool's, which a Llama or Mistral template would refuse, and a Qwen one drop)
        out: dict[str, Any] = {"role": "tool" if self.role == "function" else self.role, "content": self.text()}
        calls = self.tool_calls or ([ToolCall(function=self.function_call)] if self.function_call else [])
        if calls:
            out["tool_calls"] = [call.for_template() for call in calls]
        out |= {k: v for k, v in (("tool_call_id", self.tool_call_id), ("name", self.name)) if v is not None}
        if (thought := self.reasoning if self.reasoning is not None else self.reasoning_content) is not None:
            out["reasoning_content"] = thought  # the name templates read (Qwen3's)
        return out


@functools.cache
def template_call_parameters() -> frozenset[str]:
    """apply_chat_template's own parameters, which chat_template_kwargs may not pass to it: read from the installed
    transformers (a list written here missed those a release added, such as sanitize_control_tokens)."""
    from transformers import PreTrainedTokenizerBase

    return frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) | {"messages"}


# OpenAI's reasoning_effort (chat) and reasoning.effort (Responses): the chat template's variable reasoning_effort
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: WholeInt | None = None
    max_completion_tokens: WholeInt | None = None
    logprobs: StrictBool = False
    top_logprobs: WholeInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's chat template extensions
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # go on with the last (assistant) message instead of a new turn
    add_special_tokens: StrictBool = False  # vLLM's: the tokenizer's own too (the template writes its BOS itself)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. Qwen3's enable_thinking
    # OpenAI's: gpt-oss's template writes it in its system message ("Reasoning: low"); templates that read no such
    # variable leave it out, as OpenAI's models without reasoning do
    reasoning_effort: ReasoningEffort | None = None
    prediction: Prediction | None = None  # OpenAI's predicted outputs: drafted where the answer repeats it
    max_tool_calls: WholeInt | None = Field(None, ge=0)  # the Responses API's: an answer's first calls only
    reads_tools: ClassVar[bool] = True
    # OpenAI's audio output: the answer would carry an audio object, which this server never makes
    modalities: list[Any] | None = None
    audio: Any = None
    _prompt_reasoning: Literal["closed", "opened"] | None = PrivateAttr(default=None)

    @property
    def prompt_reasoning(self) -> Literal["closed", "opened"] | None:
        """What the prompt the server made of it leaves of the model's reasoning: "closed" (ReasoningParser.closed_in:
        the answer is all content), "opened" (ReasoningParser.opened_by: the answer is reasoning from its start) or
        None (the answer's own to open)."""
        return self._prompt_reasoning

    @prompt_reasoning.setter
    def prompt_reasoning(self, state: Literal["closed", "opened"] | None) -> None:
        self._prompt_reasoning = state

    _no_echo = _refuse_set("echo", message="echo is supported on /v1/completions, not on chat")
    _no_audio = _refuse_set("audio", message="audio output is not supported (this server answers in text)")

    @field_validator("modalities")
    @classmethod
    def _text_answers(cls, v: list[Any] | None) -> list[Any] | None:
        if v and v != ["text"]:
            raise ValueError(f"only the text modality is supported, got {v}")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # apply_chat_template's own parameters would change what it returns, or override the request's fields
        taken = sorted(set(v or ()) & template_call_parameters())
        if taken:
            raise ValueError(f"{', '.join(taken)} are not template variables (the server sets them)")
        return v

    @field_validator("continue_final_message")
    @classmethod
    def _continue_or_new_turn(cls, v: bool, info: ValidationInfo) -> bool:
        if v and info.data.get("add_generation_prompt"):
            raise ValueError("it continues the last message, where add_generation_prompt (true by default) opens a new "
                             "turn: set add_generation_prompt=false")
        messages = info.data.get("messages")
        if v and messages and messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs an assistant message last")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):  # OpenAI's rule
            raise ValueError("top_logprobs needs logprobs=true")
        return v

    @property
    def template_variables(self) -> dict[str, Any]:
        """What the chat template reads beside the conversation and tools: chat_template_kwargs, and reasoning_effort
        where chat_template_kwargs do not say it (as vLLM passes it)."""
        effort = {} if self.reasoning_effort is None else {"reasoning_effort": self.reasoning_effort}
        return effort | (self.chat_template_kwargs or {})

    @property
    def num_logprobs(self) -> int | None:
        """The alternatives each token lists, or None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_tokens_param(self) -> str:
        """The field the output limit came from, for errors that name it."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them (OpenAI's shape; functions become tools), or None."""
        functions = [*(t.function for t in self.tools or ()), *(self.functions or ())]
        return [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in functions] or None

    @property
    def call_limit(self) -> int | None:
        """How many of an answer's calls are returned (its first), or None for all."""
        limits = [n for n in (None if self.parallel_tool_calls else 1, self.max_tool_calls) if n is not None]
        return min(limits) if limits else None

    @property
    def calls_tools(self) -> bool:
        """Whether the model may call the request's tools (OpenAI's default where tools are sent: "auto")."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    @property
    def forced_function(self) -> str | None:
        """The function a named tool_choice makes the answer call, or None."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

    @property
    def forces_calls(self) -> bool:
        """Whether tool_choice makes the answer a call (named) or calls ("required"): JSON a grammar holds it to."""
        return self.tool_choice == "required" or self.forced_function is not None

    def forced_calls_error(self) -> str | None:
        """Why the calls tool_choice forces cannot be made, or None."""
        if not self.tools:
            return f"tool_choice {self.tool_choice!r:.80} needs tools to call"
        names = [t.function.name for t in self.tools]
        if self.forced_function is not None and self.forced_function not in names:
            return f"tool_choice names {self.forced_function!r:.80}, which is none of the tools ({names})"
        if self.call_limit == 0:
            return f"tool_choice {self.tool_choice!r:.80} makes a call, and max_tool_calls 0 allows none"
        return None

    def structures(self) -> list[tuple[str, StructuredOutput]]:
        forced = []
        if self.forces_calls and self.forced_calls_error() is None:
            schema = forced_call_schema(self.template_tools, self.forced_function, self.call_limit)
            forced = [("tool_choice", StructuredOutput(json=schema))]
        return forced + super().structures()


class TokenizeRequest(_NullIsUnset):
    """vLLM's /tokenize: a completions prompt, or a conversation (read as a chat completion's messages and template
    fields)."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: Text | None = None
    messages: list[Any] | None = None
    add_special_tokens: StrictBool | None = None  # as the route the prompt or messages are for reads it by default

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send a prompt or messages, one of them")
        return self


# What vLLM's TokenizeChatRequest reads of a body: the conversation and how its template renders it
TOKENIZE_CHAT_FIELDS = ("model", "messages", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                        "chat_template", "chat_template_kwargs", "reasoning_effort", "tools")


def tokenize_chat_fields(body: dict) -> dict:
    """A /tokenize body as the chat completion whose prompt it counts: its sampling fields are not read, and its tools
    are rendered, never called."""
    picked = {k: body[k] for k in TOKENIZE_CHAT_FIELDS if k in body}
    return (picked | {"tool_choice": "none"}) if picked.get("tools") else picked


class DetokenizeRequest(_NullIsUnset):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[WholeInt]


class AcceptanceStats(BaseModel):
    """Speculative-decoding statistics of one request (names as in TensorRT-LLM's Triton model)."""

    tau: float | None  # mean tokens committed per step, counting the bonus token; None without a step
    num_steps: int
    acceptance_histogram: list[int]  # [i] = steps that committed i + 1 tokens
    total_draft_tokens: int
    total_accepted_draft_tokens: int
    acceptance_rate: float | None  # accepted / drafted; None without a draft
    draft_time_s: float
    verify_time_s: float


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V another request's cache row held (not computed again)


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int  # the answers' tokens of reasoning, its tags included (a reasoning parser's split)
    # OpenAI's, where the request predicted its output: the prediction's tokens each answer repeated, and the rest
    accepted_prediction_tokens: int | None = Field(default=None, exclude_if=lambda v: v is None)
    rejected_prediction_tokens: int | None = Field(default=None, exclude_if=lambda v: v is None)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # OpenAI's; on a request's final usage
    # OpenAI's, on a chat request's final usage (a completion's has none)
    completion_tokens_details: CompletionTokensDetails | None = Field(default=None, exclude_if=lambda v: v is None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id (not eos) that ended it
    logprobs: CompletionLogprobs | None = None
    acceptance: AcceptanceStats | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CalledFunctionOut(BaseModel):
    name: str
    arguments: str  # a JSON object


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunctionOut

    @classmethod
    def of(cls, call: Any, **fields: Any) -> "ToolCallOut":
        """From a tool-call parser's FunctionCall."""
        return cls(id=call.id, function=CalledFunctionOut(name=call.name, arguments=call.arguments), **fields)


class DeltaFunction(BaseModel):
    name: str | None = None  # (a call's first delta names it)
    arguments: str


class DeltaToolCall(BaseModel):
    """A stream's delta of one call: the call whole, or its first delta (id, name, arguments so far) and then the
    next pieces of its arguments (where they come as the model writes them: server/chat_answer.py)."""
    index: int  # the call's place among its choice's calls
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    @classmethod
    def of(cls, call: Any, index: int) -> "DeltaToolCall":
        """A tool-call parser's FunctionCall, with its arguments so far."""
        return cls(index=index, id=call.id, type="function",
                   function=DeltaFunction(name=call.name, arguments=call.arguments))

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        out = {k: v for k, v in handler(self).items() if v is not None}
        out["function"] = {k: v for k, v in out["function"].items() if v is not None}
        return out


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    # None: the answer reasoned and said nothing after, ended inside its reasoning, or made calls and said nothing
    content: str | None
    # a reasoning parser's: under vLLM's name and DeepSeek's and TensorRT-LLM's (clients read one or the other)
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | None = None  # a tool-call parser's

    @model_serializer(mode="wrap")
    def _omit_unsplit(self, handler: Any) -> dict[str, Any]:
        # a server without a reasoning parser, or an answer without calls, answers as before: without their keys
        out = handler(self)
        if out["reasoning"] is None:
            del out["reasoning"], out["reasoning_content"]
        if out["tool_calls"] is None:
            del out["tool_calls"]
        return out


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id (not eos) that ended it
    logprobs: ChatLogprobs | None = None
    acceptance: AcceptanceStats | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # a reasoning parser's, as AssistantMessage's
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler: Any) -> dict[str, Any]:
        # OpenAI's deltas leave out what they do not carry (the last is often `{}`): its role is never null
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id (not eos) that ended it
    logprobs: ChatLogprobs | None = None
    acceptance: AcceptanceStats | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "dflash-trt"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
