"""serve --reasoning-parser: a thinking model's answer split into `reasoning` and `content`, the same whether it is
streamed (in any deltas) or not, as vLLM's and TensorRT-LLM's parsers of those names split it."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.sampling_params import SamplingParams
from dflash_trt.server.chat_answer import ChatAnswerSplitter
from dflash_trt.server.reasoning import PARSERS, ReasoningParser, ReasoningSplitter, reasoning_parser
from tests.server.conftest import MODEL, start_server, tiny_engine

def _near_tags(parser: ReasoningParser):
    """Text near the parser's tags: their characters, their beginnings, whole opening ones (never a whole closing one:
    that would end the reasoning)."""
    end = parser.ends[0]
    pieces = sorted({*parser.start, *end, parser.start, parser.start[:3], end[:-1], end[:4],
                     *([parser.reasoning_break, parser.reasoning_break[:-2]] if parser.reasoning_break else []),
                     *(piece for opener in parser.content_starts for piece in (opener, opener[:2])),
                     *(piece for tag in parser.content_breaks for piece in (tag, tag[:-3])),
                     " ", "\n", "é", "x"})
    return st.lists(st.sampled_from(pieces), max_size=20).map("".join)


def _whole(parser: ReasoningParser, text: str) -> tuple[str | None, str | None]:
    """A whole answer's (reasoning, content), as the server splits one."""
    return ChatAnswerSplitter(parser, None).split(text)[:2]


def _without(text: str, tags: list[str]) -> str:
    while any(tag in text for tag in tags):  # (a removal may join one)
        for tag in tags:
            text = text.replace(tag, "")
    return text


def _streamed(parser: ReasoningParser, text: str, cuts: list[int]) -> tuple[str, str, bool, int]:
    """The reasoning and content deltas of text fed in pieces at `cuts`, joined; whether it ended in reasoning; and
    how many of its characters the splitter counts as reasoning (tags included)."""
    splitter, thought, said = ReasoningSplitter(parser), [], []
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(text)), len(text)]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        r, c = splitter.feed(text[a:b], final=i == len(bounds) - 2)
        thought.append(r)
        said.append(c)
    if len(bounds) == 2 and not text:  # an empty answer: one final, empty delta
        r, c = splitter.feed("", final=True)
        thought.append(r)
        said.append(c)
    return "".join(thought), "".join(said), splitter.in_reasoning, splitter.reasoning_chars


@settings(max_examples=600, deadline=None)
@given(data=st.data(), name=st.sampled_from(sorted(PARSERS)), opened=st.booleans(), closed=st.booleans(),
       cuts=st.lists(st.integers(0, 120), max_size=12))
def test_the_split_is_the_answers_think_block_in_any_deltas(data, name, opened, closed, cuts):
    parser = PARSERS[name]
    end = parser.ends[0]
    reasoning = _without(data.draw(_near_tags(parser)), [*parser.ends, *parser.content_breaks])
    # (a further message of content, harmony's, is the examples' below)
    content = _without(data.draw(_near_tags(parser)), parser.content_breaks)
    if not opened and reasoning.startswith(parser.start):
        reasoning = "x" + reasoning  # (an answer that opens with the tag opened it)
    text = (parser.start if opened else "") + reasoning + (end + content if closed else "")
    openers = [o for o in parser.content_starts if text.startswith(o)]
    if opened or parser.starts_thinking:
        if not opened and openers:
            return  # an answer that opens in the content's channel has no reasoning (below)
        # a further message of reasoning (harmony's) goes on on a new line
        thought = reasoning.replace(parser.reasoning_break, "\n") if parser.reasoning_break else reasoning
        # (its characters of reasoning: all but the content)
        want = (thought, content if closed else "", not closed, len(text) - len(content) if closed else len(text))
    else:  # without an opening tag, all of it is content, less the content channel's name where it opens with it
        if any(tag in text for tag in parser.content_breaks):
            return
        want = ("", text[len(openers[0]):] if openers else text, False, 0)
    assert _streamed(parser, text, cuts) == want
    whole = _whole(parser, text)
    thought = opened or parser.starts_thinking  # (an answer opening in the content's channel returned above)
    assert whole == (want[0] or None, (want[1] or None) if thought else want[1])


