"""Grow the shipped drafter's training data with more requests the target writes itself (issue 3).

`dflash-trt train --self-prompts N` writes its requests once and reuses them; this appends more to the shipped
data under a new sampling seed, numbered as the trainer numbers them (record ids continue after the stored
prompts): N requests per persona (Magpie, `dflash_trt/train/self_prompts.py`), the benchmark's prompts and every
stored prompt excluded, then summarization requests quoting the new qa answers, all answered greedily by the target
through this runtime (bf16, --max-new-tokens). Work is kept under --work and resumes; the training data files are
replaced atomically only at the end.

    PYTHONPATH=. .venv/bin/python benchmarks/extend_self_data.py --per-persona 500 --seed 27
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_trt.bench.datasets import load_dataset  # noqa: E402
from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir  # noqa: E402
from dflash_trt.engine.llm_engine import DTYPES, EngineConfig, LLMEngine  # noqa: E402
from dflash_trt.models.registry import load_target  # noqa: E402
from dflash_trt.train.prompts import all_prompts  # noqa: E402
from dflash_trt.train.self_prompts import (  # noqa: E402
    answer_with_summaries,
    cached_self_prompts,
    read_prompts,
    write_prompts,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-persona", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True,
                    help="Sampling seed of the requests: a new one per run (the model card names those used).")
    ap.add_argument("--data", type=Path, default=SMOLLM2_DRAFTER / "training-data")
    ap.add_argument("--work", type=Path, default=Path(".stage/self_data"))
    ap.add_argument("--rows", type=int, default=32, help="Sequences per batch.")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    stored_prompts, stored_records = args.data / "self_prompts.jsonl", args.data / "responses.jsonl.gz"
    stored = read_prompts(stored_prompts)
    base = all_prompts() + stored
    with gzip.open(stored_records, "rt") as f:
        last = max(int(json.loads(line)["id"].split(":")[0]) for line in f)
    if last >= len(base):
        sys.exit(f"{stored_records}: record id {last} names no prompt of all_prompts() + {stored_prompts} "
                 f"({len(base)}): another Python's stdlib docstrings?")

    target_dir = smollm2_dir()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = load_target(target_dir, DTYPES["bfloat16"], "cpu")
    engine = LLMEngine(target, tokenizer, None, EngineConfig(
        max_batch_size=args.rows, speculative=False, dtype="bfloat16", max_model_len=1024 + args.max_new_tokens))
    exclude = {p.text for p in load_dataset("cpu-small")} | {p.text for p in base}

    args.work.mkdir(parents=True, exist_ok=True)
    requests, answers = args.work / "requests.jsonl", args.work / "responses.jsonl"
    new = cached_self_prompts(engine, requests, args.per_persona, exclude, seed=args.seed,
                              chunk=max(128, 4 * args.rows))
    if new and new[0].text in exclude:  # generation excludes them: these are a stored run's, already appended
        sys.exit(f"{requests}: already appended to {stored_prompts}; remove {args.work} to grow the data again")
    summaries, records = answer_with_summaries(engine, tokenizer, new, answers, exclude,
                                               max_new_tokens=args.max_new_tokens, sampled_variants=0,
                                               batch_size=args.rows, first_id=len(base))
    new += summaries

    tmp = stored_records.with_suffix(".tmp")
    with gzip.open(stored_records, "rt") as fi, gzip.open(tmp, "wt") as fo:
        for line in fi:
            fo.write(line)
        for r in records:
            fo.write(json.dumps(r) + "\n")
    write_prompts(stored_prompts, stored + new)
    tmp.replace(stored_records)
    held = sum(r["split"] == "heldout" for r in records)
    print(f"appended {len(new)} requests ({len(summaries)} summaries) and {len(records)} records ({held} held out): "
          f"ids {len(base)}-{len(base) + len(new) - 1}")


if __name__ == "__main__":
    main()
