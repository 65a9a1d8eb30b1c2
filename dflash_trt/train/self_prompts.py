"""User prompts written by the target itself (Magpie: Xu et al., 2024, arXiv 2406.08464).

An instruction-tuned target, given its chat template up to the start of a user turn and nothing else, samples
a plausible user request: chat questions, advice, code and maths problems, in the mix its own instruction data
had. The packaged corpora (train/prompts.py) are mostly Shakespeare passages and short chatterbot lines; these
prompts cover what a deployed assistant is actually asked, so the drafter learns the answers it will verify.
A persona's system message steers the mix (a coding persona writes coding requests); the responses are then
generated under the target's own default template, as users' requests are.

Sampling depends on the runtime's numerics, so the prompt texts are generated once and stored with the records,
never regenerated to rebuild a record's id.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from dflash_trt.engine.llm_engine import LLMEngine
from dflash_trt.sampling_params import SamplingParams
from dflash_trt.train.prompts import Prompt, stable_hash
from dflash_trt.train.responses import generate_responses

logger = logging.getLogger(__name__)

_MARK = "\x00USER\x00"


@dataclass(frozen=True)
class Persona:
    name: str
    system: str | None  # None: the template's default system message


PERSONAS = (
    Persona("chat", None),
    Persona("code", "You are an expert programmer. Users ask you to write, explain and fix code in Python, "
                    "JavaScript, SQL and other languages."),
    Persona("math", "You are a patient math tutor. Users ask you arithmetic, algebra, geometry and word problems "
                    "and you solve them step by step."),
    Persona("qa", "You are a knowledgeable assistant. Users ask you factual questions about science, history, "
                  "geography, health, economics and everyday life, and you explain the answers clearly."),
    Persona("writing", "You are a creative writing assistant. Users ask you to write poems, short stories, emails, "
                       "letters, descriptions and other texts."),
)
# Asked of the target under a summarizer persona, it pastes a paragraph and forgets the request (2 in 32 kept):
# summarization requests are built instead from its own answers to the qa persona (summary_requests).
SUMMARY_SOURCE = "self/summarization"
_SUMMARY_TEMPLATES = (
    "Summarize: {text}",
    "Summarize in one sentence: {text}",
    "Summarize in two sentences: {text}",
    "Give a short summary: {text}",
    "Summarize the main idea: {text}",
    "Summarize the key point: {text}",
)


def user_turn_prefix(tokenizer, system: str | None) -> list[int]:
    """Token ids of the chat template up to (not including) the first user message's text."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": _MARK}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    if _MARK not in text:
        raise ValueError("the tokenizer's chat template does not place the user's message verbatim")
    return tokenizer(text[: text.index(_MARK)], add_special_tokens=False)["input_ids"]


def acceptable(text: str, min_chars: int = 16, max_chars: int = 800) -> bool:
    """A finished request in readable English-like text: not too short or long, mostly printable ASCII, and
    something a user asks or tells an assistant (a question or a request), not a story the model drifted into."""
    text = text.strip()
    if not min_chars <= len(text) <= max_chars or not _readable(text):
        return False
    return "?" in text or text.split()[0].lower() in _REQUEST_OPENERS


def _readable(text: str) -> bool:
    """Mostly printable ASCII (the target's samples drift into other scripts and control characters)."""
    return sum(c.isascii() and (c.isprintable() or c in "\n\t") for c in text) >= 0.97 * len(text)


_REQUEST_OPENERS = {
    "write", "explain", "describe", "create", "give", "list", "help", "calculate", "solve", "find", "compute",
    "implement", "show", "tell", "suggest", "summarize", "compare", "design", "make", "generate", "convert",
    "translate", "fix", "debug", "define", "provide", "plan", "recommend", "outline", "draft", "prove", "simplify",
    "evaluate", "determine", "i", "i'm", "i've", "my", "please", "can", "could", "how", "what", "why", "when",
}


