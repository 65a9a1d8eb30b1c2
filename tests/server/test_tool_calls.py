"""serve --tool-call-parser: the calls a chat answer writes come back in its message's `tool_calls` (OpenAI's shape),
the text around them in `content`, the same whether it is streamed (in any deltas) or not."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dflash_trt.sampling_params import SamplingParams
from dflash_trt.server.chat_answer import ChatAnswerSplitter
from dflash_trt.server.reasoning import PARSERS as REASONING_PARSERS
from dflash_trt.server.tool_calls import (CALL_START, HARMONY_STARTS, PARSERS, PYTHON_TAG, ClosedCall,
                                         ForcedCallSplitter, ToolCallSplitter, tool_call_parser)
from tests.server.conftest import (ANSWER, CALLS, QUESTION, QWEN3_5_TEMPLATE, QWEN3_TEMPLATE, TOOLS,
                                  start_server)

_json = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False,
                                                                                         allow_infinity=False)
                     | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8)
_names = st.from_regex(r"[a-z_][a-z0-9_]{0,11}", fullmatch=True)
# text around calls, near the tags: their characters and beginnings, whole closing ones (which mean nothing outside a
# call), never a whole opening one
_said = st.lists(st.sampled_from(["<", "tool", "_call", "<tool_", "<tool_call", "</tool_call>", ">", "{", "}", " ",
                                  "\n", "é", "word", '"name"']), max_size=12).map("".join).filter(
    lambda s: CALL_START not in s)


def _hermes(name: str, arguments: dict, draw) -> str:
    body = {"name": name, draw(st.sampled_from(["arguments", "parameters"])): arguments}
    text = json.dumps(body, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 2])))
    pad = st.sampled_from(["", "\n", " \n"])
    return f"{CALL_START}{draw(pad)}{text}{draw(pad)}</tool_call>"


# qwen3_coder's parameters: (schema type, value, as the model writes it)
_typed_values = st.one_of(
    st.tuples(st.just("string"), st.text(st.sampled_from('ab"\\\n\t<>/é\x00') | st.characters(
        blacklist_categories=["Cs"]), max_size=12).filter(lambda s: "</parameter>" not in s)).map(lambda t: (*t, t[1])),
    st.integers(-10**9, 10**9).map(lambda v: ("integer", v, str(v))),
    st.booleans().map(lambda v: ("boolean", v, json.dumps(v))),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda v: ("number", v, json.dumps(v))),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3).map(lambda v: ("object", v, json.dumps(v))),
    st.lists(st.text(max_size=4), max_size=3).map(lambda v: ("array", v, json.dumps(v))),
)


def _coder(name: str, params: dict, draw) -> str:
    inner = "".join(f"<parameter={key}>\n{written}\n</parameter>\n" for key, (_, _, written) in params.items())
    return f"{CALL_START}\n<function={name}>\n{inner}</function>\n</tool_call>"


def _whole(splitter: ToolCallSplitter, text: str) -> tuple[str | None, list]:
    """A whole answer's (content, calls), as the server splits one."""
    return ChatAnswerSplitter(None, splitter).split(text)[1:]


def _streamed(splitter: ToolCallSplitter, text: str, cuts: list[int]) -> tuple[str, list]:
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    said, calls = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        s, c = splitter.feed(text[a:b], final=i == len(bounds) - 2)
        said.append(s)
        calls += c
    return "".join(said), calls


@settings(max_examples=150, deadline=None)
@given(data=st.data(), name=st.sampled_from(["hermes", "qwen3_coder"]), cuts=st.lists(st.integers(0, 400),
                                                                                      max_size=16),
       parallel=st.booleans())
