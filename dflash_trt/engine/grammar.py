"""Structured output's token masks, by llguidance (the grammar engine vLLM and SGLang use).

The contract stays lossless: a constrained answer is the target's own choice among the tokens the grammar allows at
each position, whether decoded one token at a time or speculatively. A speculative step asks for the mask at every
position it verifies, with the drafts before that position consumed by a copy of the request's matcher: a position
behind a draft the grammar refuses gets no mask, for no accepted path reaches it (the target's masked choice never
picks a refused token, so that draft is rejected, under every rule). Only committed tokens advance a request's own
matcher.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Collection, Sequence

import numpy as np
import torch

from dflash_trt.device_copy import host_to_device
from dflash_trt.structured_output import StructuredOutput

# Rust regex's metacharacters, which a choice's text escapes to match as written
_RUST_META = re.compile(r"([\\.+*?()|\[\]{}^$#&\-~])")


class GrammarError(ValueError):
    """A grammar llguidance cannot compile (a JSON schema it does not take, a malformed regex or Lark grammar)."""


def _reason(matcher) -> str:
    """A failed matcher's error, its first line (the next ones dump the parser's state and the whole grammar)."""
    lines = matcher.get_error().strip().splitlines()
    return lines[0][:300] if lines else "unknown error"


def _source(spec: StructuredOutput) -> tuple[str, str]:
    """-> (which of llguidance's builders takes it, its text)."""
    json_kind = "json" if spec.any_whitespace else "compact json"
    if spec.calls is not None:  # each function's parameters' schema, by the JSON builder
        return f"{json_kind} calls", json.dumps(spec.calls)
    if spec.json_object:
        return json_kind, '{"type": "object"}'
    if spec.json is not None:
        # (its keys in their order: a schema's properties come in the order it lists them)
        return json_kind, spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
    if spec.regex is not None:
        return "regex", spec.regex
    if spec.choice is not None:
        text = "|".join(_RUST_META.sub(r"\\\1", c).replace("\n", r"\n") for c in spec.choice)
        return "regex", f"(?:{text})"
    from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

    try:  # Lark as it is (it has a start rule); else GBNF, llama.cpp's and xgrammar's
        return "lark", any_to_lark(spec.grammar)
    except GbnfToLarkError as e:
        raise GrammarError(f"the grammar is neither Lark (no start rule) nor GBNF: {e}") from None


class GrammarCompiler:
    """One engine's grammars: the tokenizer's table of token bytes (built on first use, about 0.5 s for a 49k
    vocabulary) and a matcher per request, copied from the last 64 compiled ones (a structure after reasoning is
    two: itself, checked alone, and the whole)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._table = None
        self._lock = threading.Lock()  # the server's threads may ask for the first grammar at once
        # a server's clients send one schema again and again; a compile takes a millisecond and more
        self._compiled = functools.lru_cache(maxsize=64)(self._compile)

    def grammar(self, spec: StructuredOutput) -> "Grammar":
        """A fresh matcher of spec (GrammarError where llguidance refuses it, with its reason)."""
        if self._tokenizer is None:
            raise GrammarError("structured output needs the engine's tokenizer")
        how, text = _source(spec)
        return Grammar(self._compiled(how, text, spec.kind, spec.reasoning).deep_copy(), self.vocab_size, self._eos)

    def _compile(self, how: str, text: str, kind: str, reasoning: str | None):
        import llguidance

        with self._lock:
            if self._table is None:
                self._table = _ll_tokenizer(self._tokenizer, self.vocab_size, self._eos)
        if how.endswith(" calls"):
            how = how.removesuffix(" calls")
            arguments = {name: self._checked(how, schema if isinstance(schema, str) else json.dumps(schema),
                                             f"parameters' schema of {name!r}")
                         for name, schema in json.loads(text).items()}
            grammar = _harmony_call(arguments, self._special_token, self._call_end())
        elif reasoning is not None:
            grammar = _reasoning_first(reasoning, self._checked(how, text, kind), self._special_token)
        else:
            grammar = _built(how, text, kind)
        matcher = llguidance.LLMatcher(self._table, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {kind} does not compile: {_reason(matcher)}")
        matcher.compute_bitmask()  # some grammars (a schema that is only a reference to itself) fail at their first
        if matcher.is_error():
            raise GrammarError(f"the {kind} allows no answer: llguidance fails at its first token ({_reason(matcher)})")
        return matcher

    def _checked(self, how: str, text: str, kind: str) -> str:
        """The grammar of a structure a larger grammar holds, checked alone first: its own errors, and whether it
        has answers."""
        self._compiled(how, text, kind, None)
        return _built(how, text, kind)

    def _call_end(self) -> str | None:
        """harmony's <|call|> where the grammar writes it after a call: a special token that is no eos (gpt-oss's
        generation config makes it one, and the answer's eos is the grammar's end)."""
        ids = self._tokenizer.encode("<|call|>", add_special_tokens=False)
        return None if len(ids) == 1 and ids[0] in self._eos else self._special_token("<|call|>")

    def _special_token(self, tag: str) -> str | None:
        """The grammar's reference to tag where the tokenizer writes it as one special token, else None."""
        ids = self._tokenizer.encode(tag, add_special_tokens=False)
        return f"<[{ids[0]}]>" if len(ids) == 1 and self._table.is_special_token(ids[0]) else None