def generate_self_prompts(
    engine: LLMEngine,
    num_per_persona: int,
    personas: tuple[Persona, ...] = PERSONAS,
    seed: int = 0,
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_p: float = 0.95,
    exclude: set[str] = frozenset(),
    chunk: int = 128,
    done: list[Prompt] = (),
    on_persona: Callable[[list[Prompt]], None] | None = None,
) -> list[Prompt]:
    """Sample candidate requests per persona until num_per_persona acceptable, distinct ones are found (or
    4x that many were tried); source "self/<persona>". Texts in `exclude` (e.g. a benchmark's prompts) are
    dropped. Seeded per candidate, so a run on the same runtime and machine repeats. `done`: the prompts of
    personas finished before (an interrupted run's), kept and not sampled again; on_persona(prompts so far) after
    each persona, to keep them."""
    seen = {t.strip().lower() for t in exclude} | {p.text.strip().lower() for p in done}
    out: list[Prompt] = list(done)
    finished = {p.source for p in done}
    for p_index, persona in enumerate(personas):
        if f"self/{persona.name}" in finished:
            continue
        prefix = user_turn_prefix(engine.tokenizer, persona.system)
        kept, tried = 0, 0
        bar = tqdm(total=num_per_persona, desc=f"self prompts ({persona.name})", unit="prompt", dynamic_ncols=True)
        while kept < num_per_persona and tried < 4 * num_per_persona:
            n = min(chunk, 4 * num_per_persona - tried)  # the engine batches them in its rows
            params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                     seed=(seed * len(personas) + p_index) * 10_000_000 + tried + i) for i in range(n)]
            tried += n
            for o in engine.generate([prefix] * n, params):
                text = o.text.strip()
                if o.finish_reason != "stop" or not acceptable(text) or text.lower() in seen:
                    continue
                seen.add(text.lower())
                out.append(Prompt(text, f"self/{persona.name}"))
                kept += 1
                bar.update(1)
                if kept == num_per_persona:
                    break
        bar.close()
        if kept < num_per_persona:
            logger.warning("persona %s: %d of %d prompts after %d tries", persona.name, kept, num_per_persona, tried)
        if on_persona is not None:
            on_persona(out)
    return out


def passage_of(answer: str, max_chars: int = 500) -> str | None:
    """The answer's leading whole sentences, on one line, up to max_chars; None when that is under two sentences
    or 120 characters, or is not prose a summary request would quote: code or markup, a numbered list (a
    "sentence" under three words), or a sentence said twice (the target's repetition loops)."""
    if any(mark in answer for mark in ("```", "<", "{", "|")):
        return None
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(answer.split()))
    kept: list[str] = []
    for sentence in sentences:
        if sum(map(len, kept)) + len(kept) + len(sentence) > max_chars:
            break
        kept.append(sentence)
    text = " ".join(kept)
    if len(kept) < 2 or len(text) < 120 or not text.endswith((".", "!", "?")):
        return None
    if len({s.lower() for s in kept}) < len(kept) or min(len(s.split()) for s in kept) < 3:
        return None
    return text if _readable(text) else None


def summary_requests(answers: list[str], exclude: set[str] = frozenset()) -> list[Prompt]:
    """A summarization request (source SUMMARY_SOURCE) for each answer that has a passage_of, in order; the
    template is chosen by a hash of the passage, so the same answers always give the same requests."""
    seen = {t.strip().lower() for t in exclude}
    out = []
    for answer in answers:
        passage = passage_of(answer)
        if passage is None:
            continue
        text = _SUMMARY_TEMPLATES[stable_hash(passage) % len(_SUMMARY_TEMPLATES)].format(text=passage)
        if text.lower() not in seen:
            seen.add(text.lower())
            out.append(Prompt(text, SUMMARY_SOURCE))
    return out