def test_an_answer_splits_into_the_calls_it_was_written_with_and_the_text_around_them(data, name, cuts, parallel):
    """An answer built of text and calls (in the parser's format, with JSON or typed values drawn at random): its
    calls are those, in order, and its content the text outside them (less the whitespace between calls and the
    content's ends); fed in any deltas, the same."""
    draw = data.draw
    parts = draw(st.lists(st.booleans(), max_size=5))  # True: a call, False: text
    text, want_calls, said, tools = "", [], [], []
    for is_call in parts:
        if not is_call:
            piece = draw(_said)
            if said and said[-1] is not None:  # one text between calls
                said[-1] += piece
            else:
                said.append(piece)
            text += piece
            assume(CALL_START not in said[-1])  # (two pieces may join into one)
            continue
        fname = f"{draw(_names)}{len(want_calls)}"  # each tool its own name (its own schema)
        if name == "hermes":
            arguments = draw(st.dictionaries(st.text(max_size=6), _json, max_size=4))
            text += _hermes(fname, arguments, draw)
        else:
            params = draw(st.dictionaries(_names, _typed_values, max_size=4))
            arguments = {key: value for key, (_, value, _) in params.items()}
            tools.append({"type": "function", "function": {"name": fname, "parameters": {
                "type": "object", "properties": {key: {"type": kind} for key, (kind, _, _) in params.items()}}}})
            text += _coder(fname, params, draw)
        want_calls.append((fname, arguments))
        said.append(None)
    want = _outside(said)
    if not parallel:
        want_calls = want_calls[:1]
    content, calls = _whole(ToolCallSplitter(PARSERS[name], tools, None if parallel else 1), text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == want_calls, text
    assert content == ((want or None) if want_calls else want), text
    streamed, streamed_calls = _streamed(ToolCallSplitter(PARSERS[name], tools, None if parallel else 1), text,
                                         cuts)
    assert streamed == (content or "") and [(c.name, c.arguments) for c in streamed_calls] == [
        (c.name, c.arguments) for c in calls]


def _outside(pieces: list[str | None]) -> str:
    """The oracle's content of an answer's pieces (None: a call): the text outside calls as written, less the
    whitespace between a call and where the content begins or ends."""
    joined = "".join(p for p in pieces if p is not None)
    said = [i for i, p in enumerate(pieces) if p is not None and p.strip()]
    if None not in pieces:
        return joined
    if not said:
        return ""
    joined = joined.lstrip() if None in pieces[:said[0]] else joined
    return joined.rstrip() if None in pieces[said[-1] + 1:] else joined


@settings(max_examples=100, deadline=None)
@given(data=st.data(), cuts=st.lists(st.integers(0, 300), max_size=16))
def test_a_llama_answer_of_calls_splits_into_those_calls_in_any_deltas(data, cuts):
    """Llama 3's JSON tool calling: an answer that is calls, one or several apart by ";" (vLLM writes "; "), after
    the python tag where the text holds it."""
    draw = data.draw
    calls = draw(st.lists(st.tuples(_names, st.dictionaries(st.text(max_size=5), _json, max_size=3)), min_size=1,
                          max_size=3))
    written = [json.dumps({"name": n, draw(st.sampled_from(["parameters", "arguments"])): a},
                          ensure_ascii=draw(st.booleans())) for n, a in calls]
    text = draw(st.sampled_from(["", PYTHON_TAG])) + "".join(
        w + (draw(st.sampled_from(["; ", ";", " ;\n"])) if i < len(written) - 1 else "") for i, w in enumerate(written))
    want = [(n, json.loads(json.dumps(a))) for n, a in calls]
    for content, got in (_whole(ToolCallSplitter(PARSERS["llama3_json"]), text),
                         _streamed(ToolCallSplitter(PARSERS["llama3_json"]), text, cuts)):
        assert not content and [(c.name, json.loads(c.arguments)) for c in got] == want


@pytest.mark.parametrize("name, text", [
    ("llama3_json", 'Sure. {"name": "f", "parameters": {}}'),  # a call only where the answer opens with it
    ("llama3_json", ' {"name": "f", "parameters": {}}'),
    ("llama3_json", '{"parameters": {}, "name": "f"} and more'),  # all of it calls, or none (its name last)
    ("llama3_json", '{"city": "Paris"}'),  # no name: JSON the model answered with
    ("llama3_json", '{"name": "Alice", "age": 30}'),  # a name but neither parameters nor arguments: an answer too
    ("llama3_json", '[{"name": "f", "parameters": {}}]'),
    ("llama3_json", '{"name": "f", "parameters": [1]}'),  # parameters no object
    ("hermes", "<tool_call>not json</tool_call> then"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # arguments no object
    ("hermes", '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>'),
    ("hermes", "I will call <tool_call>"),  # the answer ends where the call would begin
    ("hermes", '<tool_call>{"name": "f", "argu'),  # cut inside the call
    ("qwen3_coder", "<tool_call>\n<function=f>\n"),  # cut before its first parameter
    ("qwen3_coder", "<tool_call>\n<function=f>\nstray<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"),
    ("qwen3_coder", '<tool_call>{"name": "f", "arguments": {}}</tool_call>'),  # the other format
])
def test_what_does_not_parse_as_a_call_stays_in_the_content_as_written(name, text):
    for cuts in ([], list(range(len(text)))):
        assert _streamed(ToolCallSplitter(PARSERS[name]), text, cuts) == (text, [])
    assert _whole(ToolCallSplitter(PARSERS[name]), text) == (text, [])


def test_qwens_own_renderings_of_calls_read_back_as_the_calls():
    """The texts Qwen3's and Qwen3-Coder's chat templates write for an assistant's tool calls (their tool-call
    blocks, as TensorRT-LLM's and vLLM's parsers take them)."""
    qwen3 = ('Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    content, calls = _whole(ToolCallSplitter(tool_call_parser("qwen3")), qwen3)
    assert content == "Let me check both."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "c"}),
                                                                  ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    coder = ("<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n<parameter=content>\n"
             "def f():\n    return 1\n\n</parameter>\n<parameter=mode>\n644\n</parameter>\n<parameter=force>\ntrue\n"
             "</parameter>\n<parameter=extra>\n3\n</parameter>\n</function>\n</tool_call>")
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
        "force": {"type": "boolean"}}}}}]
    content, calls = _whole(ToolCallSplitter(tool_call_parser("qwen3_xml"), tools), coder)
    assert content is None and [c.name for c in calls] == ["write_file"]
    # a parameter the schema does not name stays text, as vLLM's parser reads it
    assert json.loads(calls[0].arguments) == {"path": "/tmp/a.py", "content": "def f():\n    return 1\n",
                                              "mode": 644, "force": True, "extra": "3"}


@pytest.mark.parametrize("template, name", [(QWEN3_TEMPLATE, "hermes"), (QWEN3_5_TEMPLATE, "qwen3_coder"),
                                            ({"default": "{{ messages }}", "tool_use": QWEN3_TEMPLATE}, "hermes")])
def test_by_default_calls_are_read_in_the_form_the_targets_chat_template_writes_them(template, name):
    """The parser the server takes unasked must read back the calls the template renders, as the model learnt them."""
    import jinja2

    from dflash_trt.server.tool_calls import default_tool_parser

    parser = default_tool_parser(object(), template)
    assert parser is PARSERS[name]
    calls = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"zone": "CET"})]
    message = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": n, "arguments": a}}
                                                   for n, a in calls]}
    source = template["tool_use"] if isinstance(template, dict) else template
    text = jinja2.Environment().from_string(source).render(messages=[message])
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "zone": {"type": "string"}}}}} for n, _ in calls]
    content, read = _whole(ToolCallSplitter(parser, tools), text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in read] == calls


@pytest.mark.parametrize("template", [None, "{% for m in messages %}<s>{{ m['content'] }}{% endfor %}",
                                      # Llama 3.1's: bare JSON, read only when asked for (llama3_json)
                                      '{"name": function name, "parameters": dictionary of argument name and its '
                                      'value}'])
def test_a_template_that_shows_no_tool_call_block_takes_no_parser_unasked(template):
    from dflash_trt.models.gpt_oss import GptOssForCausalLM
    from dflash_trt.server.tool_calls import default_tool_parser

    assert default_tool_parser(object(), template) is None
    assert default_tool_parser(GptOssForCausalLM.__new__(GptOssForCausalLM), template) is PARSERS["gpt_oss"]


def _harmony_text(harmony: str) -> str:
    return re.sub(r"<\|[a-z]+\|>", "", harmony)  # what decode(skip_special_tokens=True) leaves of harmony's tokens


