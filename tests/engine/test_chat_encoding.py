"""LLMEngine.encode_chat: a conversation through the tokenizer's own chat template (the oracle), OpenAI's "developer"
role read as the system role where the template does not know it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflash_trt.engine.llm_engine import LLMEngine


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


def template(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_a_developer_message_is_the_system_message_where_the_template_has_no_developer_role(tokenizer):
    assert "developer" not in tokenizer.chat_template  # SmolLM2's: system, user, assistant
    engine = SimpleNamespace(tokenizer=tokenizer)
    asked = [{"role": "developer", "content": "Answer in French."}, {"role": "user", "content": "Hello"}]
    want = template(tokenizer, [{"role": "system", "content": "Answer in French."}, asked[1]])
    assert LLMEngine.encode_chat(engine, asked) == want
    assert LLMEngine.encode_chat(engine, asked[1:]) == template(tokenizer, asked[1:])
