"""A thinking model's chat answer split into its reasoning and its content, as `--reasoning-parser` does in vLLM and
trtllm-serve: the text inside a `<think>...</think>` block goes to the message's `reasoning` (and
`reasoning_content`, the name DeepSeek and TensorRT-LLM use), the rest to its `content`.

The split reads the answer's text as the client gets it (after stop strings and incomplete characters are held
back), so it applies alike to a streamed answer, fed delta by delta, and to a whole one: text that may begin a tag is
held back until the next delta says whether it does.

- deepseek_r1: the answer is reasoning from its start (DeepSeek-R1's template, and Qwen3's thinking-only models',
  open the block in the prompt; a `<think>` the model writes itself is dropped) up to `</think>`; without one, all of
  it is reasoning (a thinking model cut by max_tokens).
- qwen3: reasoning where the answer opens with `<think>` (Qwen3 with enable_thinking off writes none, and its
  answer is all content), or where the prompt ends with one (Qwen3.5's and Qwen3.6's templates open the block for the
  answer, thinking on: read as deepseek_r1 reads it).
- gpt_oss: harmony's channels as the answer's text holds them, their special tokens left out (TensorRT-LLM's gpt-oss
  parser reads the same): `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`
  is "analysis...assistantfinal...": reasoning from "analysis" to "assistantfinal" (a second analysis message,
  "assistantanalysis...", goes on the reasoning on a new line); an answer that opens in the final channel
  ("final...") is all content. A commentary message without a recipient (a preamble: "assistantcommentary...") is
  content too, as vLLM shows it; a further final or commentary message goes on the content on a new line (a
  commentary message to a function is a tool call, read out before: server/tool_calls.py). The default for a
  gpt-oss target, whose answers are unreadable unsplit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    starts_thinking: bool  # the answer is reasoning from its start, opened by the prompt
    start: str = THINK_START
    ends: tuple[str, ...] = (THINK_END,)  # what ends the reasoning, its content beginning
    # what opens an answer without reasoning, dropped (harmony's final and commentary channels' names)
    content_starts: tuple[str, ...] = ()
    reasoning_break: str = ""  # what begins a further message of reasoning (harmony's), read as a new line
    content_breaks: tuple[str, ...] = ()  # what begins a further message of content (harmony's), read as a new line

    def closed_in(self, prompt: str) -> bool:
        """Whether a prompt (its text with special tokens written out) leaves a reasoning it opens closed, as vLLM
        reads a prompt's tags: deepseek_r1's, where the prompt's last tag ends the block (a template that turns
        thinking off writes it closed; a continued message after it). The answer is all content then, and a
        structure holds it from its start. Others: never (qwen3's block is the answer's own to open). As vLLM's, a
        `</think>` a message quotes counts too, where the template does not open the answer's block after it."""
        return self.starts_thinking and max(prompt.rfind(end) for end in self.ends) > prompt.rfind(self.start)

    def opened_by(self, prompt: str) -> bool:
        """Whether a prompt (its text with special tokens written out) ends by opening the answer's reasoning: Qwen3.5's
        and Qwen3.6's templates, thinking on, end the generation prompt with `<think>`, where Qwen3's left the model
        to write it. Only a tag at the prompt's very end counts: a message that quotes one opens nothing where the
        template closes the message after it (a prompt without a generation prompt may end with the quote); and only
        a tag's (harmony's channel names are words a continued message may end with)."""
        return bool(self.start) and not self.content_starts and prompt.rstrip().endswith(self.start)

    def opened(self) -> ReasoningParser:
        """This parser for an answer whose reasoning the prompt opened: reasoning from its start up to the end tag, as
        deepseek_r1 reads `<think>` tags (whose grammar a structure then follows)."""
        if self.starts_thinking:
            return self
        return PARSERS["deepseek_r1"] if (self.start, self.ends) == (THINK_START, (THINK_END,)) else replace(
            self, starts_thinking=True)


_HARMONY_CONTENT = ("assistantfinal", "assistantcommentary")
PARSERS = {p.name: p for p in (ReasoningParser("deepseek_r1", True), ReasoningParser("qwen3", False),
                               ReasoningParser("gpt_oss", False, "analysis", _HARMONY_CONTENT,
                                               ("final", "commentary"), "assistantanalysis", _HARMONY_CONTENT))}
ALIASES = {"deepseek-r1": "deepseek_r1", "gpt-oss": "gpt_oss"}  # TensorRT-LLM's spellings


def parser_named(kind: str, parsers: dict[str, Any], aliases: dict[str, str], name: str | None) -> Any:
    """The parser of `kind` (its registry and other names) named, by vLLM's or TensorRT-LLM's name; None for None
    or "none" (the options' word for none)."""
    if name is None or name == "none":
        return None
    key = aliases.get(name, name)
    if key not in parsers:
        raise ValueError(f"unknown {kind} parser {name!r}; choose from {', '.join(sorted([*parsers, *aliases]))}")
    return parsers[key]