@pytest.mark.parametrize("harmony, tools, want", [
    # harmony's documented call, after an analysis message
    ("<|channel|>analysis<|message|>Need to use function get_weather.<|end|><|start|>assistant<|channel|>commentary "
     'to=functions.get_weather <|constrain|>json<|message|>{"location":"San Francisco"}<|call|>', ["get_weather"],
     ("Need to use function get_weather.", None, [("get_weather", {"location": "San Francisco"})])),
    # a preamble before the call: content, as vLLM shows it
    ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>Let me "
     "check.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
     '{"city": "Paris"}<|call|>', ["get_weather"], ("Need weather.", "Let me check.", [("get_weather",
                                                                                       {"city": "Paris"})])),
    # opening the answer, no space before its constraint, no tools named
    ('<|channel|>commentary to=functions.get_weather<|constrain|>json<|message|>{"city": "Oslo"}<|call|>', [],
     (None, None, [("get_weather", {"city": "Oslo"})])),
    # the recipient in the role's header, a dotted name
    ("<|channel|>analysis<|message|>Mail it.<|end|><|start|>assistant to=functions.email.send<|channel|>commentary "
     'json<|message|>{"to": "a@b.c"}<|call|>', ["email.send"], ("Mail it.", None, [("email.send", {"to": "a@b.c"})])),
    # the recipient in the role's header at the answer's start (the prompt ends "<|start|>assistant"), as gpt-oss's
    # template writes past calls
    (' to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>', ["get_time"],
     (None, None, [("get_time", {})])),
    # without a constraint; a name ending in "json" read as the request names it
    ('<|channel|>commentary to=functions.fetch_json<|message|>{"url": "x"}<|call|>', ["fetch_json"],
     (None, None, [("fetch_json", {"url": "x"})])),
    # no call: the channels split as before
    ("<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|return|>",
     ["get_weather"], ("User says hi.", "Hello!", [])),
    # a call whose arguments are cut: that call, its arguments as far as they came (as a forced call's)
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json"
     '<|message|>{"a": ', ["f"], ("x", None, [("f", '{"a": ')])),
    # cut before its arguments begin: no call, its text where it was (a commentary message: content)
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json",
     ["f"], ("x", " to=functions.f json", [])),
])
def test_gpt_oss_calls_read_from_harmonys_commentary_channel_as_its_text_holds_it(harmony, tools, want):
    """gpt-oss calls a function in a commentary message addressed to it (OpenAI's harmony format), its turn's last
    (<|call|> ends it); the text leaves harmony's special tokens out, and the reasoning is read from what precedes.
    The call opens where its arguments begin, which come as written, in pieces, to the answer's end."""
    text = _harmony_text(harmony)
    schemas = [{"type": "function", "function": {"name": n}} for n in tools]
    for cuts in ([], list(range(len(text)))):
        splitter = ChatAnswerSplitter(REASONING_PARSERS["gpt_oss"], ToolCallSplitter(PARSERS["gpt_oss"], schemas))
        if not cuts:
            thought, content, calls = splitter.split(text)
        else:
            parts = [splitter.feed(text[i:i + 1], final=i == len(text) - 1) for i in cuts]
            thought, content = "".join(p[0] for p in parts) or None, "".join(p[1] for p in parts) or None
            calls = [c for p in parts for c in p[2]]
        # (arguments the oracle gives as text, cut, compare as text; whole ones as JSON)
        got = [(c.name, c.arguments if isinstance(w, str) else json.loads(c.arguments))
               for c, (_, w) in zip(calls, want[2])]
        assert (thought, content, got, len(calls)) == (*want, len(want[2])), cuts


# text near every parser's tags, for the split's agreement with itself
_NEAR = sorted({CALL_START, CALL_START[:5], "</tool_call>", "<function=f>", "<parameter=a>", "\n1\n", "</parameter>",
                "</function>", "<parameter=b>", "</param", "<function=", '"', *HARMONY_STARTS, HARMONY_STARTS[0][:12],
                "json", '{"name": "f", "arguments": {}}', '{"a": 1}', "{", "}", "<think>", "</think>", "analysis",
                "assistantfinal", "assistantanalysis", "final", " ", "\n", "é", "x", PYTHON_TAG, ";"})


@settings(max_examples=250, deadline=None)
@given(reasoning=st.sampled_from([None, *sorted(REASONING_PARSERS)]), calls=st.sampled_from(sorted(PARSERS)),
       text=st.lists(st.sampled_from(_NEAR), max_size=24).map("".join), cuts=st.lists(st.integers(0, 300), max_size=16))
def test_a_streamed_answer_splits_as_the_whole_answer_does_in_any_deltas(reasoning, calls, text, cuts):
    def splitter():
        return ChatAnswerSplitter(REASONING_PARSERS.get(reasoning), ToolCallSplitter(PARSERS[calls], [
            {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "integer"}}}}}]))

    thought, content, whole = splitter().split(text)
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    streaming = splitter()
    parts = [streaming.feed(text[a:b], final=b == len(text)) for a, b in zip(bounds, bounds[1:])] or [
        streaming.feed("", final=True)]
    assert "".join(p[0] for p in parts) == (thought or "") and "".join(p[1] for p in parts) == (content or "")
    assert [(c.name, c.arguments) for p in parts for c in p[2]] == [(c.name, c.arguments) for c in whole]
    # in order, too (the Responses API's output items): the same runs of reasoning, content and calls
    streaming = splitter()
    ordered = [p for a, b in zip(bounds, bounds[1:]) for p in streaming.parts(text[a:b], final=b == len(text))]
    assert _runs(ordered) == _runs(splitter().parts(text, final=True))
    _check_pieces(ordered)


def _check_pieces(parts: list[tuple[str, object]]) -> None:
    """A call sent in pieces: opened, its arguments' pieces, closed, nothing else between; the closed call is the
    opened one, its arguments the pieces joined."""
    opened = None
    for kind, value in parts:
        if kind == "call_opened":
            assert opened is None
            opened, pieces = value, []
        elif kind == "arguments":
            pieces.append(value)
        elif kind in ("call_closed", "call_finished"):
            assert (value.name, value.id, value.arguments) == (opened.name, opened.id, "".join(pieces))
            opened = None
        else:
            assert opened is None, (kind, value)