def qa_answers(records: list[dict], tokenizer) -> list[str]:
    """The texts of the greedy answers to the qa persona's requests, in prompt order (summary_requests' input)."""
    qa = [r for r in records if r["source"] == "self/qa" and r["mode"] == "greedy"]
    qa.sort(key=lambda r: int(r["id"].split(":")[0]))
    return [tokenizer.decode(r["response_ids"], skip_special_tokens=True) for r in qa]


def answer_with_summaries(engine: LLMEngine, tokenizer, prompts: list[Prompt], out_path: Path, exclude: set[str],
                          store: Callable[[list[Prompt]], None] | None = None,
                          **generate) -> tuple[list[Prompt], list[dict]]:
    """Answer prompts (generate_responses, its keyword arguments in generate), then the summarization requests
    quoting the qa answers among them; returns (summaries, records of prompts + summaries).

    store(summaries) runs before they are answered: records name prompts by position, so a caller that keeps its
    prompts file in step with the records stores the summaries first.
    """
    records = generate_responses(engine, prompts, out_path, **generate)
    summaries = summary_requests(qa_answers(records, tokenizer), set(exclude) | {p.text for p in prompts})
    if not summaries:  # none without qa answers: nothing to store or answer
        return [], records
    if store is not None:
        store(summaries)
    return summaries, generate_responses(engine, list(prompts) + summaries, out_path, **generate)


def read_prompts(path: Path) -> list[Prompt]:
    """Prompts stored one JSON object ({text, source}) per line."""
    out = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompt = Prompt(**json.loads(line))  # bytes that are not UTF-8 raise a ValueError here
            if not isinstance(prompt.text, str) or not isinstance(prompt.source, str):
                raise TypeError
            out.append(prompt)
        except (ValueError, TypeError):  # not JSON, or not {text, source}
            # Records name prompts by position: a prompt dropped or made up would relabel every one after it.
            raise ValueError(f"{path} line {n} is not a prompt (JSON with text, source): restore the file, or pass "
                             "another --data") from None
    return out


def write_prompts(path: Path, prompts: list[Prompt]) -> None:
    """Store prompts for read_prompts, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"text": p.text, "source": p.source}) + "\n" for p in prompts))
    tmp.replace(path)


def cached_self_prompts(engine: LLMEngine, path: Path, num_per_persona: int, exclude: set[str] = frozenset(),
                        **sampling) -> list[Prompt]:
    """The prompts stored at path, else generated (generate_self_prompts, its keyword arguments in sampling) and
    stored. A rerun reuses them: records name prompts by position, and a regeneration on other numerics would sample
    other texts."""
    asked = path.with_suffix(".meta.json")  # the count they were written for (data from before it has none)
    partial = path.with_suffix(".partial.jsonl")  # finished personas of an interrupted run
    try:
        written_for = json.loads(asked.read_text())["per_persona"]
    except (OSError, ValueError, KeyError, TypeError):
        written_for = None
    if path.is_file():
        prompts = read_prompts(path)
        if written_for not in (None, num_per_persona):  # else another count would change nothing, unseen
            logger.warning("%s: reusing its %d self-written prompts, written for %d per persona, not the %d asked now "
                           "(records name prompts by position); for others, pass a new --data", path, len(prompts),
                           written_for, num_per_persona)
        else:
            logger.info("%s: %d self-written prompts (reused)", path, len(prompts))
        return prompts
    done = read_prompts(partial) if partial.is_file() and written_for == num_per_persona else []
    if done:
        logger.info("%s: %d self-written prompts of finished personas kept from an interrupted run", partial, len(done))
    else:  # another count's: the meta written next would otherwise make a later run take it for this one's
        partial.unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    asked.write_text(json.dumps({"per_persona": num_per_persona}) + "\n")
    prompts = generate_self_prompts(engine, num_per_persona, exclude=exclude, done=done,
                                    on_persona=lambda so_far: write_prompts(partial, so_far), **sampling)
    write_prompts(path, prompts)
    partial.unlink(missing_ok=True)
    return prompts