@pytest.mark.parametrize("text, r1, qwen3", [
    ("<think>\nplan</think>\n\nanswer", ("\nplan", "\n\nanswer"), ("\nplan", "\n\nanswer")),
    ("plan</think>answer", ("plan", "answer"), (None, "plan</think>answer")),  # the prompt opened the block
    ("<think>cut by max_tokens", ("cut by max_tokens", None), ("cut by max_tokens", None)),
    ("no thinking", ("no thinking", None), (None, "no thinking")),
    ("<thi", ("<thi", None), (None, "<thi")),  # a partial tag at the end is text
    ("<think></think>", (None, None), (None, None)),  # reasoned, said nothing: vLLM's null
    ("", (None, None), (None, "")),
])
def test_whole_answers_split_as_trtllm_and_vllm_parsers_of_those_names(text, r1, qwen3):
    assert _whole(reasoning_parser("deepseek-r1"), text) == r1
    assert _whole(reasoning_parser("qwen3"), text) == qwen3


@pytest.mark.parametrize("harmony, want", [
    ("<|channel|>analysis<|message|>User says hi.<|end|><|start|>assistant<|channel|>final<|message|>Hello!<|return|>",
     ("User says hi.", "Hello!")),
    ("<|channel|>final<|message|>Hello!<|return|>", (None, "Hello!")),  # no reasoning
    ("<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>Hi<|return|>", ("One.\nTwo.", "Hi")),  # two analysis messages
    ("<|channel|>analysis<|message|>Cut by max_tokens", ("Cut by max_tokens", None)),
    # a commentary message without a recipient (a preamble) is content, as vLLM shows it
    ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>Let me "
     "check.<|end|>", ("Need weather.", "Let me check.")),
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.<|return|>",
     (None, "Checking.\nSunny.")),  # a further message of content goes on on a new line
])
def test_gpt_oss_answers_split_at_harmonys_channels_as_its_text_holds_them(harmony, want):
    """gpt-oss's tokenizer marks harmony's <|...|> tokens special: the answer's text leaves them out, and the split
    reads the channels' names where they were (TensorRT-LLM's gpt-oss parser reads the same)."""
    text = re.sub(r"<\|[a-z]+\|>", "", harmony)  # what decode(skip_special_tokens=True) leaves of those tokens
    assert _whole(reasoning_parser("gpt-oss"), text) == want


def test_a_gpt_oss_target_and_one_whose_template_writes_think_are_split_by_default_others_not(tiny_dirs):
    from dflash_trt.models.gpt_oss import GptOssForCausalLM
    from dflash_trt.server.reasoning import default_parser

    assert default_parser(GptOssForCausalLM.__new__(GptOssForCausalLM)) is PARSERS["gpt_oss"]  # (its weights unused)
    engine = tiny_engine(tiny_dirs)
    assert default_parser(engine.target, engine.tokenizer.chat_template) is None
    qwen3 = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is false %}" \
            "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"  # Qwen3's generation prompt
    assert default_parser(engine.target, qwen3) is PARSERS["qwen3"]
    assert default_parser(engine.target, {"default": "{{ messages }}", "tool_use": qwen3}) is PARSERS["qwen3"]


def test_harmonys_channel_names_at_a_continued_messages_end_open_nothing():
    """gpt_oss's opening "tag" is the word "analysis": a continued final message may end with it."""
    assert not PARSERS["gpt_oss"].opened_by("<|start|>assistant<|channel|>final<|message|>Part of the analysis")


@pytest.mark.parametrize("prompt, closed", [
    ("<｜User｜>hi<｜Assistant｜><think>\n", False), ("<｜User｜>hi<｜Assistant｜><think>\n\n</think>\n\n", True),
    ("...<think>plan</think>The answer is", True), ("a question", False),
    ("<think>old</think> then a new turn: <think>\n", False),
])
def test_a_prompt_closes_deepseek_r1s_reasoning_where_its_last_tag_ends_it(prompt, closed):
    assert PARSERS["deepseek_r1"].closed_in(prompt) is closed
    assert not PARSERS["qwen3"].closed_in(prompt)  # its block is the answer's own to open, or not


@pytest.mark.parametrize("prompt, opened", [
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", True),  # Qwen3.5's, thinking on
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # thinking off: closed
    ("<|im_start|>user\nwhat does <think> do?<|im_end|>\n<|im_start|>assistant\n", False),  # a quoted tag
    ("<|im_start|>assistant\n", False),  # Qwen3's: the model writes its own <think>
])
def test_a_prompt_that_ends_with_think_opens_the_answers_reasoning_for_qwen3_read_as_deepseek_r1(prompt, opened):
    qwen3 = PARSERS["qwen3"]
    assert qwen3.opened_by(prompt) is opened
    assert qwen3.opened() is PARSERS["deepseek_r1"]  # reasoning from the start, and its structured-output grammar
    assert _whole(qwen3.opened(), "plan</think>answer") == ("plan", "answer")
    assert _whole(qwen3.opened(), "<think>plan</think>answer") == ("plan", "answer")  # (written again: dropped)