_free = st.lists(st.sampled_from(_NEAR), max_size=10).map("".join).filter(lambda t: "think>" not in t)


@settings(max_examples=100, deadline=None)
@given(reasoning=st.sampled_from([None, "qwen3", "deepseek_r1"]), thought=_free, pad=st.sampled_from(["", " ", "\n"]),
       arguments=_free.map(lambda t: "{" + t), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_a_named_forced_calls_arguments_come_in_pieces_the_whole_answers_call_holds(reasoning, thought, pad, arguments,
                                                                                    cuts):
    """The call opens with its JSON after any reasoning, each delta's text is the next piece of its arguments, and
    it closes whole with the answer's end, as the whole answer's call."""
    def splitter():
        return ChatAnswerSplitter(REASONING_PARSERS.get(reasoning), ForcedCallSplitter("f"))

    opened = {"qwen3": f"<think>{thought}</think>", "deepseek_r1": f"{thought}</think>"}.get(reasoning, "")
    text = opened + pad + arguments
    said, content, (whole,) = splitter().split(text)
    assert (said or "", content, whole.arguments) == (thought if reasoning else "", None, pad + arguments)
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    streaming = splitter()
    parts = [p for a, b in zip(bounds, bounds[1:]) for p in streaming.parts(text[a:b], final=b == len(text))]
    kinds = [k for k, _ in parts if k != "reasoning"]
    assert (kinds[0], kinds[-1]) == ("call_opened", "call_closed") and set(kinds[1:-1]) <= {"arguments"}
    call, closed = next(v for k, v in parts if k == "call_opened"), parts[-1][1]
    assert (call.name, call.arguments, closed.id) == ("f", "", call.id)
    assert "".join(v for k, v in parts if k == "arguments") == closed.arguments == whole.arguments
    assert "".join(v for k, v in parts if k == "reasoning") == (said or "")


_plain = st.lists(st.sampled_from([t for t in _NEAR if "assistant" not in t]), max_size=10).map("".join).filter(
    lambda t: "assistant" not in t)
_NAMES = ["get", "get_json", "getjson", "g.h", "lookup", "lookup-v2"]  # (names that begin one another)


@settings(max_examples=150, deadline=None)
@given(thoughts=st.lists(_plain, max_size=2), name=st.sampled_from(_NAMES), space=st.booleans(),
       arguments=_free.map(lambda t: "{" + t), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_a_harmony_forced_call_is_read_from_its_header_its_arguments_in_pieces(thoughts, name, space, arguments,
                                                                                cuts):
    """gpt-oss's call, as its text holds it past its analysis messages ("commentary to=functions.NAME json{...}",
    harmony's special tokens left out): the function it names (of names that begin one another, however the deltas
    cut them), its arguments as written (harmony's words in them too) and sent as a named call's."""
    def splitter():
        return ChatAnswerSplitter(REASONING_PARSERS["gpt_oss"], ForcedCallSplitter(None, _NAMES))

    analysis = "".join(f"analysis{t}assistant" for t in thoughts)
    text = f"{analysis}commentary to=functions.{name}{' ' * space}json{arguments}"
    said, content, (whole,) = splitter().split(text)
    assert (said or "", content, whole.name, whole.arguments) == ("\n".join(thoughts), None, name, arguments)
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    streaming = splitter()
    parts = [p for a, b in zip(bounds, bounds[1:]) for p in streaming.parts(text[a:b], final=b == len(text))]
    kinds = [k for k, _ in parts if k != "reasoning"]
    assert (kinds[0], kinds[-1]) == ("call_opened", "call_closed") and set(kinds[1:-1]) <= {"arguments"}
    assert next(v for k, v in parts if k == "call_opened").name == name
    assert "".join(v for k, v in parts if k == "arguments") == parts[-1][1].arguments == arguments
    assert "".join(v for k, v in parts if k == "reasoning") == (said or "")


@settings(max_examples=100, deadline=None)
@given(data=st.data(), reasoning=st.sampled_from([None, "qwen3"]), cuts=st.lists(st.integers(0, 300), max_size=12))
def test_required_calls_stream_their_arguments_and_a_cut_list_keeps_what_it_made(data, reasoning, cuts):
    """tool_choice "required": the answer is a list of {"name", "parameters"}; each call opens in the delta its
    parameters' object begins in, its arguments come as written, piece by piece, and it finishes in the delta its
    object closes in. An answer cut anywhere has made the calls whose parameters began before the cut, the last one's
    arguments cut there; cut before any parameters began, what follows the last call and its comma is content."""
    draw = data.draw
    calls = draw(st.lists(st.tuples(_names, st.dictionaries(st.text(max_size=5), _json, max_size=3)), min_size=1,
                          max_size=3))
    gap = st.sampled_from(["", " ", "\n  "])
    opened = f"<think>{draw(_free)}</think>" if reasoning else ""
    text, spans = opened + "[" + draw(gap), []  # spans: (where its parameters begin, end, its object's end)
    for k, (name, parameters) in enumerate(calls):
        ascii_only = draw(st.booleans())
        text += '{"name": ' + json.dumps(name, ensure_ascii=ascii_only) + ', "parameters": '
        # (whitespace before the "}": the grammar allows it)
        written, closing = json.dumps(parameters, ensure_ascii=ascii_only), draw(gap) + "}"
        spans.append((len(text), len(text) + len(written), len(text) + len(written) + len(closing)))
        text += written + closing + ((draw(gap) + "," + draw(gap)) if k < len(calls) - 1 else draw(gap) + "]")
    cut = draw(st.integers(len(opened), len(text)))

    def splitter():
        return ChatAnswerSplitter(REASONING_PARSERS.get(reasoning), ForcedCallSplitter(None))

    assert [(c.name, c.arguments) for c in splitter().split(text)[2]] == [
        (name, text[at:end]) for (name, _), (at, end, _) in zip(calls, spans)]
    _, content, some = splitter().split(text[:cut])
    assert [(c.name, c.arguments) for c in some] == [(name, text[at:min(end, cut)])
                                                       for (name, _), (at, end, _) in zip(calls, spans) if at < cut]
    if some and spans[len(some) - 1][2] > cut:  # cut in the last call: that call, nothing besides
        assert content is None
    else:  # what follows the last call and its comma (all of it, where it made none); a list's "]" is no text
        rest = text[len(opened):cut] if not some else re.sub(r"^\s*,?\s*", "", text[spans[len(some) - 1][2]:cut])
        assert (content or "").strip() == ("" if re.fullmatch(r"\s*\]\s*", rest) else rest.strip())
    streaming = splitter()
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    pieces = []
    for a, b in zip(bounds, bounds[1:]):
        parts = streaming.parts(text[a:b], final=b == len(text))
        assert [v.name for k, v in parts if k == "call_opened"] == [
            name for (name, _), (at, _, _) in zip(calls, spans) if a <= at < b]
        assert [v.name for k, v in parts if k == "call_finished"] == [
            name for (name, _), (_, _, done) in zip(calls, spans) if a < done <= b]
        pieces += [(k, v) for k, v in parts if k in ("call_opened", "arguments")]
    streamed = []
    for kind, value in pieces:
        streamed += [[value.name, ""]] if kind == "call_opened" else []
        streamed[-1][1] += value if kind == "arguments" else ""
    assert streamed == [[name, text[at:end]] for (name, _), (at, end, _) in zip(calls, spans)]


def test_a_named_forced_call_cut_before_its_json_is_no_call():
    for reasoning, text in (("qwen3", "<thin"), ("qwen3", "<think>plan"), ("deepseek_r1", "plan</thi"), (None, "")):
        _, content, calls = ChatAnswerSplitter(REASONING_PARSERS.get(reasoning), ForcedCallSplitter("f")).split(text)
        assert not calls, text
    # a schema of parameters other than an object's (a schema may say so) is a call all the same
    for text in ("[2]", '"x"', " 3"):
        assert [c.arguments for c in ChatAnswerSplitter(None, ForcedCallSplitter("f")).split(text)[2]] == [text]


@pytest.mark.parametrize("text", ['[{"name": "f", "parameters": {"a": 1} ', '[{"name": "f", "parameters": {"a": 1}\n'])
def test_a_required_call_cut_after_its_parameters_closed_has_them_whole(text):
    """Whitespace the grammar allows between the parameters and the call's "}": a cut there leaves the arguments as
    they closed, streamed or not (the whole answer's took the whitespace in)."""
    whole = ChatAnswerSplitter(None, ForcedCallSplitter(None)).split(text)[2]
    streaming = ChatAnswerSplitter(None, ForcedCallSplitter(None))
    parts = [p for i, c in enumerate(text) for p in streaming.parts(c, final=i == len(text) - 1)]
    assert [c.arguments for c in whole] == ['{"a": 1}'] == ["".join(v for k, v in parts if k == "arguments")]


def test_required_calls_are_each_parsed_once_however_the_answer_comes(monkeypatch):
    """One pass over the answer: a call's object read anew with each delta took time quadratic in its length (its
    name is what is parsed, once; its arguments are sent as written)."""
    from dflash_trt.server import tool_calls

    parsed = []
    monkeypatch.setattr(tool_calls.json, "loads", lambda text, _loads=json.loads: parsed.append(text) or _loads(text))
    text = json.dumps([{"name": "f", "parameters": {"q": "}{" * 50, "n": list(range(50))}}, {"name": "g",
                                                                                             "parameters": {}}])
    splitter = ForcedCallSplitter(None)
    calls = [c for i in range(len(text)) for c in splitter.parts(text[i], final=i == len(text) - 1)]
    assert [c.call.name for c in calls if isinstance(c, ClosedCall)] == ["f", "g"] and len(parsed) == 2


def _runs(parts: list[tuple[str, object]]) -> list[tuple[str, str]]:
    """Ordered parts with each run of one kind of text joined (a call: its name and arguments)."""
    runs: list[tuple[str, str]] = []
    for kind, value in parts:
        whole = kind.startswith("call")  # (a call, whole or opened or closed: its name and arguments, not its id)
        if not whole and runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1] + value)
        else:
            runs.append((kind, f"{value.name}{value.arguments}" if whole else value))
    return runs


