"""Shared pieces of the benchmark scripts: machine facts, prompts, result records."""

from __future__ import annotations

import datetime as dt
import json
import platform
import subprocess
from pathlib import Path

import torch

from dflash_trt.bench.sweep import machine_info

RESULTS = Path(__file__).resolve().parent / "results"

# Real chat prompts (random token ids would give meaningless acceptance).
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning to cook.",
]


def machine() -> dict:
    return {**machine_info(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "python": platform.python_version()}


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def record(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    payload = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "commit": commit(),
               "machine": machine(), **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