def test_each_parser_has_a_grammar_that_leaves_its_reasoning_free_before_a_structure():
    from dflash_trt.structured_output import REASONING_FORMATS

    assert sorted(PARSERS) == sorted(REASONING_FORMATS)  # the server passes its parser's name on to the grammar


def test_an_unknown_parser_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'granite'; choose from deepseek-r1, deepseek_r1"):
        reasoning_parser("granite")


@pytest.fixture(scope="module")
def answers(tiny_dirs):
    """The target's own greedy chat answers (plain decoding) to a few prompts: the oracle the split is taken of."""
    oracle = tiny_engine(tiny_dirs, max_batch_size=4, speculative=False)
    prompts = [f"tell me {i} things" for i in range(3)]
    outs = oracle.generate([oracle.encode(p, chat=True) for p in prompts], SamplingParams(max_new_tokens=24))
    return [(p, o.text) for p, o in zip(prompts, outs)]


def _chat(server, prompt: str, stream: bool) -> tuple[str | None, str | None, dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0,
            "stream": stream}
    if not stream:
        msg = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        return msg.get("reasoning"), msg["content"], msg
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=60) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    # no chunk carries nothing: text held back (a tag that may be beginning) waits for the next
    assert all(e["choices"][0]["delta"] or e["choices"][0]["finish_reason"] for e in events[1:]), deltas
    thought = "".join(d.get("reasoning", "") for d in deltas)
    said = "".join(d.get("content", "") for d in deltas)
    return thought or None, said, {}