def test_text_on_both_sides_of_a_call_keeps_what_separated_it():
    text = 'Checking the weather\n<tool_call>{"name": "f"}</tool_call>\nand the time.\n'
    content, calls = _whole(ToolCallSplitter(PARSERS["hermes"]), text)
    assert (content, [c.name for c in calls]) == ("Checking the weather\n\nand the time.\n", ["f"])


@pytest.mark.parametrize("schema", [{"properties": {"a": True}}, {"properties": ["a"]}, {"properties": "x"},
                                    {"properties": {"a": {"type": {"not": "a type"}}}},
                                    {"properties": {"a": {"type": [{"x": 1}]}}}, True, None])
def test_a_schema_of_any_shape_reads_the_value_as_text_where_it_names_no_type(schema):
    """JSON Schema allows `true` for a property's schema, and clients send what they send: none of it fails."""
    text = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    content, calls = _whole(ToolCallSplitter(PARSERS["qwen3_coder"], tools), text)
    assert content is None and json.loads(calls[0].arguments) == {"a": "1"}


def test_arguments_are_json_a_response_can_carry():
    """A lone surrogate's escape stays an escape (UTF-8 cannot carry the character); NaN is no JSON: no call (but
    where a call's arguments are sent as written, as they come: hermes's and qwen3_coder's)."""
    for name, text in [("hermes", '<tool_call>{"name": "f", "arguments": {"s": "\\ud800 \\u00e9"}}</tool_call>'),
                       ("qwen3_coder", "<tool_call><function=f><parameter=s>\ud800 \u00e9</parameter></function>")]:
        content, calls = _whole(ToolCallSplitter(PARSERS[name]), text)
        assert calls[0].arguments.encode() and json.loads(calls[0].arguments) == {"s": "\ud800 \u00e9"}
    for text, written in (('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', {"hermes": "NaN"}),
                          ("<tool_call><function=f><parameter=x>Infinity</parameter></function></tool_call>",
                           {"qwen3_coder": "Infinity"}),
                          ("to=functions.f json{\"x\": -Infinity}", {})):
        schemas = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": {
            "type": "number"}}}}}]
        for name in PARSERS:
            content, calls = _whole(ToolCallSplitter(PARSERS[name], schemas), text)
            assert [c.arguments for c in calls] == ([f'{{"x": {written[name]}}}'] if name in written else []), text


