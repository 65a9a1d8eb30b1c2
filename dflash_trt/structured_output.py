"""What an answer must match (vLLM's structured outputs, OpenAI's response_format): a JSON schema, any JSON object, a
regular expression, one of some strings, or a grammar. The engine masks the target's logits by it at every position
it decodes or verifies (engine/grammar.py); no torch here."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["json", "json_object", "regex", "choice", "grammar", "calls"]
# the formats a thinking model reasons in before its answer, by vLLM's reasoning parsers' names (server/reasoning.py)
REASONING_FORMATS = ("deepseek_r1", "qwen3", "gpt_oss")
HARMONY_NAME = re.compile(r"[\w.\-]+")  # a function's name as harmony's recipient holds it (to=functions.NAME)


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one of: json (a JSON schema, as a dict or its text), json_object (any JSON object), regex (the whole
    answer matches it; Rust's regex syntax, as vLLM's llguidance backend takes it), choice (the answer is one of these
    strings) or grammar (a Lark grammar, with its start rule, or GBNF). any_whitespace: JSON may put whitespace between
    its tokens (llguidance's default, vLLM's too); False: none (vLLM's disable_any_whitespace), which keeps a small
    model from writing whitespace for ever.

    reasoning: the answer first reasons, in any text, in that format of REASONING_FORMATS, and the structure holds
    what follows (as vLLM applies it once a reasoning parser's reasoning ends): deepseek_r1, reasoning up to
    `</think>` (the prompt opened it); qwen3, an optional `<think>...</think>` block; gpt_oss, harmony's analysis
    messages before its final one. The answer cannot end inside its reasoning, nor put special or added tokens
    there (llguidance reads them as no text).

    calls, in place of the one structure: the answer calls one of these functions ({name: its parameters' JSON
    schema}) in its reasoning format's own form of a call, the arguments held to the function's schema: gpt_oss
    only, a harmony commentary message to the function (`<|channel|>commentary to=functions.NAME <|constrain|>json
    <|message|>{...}`), as gpt-oss is trained to call, after its analysis messages."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    any_whitespace: bool = True
    reasoning: str | None = None
    calls: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "calls") if getattr(self, k) is not None]
        for name in ("json_object", "any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r:.80}")
        if self.reasoning is not None and self.reasoning not in REASONING_FORMATS:
            raise ValueError(f"reasoning must be one of {', '.join(REASONING_FORMATS)} or None, "
                             f"got {self.reasoning!r:.80}")
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("structured output takes exactly one of json, json_object, regex, choice, grammar and "
                             f"calls, got {', '.join(given) or 'none'}")
        if self.json is not None:
            _check_schema(self.json, "the JSON schema")
        if self.calls is not None:
            if self.reasoning != "gpt_oss":
                raise ValueError(f"calls are made in gpt_oss's form (harmony's), with reasoning 'gpt_oss', got "
                                 f"reasoning {self.reasoning!r:.80}; other formats call in JSON (json)")
            if not (isinstance(self.calls, dict) and self.calls):
                raise ValueError(f"calls must be a non-empty object of function names and schemas, got "
                                 f"{self.calls!r:.80}")
            for name, schema in self.calls.items():
                if not (isinstance(name, str) and HARMONY_NAME.fullmatch(name)):
                    raise ValueError(f"a function's name is letters, digits, '_', '.' and '-', got {name!r:.80}")
                _check_schema(schema, f"{name!r}'s parameters' schema")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r:.80}")
        if self.choice is not None:
            if not (isinstance(self.choice, (list, tuple)) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r:.80}")
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> Kind:
        return "json_object" if self.json_object else next(
            k for k in ("json", "regex", "choice", "grammar", "calls") if getattr(self, k) is not None)


def _check_schema(schema: Any, what: str) -> None:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"{what} is no JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):  # true and false are schemas too (anything; nothing)
        raise ValueError(f"{what} must be an object, got {type(schema).__name__}")