def reasoning_parser(name: str | None) -> ReasoningParser | None:
    """The parser named (vLLM's or TensorRT-LLM's spelling); None for None or "none"."""
    return parser_named("reasoning", PARSERS, ALIASES, name)


def template_text(chat_template: str | dict[str, str] | None) -> str:
    """A tokenizer's chat template as one text: a tokenizer may keep several named ones (the default renders chat,
    "tool_use" ones tools)."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    return "\n".join(t for t in templates if isinstance(t, str))


def default_parser(target, chat_template: str | dict[str, str] | None = None) -> ReasoningParser | None:
    """The parser a target's chat answers take unless the server is told otherwise: gpt-oss's (vLLM parses its
    harmony output always); qwen3 where the chat template writes `<think>` (Qwen3, Qwen3.5, Qwen3.6, DeepSeek-R1's
    distills: a block the answer or the prompt opens; a tool call it only thinks of is then no call); None for
    others, which answer readably unsplit."""
    from dflash_trt.models.gpt_oss import GptOssForCausalLM

    if isinstance(target, GptOssForCausalLM):
        return PARSERS["gpt_oss"]
    return PARSERS["qwen3"] if THINK_START in template_text(chat_template) else None


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag without completing it."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def first_tag(text: str, tags: Sequence[str]) -> tuple[int, str] | None:
    """Where the first of tags in text begins and which (of those at one place the longest); None where none does."""
    found = [(at, -len(tag), tag) for tag in tags if (at := text.find(tag)) >= 0]
    return (min(found)[0], min(found)[2]) if found else None


def held_back(text: str, tags: Sequence[str], final: bool) -> int:
    """How much of text's end may begin one of tags: held until the next delta says, none after the last."""
    return 0 if final else max((partial_tag(text, tag) for tag in tags), default=0)


class ReasoningSplitter:
    """One answer's text, fed in order, sent on as (reasoning, content) deltas."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self._state = "start"  # start (nothing read yet), reasoning, content
        self._thought = False  # whether the answer opened with reasoning
        self._said = False  # whether its content has said anything
        self._held = ""
        self._fed = 0  # the characters fed so far
        self._content_at: int | None = None  # the character its content begins at, once it has

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """The reasoning and content of text, the answer's next delta; `final` with its last (nothing held back)."""
        at, self._fed = self._fed - len(self._held), self._fed + len(text)  # (at: where the text read now begins)
        text, self._held = self._held + text, ""
        whole = len(text)
        reasoning = ""
        start, ends = self.parser.start, self.parser.ends
        if self._state == "start":
            openers = [o for o in (start, *self.parser.content_starts) if o]
            if not final and any(o.startswith(text) and text != o for o in openers):
                self._held = text  # may yet be an opening tag
                return "", ""
            opened = text.startswith(start)
            if opened:
                text = text[len(start):]
            elif opener := next((o for o in self.parser.content_starts if text.startswith(o)), None):
                text = text[len(opener):]
            self._state = "reasoning" if opened or self.parser.starts_thinking else "content"
            self._thought = self._state == "reasoning"
        if self._state == "reasoning":
            tags = [*ends, *([self.parser.reasoning_break] if self.parser.reasoning_break else [])]
            parts = []
            while True:
                if (found := first_tag(text, tags)) is None:
                    keep = held_back(text, tags, final)
                    parts.append(text[:len(text) - keep])
                    self._held = text[len(text) - keep:]
                    return "".join(parts), ""
                cut, tag = found
                parts.append(text[:cut])
                text = text[cut + len(tag):]
                if tag in ends:
                    break
                parts.append("\n")
            reasoning = "".join(parts)
            self._state, self._content_at = "content", at + whole - len(text)
        return reasoning, self._content(text, final) if self.parser.content_breaks else text

    def _content(self, text: str, final: bool) -> str:
        tags, parts = self.parser.content_breaks, []
        while True:
            if (found := first_tag(text, tags)) is None:
                keep = held_back(text, tags, final)
                parts.append(text[:len(text) - keep])
                self._held = text[len(text) - keep:]
                break
            cut, tag = found
            parts.append(text[:cut])
            self._said |= bool(text[:cut])
            parts.append("\n" if self._said else "")  # (a message after one that said nothing: no blank line)
            text = text[cut + len(tag):]
        said = "".join(parts)
        self._said |= bool(said)
        return said

    @property
    def thought(self) -> bool:
        """Whether the answer opened with reasoning (read so far)."""
        return self._thought

    @property
    def reasoning_chars(self) -> int:
        """How many of the characters fed so far are the answer's reasoning and its tags (all of them while it
        reasons; none where it opened without reasoning)."""
        if not self._thought:
            return 0
        return self._fed if self._content_at is None else self._content_at

    @property
    def in_reasoning(self) -> bool:
        """Whether the text read so far ends inside the reasoning (its content has not begun)."""
        return self._state == "reasoning"