def test_the_formats_other_shapes_vllm_reads_too():
    null = '<tool_call>{"name": "f", "arguments": null}</tool_call>'
    content, calls = _whole(ToolCallSplitter(PARSERS["hermes"]), null)
    assert [(c.name, c.arguments) for c in calls] == [("f", "{}")]
    two = ("<tool_call>\n<function=a>\n</function>\n<function=b>\n<parameter=x>\ny\n</parameter>\n</function>\n"
           "</tool_call>")
    assert [(c.name, json.loads(c.arguments)) for c in _whole(ToolCallSplitter(PARSERS["qwen3_coder"]), two)[1]] == [
        ("a", {}), ("b", {"x": "y"})]


def test_a_role_header_recipient_opens_a_call_only_where_the_answer_begins():
    tools = [{"type": "function", "function": {"name": "lookup"}}]
    prose = 'analysisQ.assistantfinalIn harmony a call is addressed to=functions.lookup json{"q": 1}'
    splitter = ChatAnswerSplitter(REASONING_PARSERS["gpt_oss"], ToolCallSplitter(PARSERS["gpt_oss"], tools))
    assert splitter.split(prose) == ("Q.", prose.partition("assistantfinal")[2], [])
    splitter = ChatAnswerSplitter(REASONING_PARSERS["gpt_oss"], ToolCallSplitter(PARSERS["gpt_oss"], tools))
    thought, content, calls = splitter.split(' to=functions.lookupcommentary json{"q": 1}')
    assert (thought, content, [c.name for c in calls]) == (None, None, ["lookup"])


def test_an_answer_without_calls_is_its_text_unchanged():
    text = "  Hello <tool_ there\n\n"
    assert _whole(ToolCallSplitter(PARSERS["hermes"]), text) == (text, [])
    assert _whole(ToolCallSplitter(PARSERS["hermes"]), "") == ("", [])


def test_an_unknown_parser_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="gpt_oss, hermes, llama3_json, openai, qwen3, qwen3_coder, qwen3_xml"):
        tool_call_parser("mistral")


# --- served: a target whose own greedy answer is two tool calls --------------------------------------------------

def _engine(dirs, **cfg):
    from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine.from_dirs(*dirs, EngineConfig(max_model_len=256, max_batch_size=4, **cfg))


