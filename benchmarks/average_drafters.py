"""Average drafters' weights: a "model soup" of checkpoints from one training lineage (issue 3, session 32).

Continuations of one drafter stay close enough in weight space that their element-wise mean is itself a drafter,
often a better one than each (Wortsman et al., arXiv 2203.05482). Every drafter must have the same config.json (its
shapes, target layers and mask token); the first one's config.json and draft_vocab.json are copied (a draft
vocabulary selects rows of the target's frozen output head, so it does not enter the average). Averaged in fp32,
saved in the first one's dtype.

    PYTHONPATH=. .venv/bin/python benchmarks/average_drafters.py OUT drafters/smollm2-135m-dflash RUN/drafter ...
    PYTHONPATH=. .venv/bin/python benchmarks/average_drafters.py OUT A:0.75 B:0.25     # weighted
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

COPIED = ("config.json", "draft_vocab.json")


def parse_source(text: str) -> tuple[Path, float]:
    path, _, weight = text.rpartition(":") if ":" in text else (text, "", "1")
    return Path(path), float(weight)


def average(sources: list[tuple[Path, float]]) -> dict[str, torch.Tensor]:
    first = json.loads((sources[0][0] / "config.json").read_text())
    for path, _ in sources[1:]:
        if json.loads((path / "config.json").read_text()) != first:
            raise SystemExit(f"{path / 'config.json'} differs from {sources[0][0] / 'config.json'}: not one lineage")
    total = sum(w for _, w in sources)
    states = [(load_file(str(p / "model.safetensors")), w / total) for p, w in sources]
    names = set(states[0][0])
    for (state, _), (path, _) in zip(states, sources):
        if set(state) != names:
            raise SystemExit(f"{path / 'model.safetensors'} holds other tensors than {sources[0][0]}'s")
    return {n: sum(w * s[n].float() for s, w in states).to(states[0][0][n].dtype) for n in sorted(names)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("sources", nargs="+", help="drafter directories, each optionally DIR:WEIGHT (default 1)")
    args = ap.parse_args()
    sources = [parse_source(s) for s in args.sources]
    weights = average(sources)
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    for name in COPIED:
        if (sources[0][0] / name).is_file():
            shutil.copy(sources[0][0] / name, args.out / name)
    total = sum(w for _, w in sources)
    print(json.dumps({"out": str(args.out), "sources": [[str(p), w / total] for p, w in sources]}))


if __name__ == "__main__":
    main()