_HARMONY_TOKENS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")


def _harmony(special_token, *more: str) -> tuple[list[str], str]:
    """The references of harmony's special tokens (_HARMONY_TOKENS, then more), and the rules of its analysis
    messages (gpt-oss's reasoning: any text), each followed by the next message's header."""
    tags = (*_HARMONY_TOKENS, *more)
    refs = [special_token(t) for t in tags]
    if None in refs:
        missing = [t for t, r in zip(tags, refs) if r is None]
        raise GrammarError(f"gpt_oss reasoning needs harmony's special tokens; the tokenizer lacks {missing}")
    channel, message, end, start = refs[:4]
    return refs, (f'analysis: {channel} "analysis" {message} REASONING {end} {start} "assistant"\n'
                  "REASONING: /(?s:.*)/\n")


def _reasoning_first(fmt: str, answer: str, special_token) -> str:
    """The grammar of an answer that reasons first, in any text, in fmt's format (StructuredOutput.reasoning), then
    gives the answer grammar. special_token(tag): the Lark reference to tag where it is one special token, else None
    (its text; a special token's bytes are no text, so a text pattern never matches it)."""
    if fmt == "gpt_oss":
        (channel, message, *_), analysis = _harmony(special_token)
        top = f'start: analysis* {channel} "final" {message} @answer\n' + analysis
    else:
        opened, closed = special_token("<think>"), special_token("</think>")
        # reasoning up to its close: any text, then the close token; written as text, the first "</think>"
        thought = (f"thought: REASONING {closed}\nREASONING: /(?s:.*)/\n" if closed
                   else "thought[lazy]: /(?s:.*<\\/think>)/\n")
        if fmt == "qwen3":  # a block that opens the answer, or none
            top = f"start: ({opened or json.dumps('<think>')} thought)? @answer\n" + thought
        else:  # deepseek_r1: reasoning from the start (the prompt opened it; an opening the model writes is dropped,
            # and as text the lazy pattern takes it)
            top = f"start: {opened + '? ' if opened else ''}thought @answer\n" + thought
    return json.dumps({"grammars": [{"lark_grammar": top}, {**_only_grammar(answer), "name": "answer"}]})


def _harmony_call(arguments: dict[str, str], special_token, call_end: str | None) -> str:
    """The grammar of gpt-oss's call of one of some functions ({name: its arguments' grammar}): its analysis
    messages, then a commentary message to the function, as gpt-oss writes one (`<|channel|>commentary
    to=functions.NAME <|constrain|>json<|message|>`), holding its arguments; call_end after them where it is given."""
    (channel, message, _, _, constrain), analysis = _harmony(special_token, "<|constrain|>")
    calls = " | ".join(f'{channel} {json.dumps("commentary to=functions." + name)} " "? {constrain} "json" {message} '
                       f"@arguments{i}" for i, name in enumerate(arguments))
    top = f"start: analysis* ({calls}){' ' + call_end if call_end else ''}\n" + analysis
    return json.dumps({"grammars": [{"lark_grammar": top}, *({**_only_grammar(g), "name": f"arguments{i}"}
                                                              for i, g in enumerate(arguments.values()))]})


def _built(how: str, text: str, kind: str) -> str:
    """A structure's grammar by llguidance's builder `how` takes it with (_source)."""
    import llguidance

    m = llguidance.LLMatcher
    build = {"json": m.grammar_from_json_schema, "regex": m.grammar_from_regex, "lark": m.grammar_from_lark,
             "compact json": lambda s: m.grammar_from_json_schema(s, overrides={"whitespace_flexible": False})}[how]
    try:
        return build(text)
    except ValueError as e:
        raise GrammarError(f"the {kind} does not compile: {e}") from None