def _stream(server, body: dict) -> tuple[str, dict, list[dict]]:
    """A streamed chat answer's joined content, its calls put together from their deltas (index -> call), and its
    chunks."""
    with httpx.stream("POST", server.base_url + "/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    content, calls = "", {}
    for e in events:
        delta = e["choices"][0]["delta"]
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            calls.setdefault(call["index"], {"id": "", "name": "", "arguments": ""})
            calls[call["index"]]["id"] += call.get("id") or ""
            calls[call["index"]]["name"] += call["function"].get("name") or ""
            calls[call["index"]]["arguments"] += call["function"].get("arguments") or ""
    return content, calls, events


def test_a_served_targets_own_tool_calls_come_back_as_tool_calls_streamed_and_not(caller):
    plain = _engine(caller, speculative=False)
    prompt = plain.prompt_encoder.encode_chat(QUESTION, add_generation_prompt=True)
    out = plain.generate([prompt], SamplingParams(max_new_tokens=200))[0]
    assert (out.text, out.finish_reason) == (ANSWER, "stop")  # the premise: the target writes the calls

    server = start_server(_engine(caller), tool_parser=tool_call_parser("hermes"))
    try:
        body = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 200, "temperature": 0}
        choice = server.client().chat.completions.create(model="tiny-qwen3", **body).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "I will look."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == CALLS
        assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)

        content, calls, events = _stream(server, body)
        assert content == "I will look."
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == CALLS
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # each call named once, in its first delta, its arguments in pieces as they come: OpenAI's SDK puts deltas
        # together by index
        deltas = [t for e in events for t in e["choices"][0]["delta"].get("tool_calls") or ()]
        assert [t["function"]["name"] for t in deltas if t["function"].get("name")] == [n for n, _ in CALLS]
        assert len(deltas) > len(CALLS)

        one = server.client().chat.completions.create(model="tiny-qwen3", parallel_tool_calls=False, **body)
        assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
        assert sorted(_stream(server, {**body, "parallel_tool_calls": False})[1]) == [0]

        # cut before the first call closes: no call made, the text as it is, finish_reason length
        cut = server.client().chat.completions.create(model="tiny-qwen3", **{**body, "max_tokens": 30}).choices[0]
        assert (cut.finish_reason, cut.message.tool_calls, cut.message.content) == ("length", None, ANSWER[:30])
        # tool_choice "none": the answer is text, as before
        text = server.client().chat.completions.create(model="tiny-qwen3", tool_choice="none", **body).choices[0]
        assert (text.message.content, text.message.tool_calls, text.finish_reason) == (ANSWER, None, "stop")

        # the calls sent back with their answers: the next turn renders (the history's shape OpenAI's SDK sends)
        history = [*QUESTION, choice.message.model_dump(exclude_none=True),
                   *({"role": "tool", "tool_call_id": c.id, "content": "sunny"} for c in choice.message.tool_calls)]
        r = httpx.post(server.base_url + "/chat/completions", json={**body, "messages": history, "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text
    finally:
        server.stop()


def test_a_stream_that_fails_in_the_server_ends_with_an_error_event_and_the_server_serves_on(caller, monkeypatch):
    def broken(self, text, final=False):
        raise RuntimeError("a bug")

    server = start_server(_engine(caller, speculative=False), tool_parser=tool_call_parser("hermes"))
    try:
        monkeypatch.setattr(ChatAnswerSplitter, "parts", broken)
        with httpx.stream("POST", server.base_url + "/chat/completions", timeout=60, json={
                "messages": QUESTION, "tools": TOOLS, "max_tokens": 8, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["error"]["message"] == "internal error: a bug"
        monkeypatch.undo()
        assert server.wait_idle() and httpx.get(server.url + "/health", timeout=10).status_code == 200
        r = httpx.post(server.base_url + "/chat/completions", json={"messages": QUESTION, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200
    finally:
        server.stop()


def test_a_stop_string_inside_a_call_ends_the_answer_with_stop_not_tool_calls(caller):
    """"tool_calls" tells a client its calls are whole, to be run: a stop string that cuts the last one's arguments
    ("Paris", inside the first call's JSON) leaves them unrunnable, and the answer says "stop", streamed or not; a
    stop string after the calls leaves them whole."""
    server = start_server(_engine(caller), tool_parser=tool_call_parser("hermes"))
    try:
        body = {"messages": QUESTION, "tools": TOOLS, "max_tokens": 200, "temperature": 0}
        for stop, want in ((["Paris"], "stop"), (["zzz"], "tool_calls")):
            choice = server.client().chat.completions.create(model="tiny-qwen3", stop=stop, **body).choices[0]
            assert choice.finish_reason == want and choice.message.tool_calls, (stop, choice)
            assert _stream(server, {**body, "stop": stop})[2][-1]["choices"][0]["finish_reason"] == want
    finally:
        server.stop()


def test_tools_the_model_may_call_need_a_tool_call_parser(caller):
    server = start_server(_engine(caller, speculative=False))
    try:
        r = httpx.post(server.base_url + "/chat/completions", json={"messages": QUESTION, "tools": TOOLS}, timeout=60)
        assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "tools"
    finally:
        server.stop()


def test_a_hermes_calls_arguments_stream_as_written_and_a_call_cut_in_them_stays_a_call():
    """A hermes call opens once its arguments' object begins (its name first, as Qwen writes it), its arguments come
    in pieces as written, and it closes with </tool_call>; one cut by max_tokens in its arguments is that call with
    them cut. A JSON string may hold the end tag; a block that begins otherwise (a list, its name last) comes whole."""
    text = ('Sure.\n<tool_call>\n{"name": "run", "arguments": {"code": "print(\'</tool_call>\')", "n": [1, {}]}}\n'
            '</tool_call>\n<tool_call>\n{"arguments": {"q": 1}, "name": "find"}\n</tool_call>')
    arguments = '{"code": "print(\'</tool_call>\')", "n": [1, {}]}'
    splitter = ChatAnswerSplitter(None, ToolCallSplitter(PARSERS["hermes"]))
    parts = [p for i, c in enumerate(text) for p in splitter.parts(c, final=i == len(text) - 1)]
    kinds = [k for k, _ in parts if k != "content"]
    assert kinds[0] == "call_opened" and kinds[-2:] == ["call_finished", "call"]
    assert "".join(v for k, v in parts if k == "arguments") == arguments
    assert [(c.name, c.arguments) for c in ChatAnswerSplitter(None, ToolCallSplitter(PARSERS["hermes"])).split(
        text)[2]] == [("run", arguments), ("find", '{"q": 1}')]
    cut = text[:text.index("[1,")]
    assert [(c.name, c.arguments) for c in ChatAnswerSplitter(None, ToolCallSplitter(PARSERS["hermes"])).split(
        cut)[2]] == [("run", arguments[:arguments.index("[1,")])]


def test_a_qwen3_coder_calls_arguments_stream_as_json_and_a_call_cut_in_them_stays_a_call():
    """A qwen3_coder call opens at its function's first parameter; its arguments come as a JSON object in pieces, a
    string's value as the model writes it (before its </parameter> has come), other values whole, typed by the tool's
    schema; </function> closes it. A string may hold any tag but </parameter>. One cut by max_tokens in its arguments
    is that call with them cut; one cut before its first parameter is the model's text."""
    code = 'print("</tool_call>")\n\tx = "\\n" </function>\n'
    text = ("Writing it.\n<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n"
            f"<parameter=content>\n{code}\n</parameter>\n<parameter=mode>\n420\n</parameter>\n<parameter=meta>\n"
            '{"a": [1, null]}\n</parameter>\n</function>\n<function=sync>\n</function>\n</tool_call>\nDone.')
    tools = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
        "meta": {"type": "object"}}}}}]
    want = [("write_file", {"path": "/tmp/a.py", "content": code, "mode": 420, "meta": {"a": [1, None]}}),
            ("sync", {})]

    def splitter():
        return ChatAnswerSplitter(None, ToolCallSplitter(PARSERS["qwen3_coder"], tools))

    streaming = splitter()
    parts = [(i, p) for i, c in enumerate(text) for p in streaming.parts(c, final=i == len(text) - 1)]
    kinds = [k for _, (k, _) in parts if k != "content"]
    assert [k for i, k in enumerate(kinds) if k != "arguments" or kinds[i - 1] != "arguments"] == [
        "call_opened", "arguments", "call_finished"] * 2 and kinds.count("arguments") > len(code)
    first = "".join(v for i, (k, v) in parts if k == "arguments" and i < text.index("<function=sync>"))
    assert json.loads(first) == want[0][1]
    # the code came as it was written: before its </parameter>
    code_end = text.index("</parameter>", text.index("<parameter=content>"))
    assert json.loads('"' + "".join(v for i, (k, v) in parts if k == "arguments" and i < code_end).split(
        '"content": "')[1] + '"') == code
    assert "".join(v for _, (k, v) in parts if k == "content") == "Writing it.\n\nDone."
    thought, content, calls = splitter().split(text)
    assert (content, [(c.name, json.loads(c.arguments)) for c in calls]) == ("Writing it.\n\nDone.", want)
    assert calls[0].arguments == first

    cut = text[:text.index(" </function>")]  # in the code
    _, content, (call,) = splitter().split(cut)
    assert (content, call.name) == ("Writing it.", "write_file")
    assert call.arguments == '{"path": "/tmp/a.py", "content": ' + json.dumps(code[:code.index(" </")])[:-1]
    assert splitter().split(text[:text.index("<parameter=path>")]) == (None, text[:text.index("<parameter=path>")],
                                                                       [])


def test_text_amid_a_qwen3_coder_calls_elements_is_left_out_in_any_deltas():
    """Once a block's call has opened, what it holds between elements that is no element is left out, up to the next
    one (whose name may come in pieces); where the block's first call has not opened, the block is the model's text."""
    text = ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\nstray <\n<parameter=bb>\nx\n</parameter>\n"
            "</function>\nmore</tool_call>")
    for cuts in ([], list(range(len(text)))):
        content, calls = _streamed(ToolCallSplitter(PARSERS["qwen3_coder"]), text, cuts)
        assert (content, [(c.name, json.loads(c.arguments)) for c in calls]) == ("", [("f", {"a": "1", "bb": "x"})])


