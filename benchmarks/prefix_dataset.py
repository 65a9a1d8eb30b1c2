"""A dataset file whose prompts all start with one system prompt: the built-in `cpu-small` prompts, each after
`dflash_trt.bench.datasets.shared_prefix` (about --prefix-len SmolLM2 tokens of real text) in its user message. What
`bench sweep --prefix-len` sends, as a plain JSONL file: a sweep client of an older commit (benchmarks/served_ab.sh
runs each arm's own) or another tool reads it as is.

    .venv/bin/python benchmarks/prefix_dataset.py /tmp/prefix700.jsonl [--prefix-len 700]
    DATASET=/tmp/prefix700.jsonl SYSTEMS=ours-engine CONC=1,2,4 benchmarks/served_ab.sh REV
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

from dflash_trt.bench.datasets import load_dataset, shared_prefix
from dflash_trt.embedded import smollm2_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", type=Path)
    ap.add_argument("--prefix-len", type=int, default=700)
    args = ap.parse_args()
    prefix = shared_prefix(args.prefix_len, AutoTokenizer.from_pretrained(smollm2_dir()))
    lines = [json.dumps({"id": p.id, "category": p.category, "prompt": f"{prefix}\n\n{p.text}",
                         "max_tokens": p.max_tokens}) for p in load_dataset("cpu-small")]
    args.output.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} prompts, each after a {args.prefix_len}-token prefix: {args.output}")


if __name__ == "__main__":
    main()