def _only_grammar(built: str) -> dict:
    """llguidance's one grammar of a builder's output: a top-level grammar's JSON, or Lark's text as it is."""
    if not built.lstrip().startswith("{"):
        return {"lark_grammar": built}
    grammars = json.loads(built)["grammars"]
    assert len(grammars) == 1, grammars
    return {k: v for k, v in grammars[0].items() if v is not None and k != "name"}


def _ll_tokenizer(tokenizer, vocab_size: int, eos: list[int]):
    import llguidance
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos or None)
    except ValueError:
        # a decoder llguidance does not read (a character-level one): each token's bytes as it decodes alone
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_DecodedTokens(tokenizer, eos)), n_vocab=vocab_size,
                                      eos_token=eos or None)


class _DecodedTokens:
    """What llguidance's TokenizerWrapper reads of a tokenizer whose decoder it does not know."""

    def __init__(self, tokenizer, eos: list[int]) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos[0] if eos else tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        # (tokens added as special, as harmony's are, count too: all_special_ids leaves them out)
        self.special_token_ids = sorted({*tokenizer.all_special_ids,
                                         *(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)})
        self.tokens = [tokenizer.decode([i]).encode() for i in range(len(tokenizer))]

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


class Grammar:
    """One request's matcher: the tokens it allows next, and the committed tokens it has consumed. A matcher that fails
    mid-answer (a limit of llguidance's parser, a grammar it takes but cannot run) allows only eos from then on and
    says why in `failure`: the request ends there, alone, where raising would fail every request in its step."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self._matcher = matcher
        self._vocab = vocab_size
        self._eos = [t for t in eos_token_ids if t < vocab_size]
        self.failure: str | None = None
        self.ended = False  # it has taken the model's eos, its end

    @property
    def failed(self) -> bool:
        if self.failure is None and self._matcher.is_error():
            self.failure = _reason(self._matcher)
        return self.failure is not None

    def blocked(self, extras: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
        """bool [n, V]: the tokens the grammar refuses at each position j, extras[j] the drafts before it (all False
        at a position no accepted path reaches)."""
        allowed = np.ones((len(extras), self._vocab), dtype=bool)
        for j, extra in enumerate(extras):
            if (m := self._after(extra)) is not None:
                allowed[j] = self._mask(m, committed=not extra)
        return host_to_device(torch.from_numpy(~allowed), device)

    def allowed_after(self, drafts: Sequence[int]) -> torch.Tensor:
        """bool [V] on the host: the tokens the grammar allows after the drafts (which it takes)."""
        return ~self.blocked([drafts], "cpu")[0]

    def allows(self, extra: Sequence[int], token: int) -> bool:
        """Whether the grammar takes token after the drafts `extra` (True where it refuses those drafts: no accepted
        path reaches that position)."""
        if (m := self._after(extra)) is None:
            return True
        if self.failed or m.is_error():
            return token in self._eos
        return m.try_consume_tokens([token]) == 1

    def _after(self, extra: Sequence[int]):
        """A copy of the matcher with the drafts consumed, None where it refuses them. A copy (3 us): a parser limit
        the drafts run into, or a rollback that fails, leaves llguidance's matcher failed for good, and a failure
        only a draft met must not end the request (the matcher sees the committed tokens alone)."""
        m = self._matcher.deep_copy()
        return m if self.failed or not extra or m.try_consume_tokens(list(extra)) == len(extra) else None

    def _mask(self, m, committed: bool) -> np.ndarray:
        """The tokens m allows next: eos alone where the request has failed, or m fails (computing the mask may fail
        it too; where m holds the committed tokens alone, the request's grammar has failed, as it would decoding
        plainly)."""
        if not (self.failed or m.is_error()):
            bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = bits[: self._vocab].astype(bool)
            # llguidance's mask where no token continues the grammar (one that needs a character the vocabulary
            # cannot write) holds token 0 alone: the answer ends there, at the model's eos, rather than with a token
            # the grammar refuses
            dead_end = allowed[0] and allowed.sum() == 1 and not m.validate_tokens([0])
            if not (dead_end or m.is_error()):
                return allowed
        if committed and m.is_error() and self.failure is None:
            self.failure = _reason(m)
        allowed = np.zeros(self._vocab, dtype=bool)
        allowed[self._eos] = True
        return allowed

    def commit(self, token: int) -> None:
        """An emitted token: every one the masks let through consumes (a stop token the grammar does not hold, which
        leaves the matcher failed, ends the answer anyway)."""
        self._matcher.consume_token(token)
        self.ended = token in self._eos