@pytest.mark.parametrize("text, want", [
    ('{"name": "f", "parameters": {"q": "a}b", "n": [1, {}]}}', ("", [("f", '{"q": "a}b", "n": [1, {}]}', True)])),
    (PYTHON_TAG + '{"name": "f", "arguments": {}}; {"name": "g", "parameters": {"x": 1}};',
     ("", [("f", "{}", True), ("g", '{"x": 1}', True)])),
    ('{"name": "f", "parameters": {"a": ', ("", [("f", '{"a": ', False)])),  # cut in its arguments
    ('{"name": "f", "parameters": {}} and more', ("and more", [("f", "{}", True)])),  # text after the calls: content
    ('{"name": "f", "parameters": {}}; {"name": "g"} and', ('; {"name": "g"} and', [("f", "{}", True)])),
    ('{"name": "f", "parameters": {}}; {"parameters": {}, "name": "g"}', ('; {"parameters": {}, "name": "g"}',
                                                                        [("f", "{}", True)])),
])
def test_a_llama_calls_arguments_stream_as_written_and_what_follows_its_calls_is_content(text, want):
    """A Llama call whose JSON names its function first (as Llama's template writes it) opens where its parameters'
    object begins, its arguments come in pieces as written, and it closes with its JSON; one cut in its arguments is
    that call with them cut; once a call has opened, the text after the calls that is no call is content."""
    for cuts in ([], list(range(len(text)))):
        splitter = ChatAnswerSplitter(None, ToolCallSplitter(PARSERS["llama3_json"]))
        bounds = [0, *cuts[1:], len(text)] if cuts else [0, len(text)]
        parts = [p for a, b in zip(bounds, bounds[1:]) for p in splitter.parts(text[a:b], final=b == len(text))]
        _check_pieces(parts)
        closed = [(v.name, v.arguments, k == "call_finished") for k, v in parts
                  if k in ("call_finished", "call_closed")]
        assert ("".join(v for k, v in parts if k == "content"), closed) == want, cuts
        if cuts:
            assert sum(k == "arguments" for k, _ in parts) >= len(want[1][0][1])  # in pieces, as they came


_F1 = "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("name, text, room, want", [
    # a value the model did not close: it ends at its function's end on a line of its own, and what follows the block
    # is content; a value holding such an end and then its </parameter> holds it
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\nx\n</function>\n</tool_call>\nDone.", None,
     ("Done.", [("f", '{"a": "x"}')])),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=n>\n5\n</tool_call>\nDone.", None,
     ("Done.", [("f", '{"n": 5}')])),
    ("qwen3_coder",
     "<tool_call>\n<function=f>\n<parameter=a>\nx\n</function>\ny\n</parameter>\n</function>\n</tool_call>", None,
     (None, [("f", '{"a": "x\\n</function>\\ny"}')])),
    # past the room (parallel_tool_calls false), a block cut, or holding its end tag in a string, is left out whole
    ("qwen3_coder", _F1 + "\n<tool_call>\n<function=g>\n<parameter=a>\n2", 1, (None, [("f", '{"a": 1}')])),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {"s": '
     '"</tool_call>"}}</tool_call>', 1, (None, [("f", "{}")])),
    ("hermes", '<tool_call>{"name": "f", "arguments": {}}</tool_call> <tool_call>{"name": "g", "arguments": {"a', 1,
     (None, [("f", "{}")])),
    ("llama3_json", '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {"a": ', 1, (None, [("f", "{}")])),
    # a name holding what else would end or open things
    ("llama3_json", '{"name":"f","parameters":{}};{"name":"{","parameters":{}}', None,
     (None, [("f", "{}"), ("{", "{}")])),
    ("hermes", '<tool_call>{"name": "</tool_call>", "arguments": {}}</tool_call>', None,
     (None, [("</tool_call>", "{}")])),
    # a lone surrogate is escaped alike whatever delta it comes in
    ("qwen3_coder", "<tool_call><function=f><parameter=a>\ud800\u00e9</parameter></function></tool_call>", None,
     (None, [("f", '{"a": "\\ud800\u00e9"}')])),
    # no name, no call
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter= >\n1\n</parameter>\n</function>\n</tool_call>", None,
     ("<tool_call>\n<function=f>\n<parameter= >\n1\n</parameter>\n</function>\n</tool_call>", [])),
    ("llama3_json", '{"name": "", "parameters": {}}', None, ('{"name": "", "parameters": {}}', [])),
    ("hermes", '<tool_call>{"name": "", "arguments": {}}</tool_call>', None,
     ('<tool_call>{"name": "", "arguments": {}}</tool_call>', [])),
    # a block that ends inside a function before its first parameter: no call of it (as where it is the first)
    ("qwen3_coder", _F1[:-len("</tool_call>")] + "<function=g>\n</tool_call>", None, (None, [("f", '{"a": 1}')])),
])
def test_calls_read_alike_in_any_deltas_where_the_model_wrote_them_oddly(name, text, room, want):
    schemas = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "a": {"type": "integer"} if name == "qwen3_coder" and "\n1\n" in text else {"type": "string"},
        "n": {"type": "integer"}}}}}]
    for cuts in ([], list(range(len(text)))):
        content, calls = _streamed(ToolCallSplitter(PARSERS[name], schemas, room), text, cuts)
        assert (content or None, [(c.name, c.arguments) for c in calls]) == want, cuts
