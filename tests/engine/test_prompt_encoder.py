"""PromptEncoder: a conversation through the tokenizer's own chat template (the oracle), OpenAI's "developer" role read
as the system role where the template does not know it; a prompt too long to fit refused before it is tokenized; a
copy that tokenizes alike on a tokenizer of its own."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.engine.prompt_encoder import PromptEncoder, PromptTooLong


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def template(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_a_developer_message_is_the_system_message_where_the_template_has_no_developer_role(tokenizer):
    assert "developer" not in tokenizer.chat_template  # SmolLM2's: system, user, assistant
    encoder = PromptEncoder(tokenizer, 2048)
    asked = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hello"}]
    want = template(tokenizer, [{"role": "system", "content": "Answer in French."}, asked[1]])
    assert encoder.encode_chat(asked) == want
    assert encoder.encode_chat(asked[1:]) == template(tokenizer, asked[1:])


class CountingTokenizer:
    """The tokenizer, counting the calls that tokenize."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.tokenized = tokenizer, 0

    def __call__(self, *args, **kwargs):
        self.tokenized += 1
        return self.tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args, tokenize=True, **kwargs):
        self.tokenized += tokenize
        return self.tokenizer.apply_chat_template(*args, tokenize=tokenize, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)


def test_a_prompt_past_what_the_context_can_hold_is_refused_before_it_is_tokenized(tokenizer):
    """Tokenizing megabytes takes seconds, which every request queued behind it waited out."""
    counting = CountingTokenizer(tokenizer)
    encoder = PromptEncoder(counting, 64)
    huge = "x " * (encoder.max_prompt_chars // 2 + 1)
    with pytest.raises(PromptTooLong, match=f"{len(huge)} characters, more than 64 tokens"):
        encoder.encode(huge)
    with pytest.raises(PromptTooLong):
        encoder.encode_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": huge}])
    assert counting.tokenized == 0
    # long content a template leaves out is no reason to refuse: what counts is the rendered prompt
    drops = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content[:10] }}{% endif %}{% endfor %}"
    assert encoder.encode_chat([{"role": "user", "content": huge}], chat_template=drops) == tokenizer("x x x x x ")[
        "input_ids"]
    assert encoder.encode("x " * 16) == tokenizer("x " * 16)["input_ids"]  # short prompts as ever


def test_a_conversation_of_empty_messages_past_what_the_context_holds_is_refused_before_it_is_tokenized(tokenizer):
    """Its contents measured 0 characters: 300,000 empty messages (a 10 MB body) were tokenized whole, 15 s on the
    small prompts' lane that every other request waits on, before their 1.65M tokens were refused."""
    counting = CountingTokenizer(tokenizer)
    encoder = PromptEncoder(counting, 64)
    empty = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}] * (encoder.max_prompt_chars // 2)
    with pytest.raises(PromptTooLong):
        encoder.encode_chat(empty)
    assert counting.tokenized == 0
    few = empty[:4]  # as ever
    assert encoder.encode_chat(few) == template(tokenizer, few)


def test_tools_and_every_field_of_a_message_count_toward_the_check_before_tokenizing(tokenizer):
    """Only contents and tool calls were counted: a tool's description of a million characters, which templates
    that render tools write out, was tokenized whole (3.6 s) before the prompt was found too long."""
    counting = CountingTokenizer(tokenizer)
    encoder = PromptEncoder(counting, 64)
    huge = "x " * (encoder.max_prompt_chars // 2 + 1)
    renders_tools = "{% for t in tools %}{{ t.function.description }}{% endfor %}{{ messages[0].content }}"
    tools = [{"type": "function", "function": {"name": "f", "description": huge}}]
    with pytest.raises(PromptTooLong):
        encoder.encode_chat([{"role": "user", "content": "hi"}], chat_template=renders_tools, tools=tools)
    renders_names = "{% for m in messages %}{{ m.name }}{% endfor %}"
    with pytest.raises(PromptTooLong):
        encoder.encode_chat([{"role": "user", "content": "hi", "name": huge}], chat_template=renders_names)
    assert counting.tokenized == 0


@settings(max_examples=80, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=400))
def test_no_prompt_that_fits_holds_more_characters_than_the_bound(tokenizer, text):
    """The bound's premise against the tokenizer itself: a prompt of n tokens has at most n x (the longest token's
    string) characters, so one of more than max_model_len x that cannot fit. Control characters aside: SmolLM2's
    vocabulary has no token for six of them, which vanish (a prompt of them alone is empty)."""
    encoder = PromptEncoder(tokenizer, 1)
    assert len(text) <= len(tokenizer(text)["input_ids"]) * encoder.max_prompt_chars


def test_a_copy_tokenizes_alike_on_a_tokenizer_of_its_own(tokenizer):
    """A server's lane for big prompts: the same ids, from another tokenizer object (never called from two threads)."""
    encoder = PromptEncoder(tokenizer, 2048)
    other = encoder.copy()
    assert other.tokenizer is not tokenizer and other.max_model_len == 2048
    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    assert other.encode_chat(messages) == encoder.encode_chat(messages) == template(tokenizer, messages)
    assert other.encode("a b c") == tokenizer("a b c")["input_ids"]


def test_add_special_tokens_is_the_tokenizers_own_bos_before_a_prompt_or_a_rendered_conversation(tmp_path):
    """vLLM's add_special_tokens: on by default for text prompts, off for conversations (whose template writes the
    BOS), where asked the tokenizer's own added to the rendered text, a BOS twice."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    from tests.conftest import save_char_tokenizer

    save_char_tokenizer(tmp_path, 128)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                                             special_tokens=[("<s>", 1)])
    encoder, bos, hi = PromptEncoder(tokenizer, 256), 1, tokenizer.convert_tokens_to_ids(["h", "i"])
    assert encoder.encode("hi") == [bos, *hi] and encoder.encode("hi", add_special_tokens=False) == hi
    chat = [{"role": "user", "content": "hi"}]
    assert encoder.encode_chat(chat) == template(tokenizer, chat) == [bos, *hi, tokenizer.convert_tokens_to_ids(">")]
    assert encoder.encode_chat(chat, add_special_tokens=True) == [bos, *template(tokenizer, chat)]
