"""Stage what benchmarks/gpu_train_drafter.py needs on a GPU machine that has no network (issue 3).

A device call carries at most 64 MiB with the working tree, so the target's GGUF (98 MB, 90 compressed) travels
zstd-compressed in two parts, one per call (`--first-part-mb` sizes the first: the call that carries it can leave
out the tracked files the training needs only later). Writes, under --stage (default .stage/, git-ignored):
  a/gguf.zst.0, b/gguf.zst.1   the packaged SmolLM2 GGUF, compressed and cut in two
  tok/                         the CPU side's converted config.json and tokenizer files (gzipped)
  prompts.jsonl.gz             every training prompt {text, source} in the records' order (training_prompts)
  responses.jsonl.gz           the training records (drafters/smollm2-135m-dflash/training-data)
  whl/                         the gguf wheel (transformers' GGUF reader needs it; the GPU image lacks it)

    .venv/bin/python benchmarks/stage_gpu_training.py
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_trt.embedded import smollm2_dir, smollm2_gguf  # noqa: E402
from dflash_trt.train.prompts import Prompt, all_prompts  # noqa: E402
from dflash_trt.train.self_prompts import read_prompts  # noqa: E402

DATA = Path(__file__).resolve().parent.parent / "drafters/smollm2-135m-dflash/training-data"
RECORDS, SELF_PROMPTS = DATA / "responses.jsonl.gz", DATA / "self_prompts.jsonl"
TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


def training_prompts() -> list[Prompt]:
    """Every prompt the records answer, in the order their ids count: the packaged prompts, then the ones the target
    wrote itself (`train --self-prompts` appends them). The records of prompts left out were dropped by the leg's
    data growth (generate_responses keeps those it was asked for): 22,543 of 40,704."""
    return list(all_prompts()) + (read_prompts(SELF_PROMPTS) if SELF_PROMPTS.is_file() else [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", default=".stage")
    ap.add_argument("--first-part-mb", type=float, help="size of the first part (default: half)")
    args = ap.parse_args()
    stage = Path(args.stage)
    for sub in ("a", "b", "tok"):
        (stage / sub).mkdir(parents=True, exist_ok=True)
    packed = stage / "gguf.zst"
    subprocess.run(["zstd", "-q", "-f", "-19", "-T2", "--long=27", str(smollm2_gguf()), "-o", str(packed)], check=True)
    data = packed.read_bytes()
    half = len(data) // 2 if args.first_part_mb is None else int(args.first_part_mb * 1e6)
    (stage / "a" / "gguf.zst.0").write_bytes(data[:half])
    (stage / "b" / "gguf.zst.1").write_bytes(data[half:])
    packed.unlink()
    src = smollm2_dir()
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            with open(src / name, "rb") as fi, gzip.open(stage / "tok" / f"{name}.gz", "wb") as fo:
                shutil.copyfileobj(fi, fo)
    with gzip.open(stage / "prompts.jsonl.gz", "wt") as f:
        for p in training_prompts():
            f.write(json.dumps({"text": p.text, "source": p.source}) + "\n")
    shutil.copy(RECORDS, stage / "responses.jsonl.gz")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
                    "3.12", "--implementation", "cp", "--platform", "any", "-d", str(stage / "whl"),
                    f"gguf=={version('gguf')}"], check=True)
    for path in sorted(stage.rglob("*")):
        if path.is_file():
            print(f"{path.stat().st_size / 1e6:8.2f} MB  {path}")


if __name__ == "__main__":
    main()