def test_served_chat_answers_split_at_tags_taken_from_the_targets_own_answer(tiny_dirs, answers):
    """The tiny random model writes no <think>: the parser is given tags that occur in its greedy answer (two
    characters from its middle close the block; its first two open it, or the prompt is taken to have, or the
    prompt opens it, ending with the parser's opening tag); the server's split, streamed and not, must be the
    oracle's answer partitioned there."""
    engine = tiny_engine(tiny_dirs, max_batch_size=4)
    for prompt, text in answers[:2]:
        assert len(text) >= 8, text
        end = text[len(text) // 2: len(text) // 2 + 2]
        tail = engine.tokenizer.decode(engine.encode(prompt, chat=True)).rstrip()[-2:]
        assert not text.startswith(tail)
        for start in (text[:2], None, tail):
            opens = start == tail  # the chat prompt's last characters: the prompt opens the block
            parser = ReasoningParser("test", start is None, start or "\0", (end,))
            server = start_server(engine, reasoning=parser)
            try:
                reasoning, _, content = text[0 if opens else len(start or ""):].partition(end)
                for stream in (False, True):
                    got_reasoning, got_content, msg = _chat(server, prompt, stream)
                    said = content if stream else content or None  # (a stream's joined deltas: "")
                    assert (got_reasoning, got_content) == (reasoning or None, said), (stream, text, start, end)
                    if msg:
                        assert msg.get("reasoning_content") == msg.get("reasoning")
            finally:
                server.stop()


def test_an_answer_cut_inside_its_reasoning_has_no_content_and_without_a_parser_no_reasoning_keys(
        tiny_dirs, answers):
    prompt, text = answers[0]
    engine = tiny_engine(tiny_dirs, max_batch_size=4)
    server = start_server(engine, reasoning=ReasoningParser("test", True, "<never>", ("</never>",)))
    try:
        assert _chat(server, prompt, False)[:2] == (text, None)
        assert _chat(server, prompt, True)[:2] == (text, "")
    finally:
        server.stop()
    server = start_server(engine)
    try:
        msg = _chat(server, prompt, False)[2]
        assert msg == {"role": "assistant", "content": text}
    finally:
        server.stop()


def test_an_assistant_messages_reasoning_reaches_chat_templates_under_the_names_they_read(tiny_dirs):
    """Qwen3's template reads `reasoning_content`, gpt-oss's `thinking` (the analysis it renders before a call):
    passed as the first, transformers' apply_chat_template fills the second from it."""
    from transformers import AutoTokenizer

    from dflash_trt.server.protocol import ChatMessage

    tok = AutoTokenizer.from_pretrained(tiny_dirs["qwen3"])
    template = "{% for m in messages %}[{{ m.reasoning_content }}|{{ m.thinking }}|{{ m.content }}]{% endfor %}"

    def rendered(message: dict) -> str:
        return tok.apply_chat_template([ChatMessage.model_validate(message).for_template()], chat_template=template,
                                       tokenize=False)

    for key in ("reasoning", "reasoning_content"):
        assert rendered({"role": "assistant", "content": "4", key: "2 + 2"}) == "[2 + 2|2 + 2|4]"
    assert rendered({"role": "assistant", "content": "4"}) == "[||4]"


def test_usage_counts_the_reasoning_tokens_chat_streamed_and_responses(tiny_dirs, answers):
    """OpenAI's completion_tokens_details.reasoning_tokens (the Responses API's output_tokens_details): the answer's
    tokens up to its content, tags included; the tiny target's tokenizer writes a character a token, so the oracle is
    the oracle answer's reasoning and tags, counted in characters."""
    prompt, text = answers[0]
    end = text[len(text) // 2: len(text) // 2 + 2]
    server = start_server(tiny_engine(tiny_dirs, max_batch_size=4), reasoning=ReasoningParser("test", True, "\0",
                                                                                              (end,)))
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, "temperature": 0}
    want = text.index(end) + len(end)
    try:
        usage = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()["usage"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": want} and want < usage["completion_tokens"]
        with httpx.stream("POST", server.base_url + "/chat/completions", timeout=60, json=body | {
                "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": want}
        two = httpx.post(server.base_url + "/chat/completions", json=body | {"n": 2}, timeout=60).json()["usage"]
        assert two["completion_tokens_details"] == {"reasoning_tokens": 2 * want}  # (greedy: the same answer twice)
        r = httpx.post(server.base_url + "/responses", timeout=60, json={"input": prompt, "max_output_tokens": 24,
                                                                         "temperature": 0}).json()
        assert r["usage"]["output_tokens_details"] == {"reasoning_tokens": want}
        completion = httpx.post(server.base_url + "/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 4}).json()["usage"]
        assert "completion_tokens_details" not in completion  # (no reasoning split there)
    finally:
        server.stop()
    server = start_server(tiny_engine(tiny_dirs, max_batch_size=4))
    try:
        usage = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()["usage"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 0}
    finally:
        server.stop()
    # an answer that ends inside its reasoning: every token of it (those that write no whole character too)
    server = start_server(tiny_engine(tiny_dirs, max_batch_size=4), reasoning=ReasoningParser("test", True, "\0",
                                                                                              ("<never>",)))
    try:
        usage = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()["usage"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": usage["completion_tokens"]} == {
            "reasoning_tokens": 24}
    finally:
        server.stop()


@pytest.mark.parametrize("parser, answer, cut", [
    ("deepseek_r1", "thinking ünïcode😀😀</think>\n\nAnswer", 7),  # cut inside an emoji's bytes
    ("deepseek_r1", "thinking ünïcode😀😀</think>\n\nAnswer", 8),
    ("deepseek_r1", "thinking ünïcode😀😀</think>\n\nAnswer", None),
    ("qwen3", "<think>ok 你好</think>hi", 5),
    ("qwen3", "<think>ok 你好</think>hi", None),
    ("gpt_oss", "<|channel|>analysis<|message|>think ok<|end|><|start|>assistant<|channel|>final<|message|>hi", 6),
])
def test_reasoning_tokens_are_all_of_an_answer_cut_in_its_reasoning_else_those_up_to_its_end_tag(smollm2_dir, parser,
                                                                                             answer, cut):
    """SmolLM2's byte-level BPE (harmony's tokens added as special): an answer cut inside its reasoning is reasoning
    to its last token, a character's first bytes and special tokens too (they write no whole character); a whole
    answer's reasoning is the fewest tokens whose text ends in the tag that closes it."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from dflash_trt.engine.detokenizer import client_text

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    tok.add_tokens([AddedToken(t, special=True) for t in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")],
                   special_tokens=True)
    ids = tok.encode(answer, add_special_tokens=False)[:cut]
    splitter = ChatAnswerSplitter(PARSERS[parser], None)
    splitter.split(client_text(tok, ids))
    got = splitter.reasoning_tokens(tok, ids, ended_by_token=False)
    if cut is not None:
        assert got == len(ids) == cut
    else:
        closing = "</think>"
        assert client_text(tok, ids[:got]).endswith(closing) and not client_text(tok, ids[:got - 1]).endswith(closing)
