"""LLMEngine.encode_chat: a conversation through the tokenizer's own chat template (the oracle), OpenAI's "developer"
role read as the system role where the template does not know it; a prompt too long to fit refused before it is
tokenized."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_trt.engine.llm_engine import LLMEngine, PromptTooLong


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def template(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_a_developer_message_is_the_system_message_where_the_template_has_no_developer_role(tokenizer):
    assert "developer" not in tokenizer.chat_template  # SmolLM2's: system, user, assistant
    engine = SimpleNamespace(tokenizer=tokenizer, max_prompt_chars=10**6)
    asked = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hello"}]
    want = template(tokenizer, [{"role": "system", "content": "Answer in French."}, asked[1]])
    assert LLMEngine.encode_chat(engine, asked) == want
    assert LLMEngine.encode_chat(engine, asked[1:]) == template(tokenizer, asked[1:])


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


def _engine(tokenizer, max_model_len: int) -> LLMEngine:
    engine = LLMEngine.__new__(LLMEngine)  # the tokenizer's side of an engine; no model is needed
    engine.tokenizer, engine.max_model_len = tokenizer, max_model_len
    return engine


def test_a_prompt_past_what_the_context_can_hold_is_refused_before_it_is_tokenized(tokenizer):
    """Tokenizing megabytes takes seconds, which every request queued behind it waited out."""
    counting = CountingTokenizer(tokenizer)
    engine = _engine(counting, 64)
    huge = "x " * (engine.max_prompt_chars // 2 + 1)
    with pytest.raises(PromptTooLong, match=f"{len(huge)} characters, more than 64 tokens"):
        engine.encode(huge)
    with pytest.raises(PromptTooLong):
        engine.encode_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": huge}])
    assert counting.tokenized == 0
    # long content a template leaves out is no reason to refuse: what counts is the rendered prompt
    drops = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content[:10] }}{% endif %}{% endfor %}"
    assert engine.encode_chat([{"role": "user", "content": huge}], chat_template=drops) == tokenizer("x x x x x ")[
        "input_ids"]
    assert engine.encode("x " * 16) == tokenizer("x " * 16)["input_ids"]  # short prompts as ever


@settings(max_examples=80, deadline=None)
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=400))
def test_no_prompt_that_fits_holds_more_characters_than_the_bound(tokenizer, text):
    """The bound's premise against the tokenizer itself: a prompt of n tokens has at most n x (the longest token's
    string) characters, so one of more than max_model_len x that cannot fit. Control characters aside: SmolLM2's
    vocabulary has no token for six of them, which vanish (a prompt of them alone is empty)."""
    engine = _engine(tokenizer, 1)
    assert len(text) <= len(tokenizer(text)["input_ids"]) * engine.max_prompt_chars
