"""Shared pieces of the benchmark scripts: machine facts, prompts, result records."""

from __future__ import annotations

import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
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


def per_call_us(fn, calls: int = 2000, repeats: int = 5) -> float:
    """Median microseconds per call of fn over `repeats` batches of calls // repeats, after 50 warm-up calls."""
    for _ in range(50):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls // repeats):
            fn()
        samples.append((time.perf_counter() - start) / (calls // repeats) * 1e6)
    return round(statistics.median(samples), 2)


def require_device(device: str, dry_run: str) -> None:
    """Exit (status 2) where a CUDA device is asked for and there is none, saying how to dry-run the script."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"no CUDA device (use {dry_run} for a dry run)", file=sys.stderr)
        sys.exit(2)


def device_name(device: str) -> str:
    """A short name of the device a benchmark ran on, for its record's name: "cpu", or the GPU's ("NVIDIA H100 80GB
    HBM3" -> h100, "NVIDIA GH200 480GB" -> gh200)."""
    if not device.startswith("cuda"):
        return "cpu"
    words = torch.cuda.get_device_name().split()
    return next((w for w in words if w[0].isalpha() and any(ch.isdigit() for ch in w)), "gpu").lower()


def one_stream(engine, prompts: list[list[int]], params: list) -> tuple[list, float, int]:
    """Each request alone, in turn -> outputs, decode seconds and the tokens decoded in them (each answer's first
    token is the prefill's, as `bench speed` counts)."""
    outs = [engine.generate([prompt], p)[0] for prompt, p in zip(prompts, params)]
    return outs, sum(o.decode_time for o in outs), sum(max(0, o.num_tokens - 1) for o in outs)


@dataclass
class Arm:
    """One arm of a one-stream comparison, its rounds (one_stream's results) summed."""
    tokens: int = 0
    wall_s: float = 0.0
    steps: int = 0  # speculative steps
    committed: int = 0  # tokens they committed
    outputs: list[list[int]] = field(default_factory=list)  # the last round's answers

    def add(self, outs: list, wall_s: float, tokens: int) -> None:
        self.tokens += tokens
        self.wall_s += wall_s
        self.steps += sum(len(o.acceptance_lengths) for o in outs)
        self.committed += sum(sum(o.acceptance_lengths) for o in outs)
        self.outputs = [o.token_ids for o in outs]

    @property
    def tok_per_s(self) -> float:
        return round(self.tokens / self.wall_s, 1)

    @property
    def tau(self) -> float | None:
        return round(self.committed / self.steps, 3) if self.steps else None


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


def whole_runs(variants: dict, batch_sizes: tuple[int, ...], rounds: int, new_tokens: int = 96,
               new_lengths: bool = False) -> list[dict]:
    """tok/s of whole autoregressive generate() runs of an 8-row SmolLM2 engine (bf16), by variant and batch size.

    `variants` maps a name to a callable that switches the runtime to it (the caller restores the default).
    Rounds interleave the variants; every run takes other cpu-small prompts, as a server meets them (oneDNN
    caches the shapes it has seen, so repeated prompts would flatter whatever builds shapes); `new_lengths` also
    prefixes a filler of a length not used before, so that every prompt length and key count is new.
    """
    from dflash_trt import SamplingParams
    from dflash_trt.bench.datasets import load_dataset
    from dflash_trt.embedded import smollm2_dir
    from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine.from_dirs(smollm2_dir(), None, EngineConfig(dtype="bfloat16", max_batch_size=8, speculative=False))
    texts = [p.text for p in load_dataset("cpu-small")]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate([engine.encode(texts[0], chat=True)], params)  # warm-up
    samples: dict[tuple[int, str], list[float]] = {}
    run = 0
    for _ in range(rounds):
        for name, switch in variants.items():
            switch()
            for b in batch_sizes:
                run += 1
                filler = "Note " * (run * 7) if new_lengths else ""
                prompts = [engine.encode(filler + texts[(run + i) % len(texts)], chat=True) for i in range(b)]
                start = time.perf_counter()
                outs = engine.generate(prompts, params)
                samples.setdefault((b, name), []).append(sum(o.num_tokens for o in outs) / (time.perf_counter() - start))
    rows = [{"rows": b, **{f"{name}_tok_s": round(statistics.median(samples[(b, name)]), 1) for name in variants}}
            for b in batch_sizes]
    for row in rows:
        print(row, flush=True)
    return rows
