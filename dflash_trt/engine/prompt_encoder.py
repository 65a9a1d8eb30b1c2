"""PromptEncoder: prompts (text, or a conversation through the chat template) to the target's token ids.

A prompt of more characters than max_model_len tokens could hold is refused before it is tokenized (PromptTooLong):
tokenizing megabytes takes seconds. A copy() holds its own tokenizer, so a server can tokenize a big prompt on one
thread while small ones go on another (one tokenizer is not called from two threads at once).
"""

from __future__ import annotations

import copy
import functools


class PromptTooLong(ValueError):
    """A prompt past max_model_len, told before it was tokenized."""


class PromptEncoder:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def copy(self) -> "PromptEncoder":
        """The same encoder over a tokenizer of its own (callable from another thread than this one's)."""
        return PromptEncoder(copy.deepcopy(self.tokenizer), self.max_model_len)

    def encode(self, prompt: str, chat: bool = False, add_special_tokens: bool = True) -> list[int]:
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        self.check_chars(prompt)
        return self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    template_kwargs: dict | None = None, add_special_tokens: bool = False,
                    tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template (or `chat_template`), with the generation
        prompt, or continuing the last (assistant) message where asked; template_kwargs reach the template (Qwen3's
        enable_thinking, ...), and so do tools (OpenAI's shape). add_special_tokens: the tokenizer's own special
        tokens too, as vLLM adds them to the rendered text (a BOS the template wrote comes twice)."""
        if isinstance(messages, (str, bytes)) or not all(isinstance(m, dict) for m in messages):
            # (a str's characters read as messages: "'str' object has no attribute 'get'")
            raise TypeError(f"messages must be a list of dicts such as {{'role': 'user', 'content': ...}}, got "
                            f"{messages!r:.60}")
        if not chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template: send plain text (/v1/completions, or generate "
                             "without --chat)")
        if "developer" not in str(chat_template or self.tokenizer.chat_template):  # a dict of named templates too
            # OpenAI's newer name for the system role: a template without it renders a turn of a role the model never
            # saw (SmolLM2's also adds its default system prompt before it)
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        options = dict(add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                       chat_template=chat_template, **({"tools": tools} if tools else {}), **(template_kwargs or {}))
        if add_special_tokens or chat_chars(messages, tools) > self.max_prompt_chars:
            # rendered once, as text: to tokenize with the tokenizer's own special tokens, or, likely too long, to be
            # sure before tokenizing (a template need not render every message)
            rendered = self.tokenizer.apply_chat_template(messages, tokenize=False, **options)
            self.check_chars(rendered if isinstance(rendered, str) else "")
            if add_special_tokens:
                return self.tokenizer(rendered, add_special_tokens=True)["input_ids"]
        ids = self.tokenizer.apply_chat_template(messages, tokenize=True, **options)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        if not all(isinstance(t, int) for t in ids):  # a template's variables that reached the call's own options
            raise ValueError("the chat template did not render to one list of token ids")
        return ids

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """More characters than any prompt that fits max_model_len tokens holds: no token stands for more characters
        than its own string has (a byte-level token's string has a character per byte; a SentencePiece piece's, one
        per character, or six for one byte), bar a normalizer's compositions (NFC's at most 3 to 1), given 4x, and
        characters a vocabulary has no token for, which vanish (a few control characters in SmolLM2's). Loose where
        a vocabulary holds very long tokens (runs of spaces) and the context is long."""
        pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        longest = max((len(piece) for piece in pieces if piece), default=1)
        normalizer = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "normalizer", True)
        return self.max_model_len * longest * (1 if normalizer is None else 4)

    def check_chars(self, text: str) -> None:
        """PromptTooLong where text has more characters than max_model_len tokens could hold."""
        if len(text) > self.max_prompt_chars:
            raise PromptTooLong(f"the prompt has {len(text)} characters, more than {self.max_model_len} tokens (this "
                                f"model's maximum context length) can hold")


# Characters counted for each message's turn markers (a template's own, which most render in more): a conversation of
# thousands of empty messages measured 0 characters, went to the small prompts' lane and was tokenized whole (15 s
# for 300,000, every other request waiting) before its 1.65M tokens were refused
CHAT_TURN_CHARS = 4


def chat_chars(messages: list[dict[str, str]], tools: list[dict] | None = None) -> int:
    """The characters of a conversation's fields (contents, tool calls, names: whatever a template may render) and
    tools, and CHAT_TURN_CHARS a message: about what its rendering holds."""
    return sum(sum(len(str(v)) for v in m.values() if v) + CHAT_TURN_CHARS for m in messages) + len(str(tools or ""))
