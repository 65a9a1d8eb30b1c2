"""The engine's offline throughput on the sweep's own workload, to set against a served `bench sweep` point:
the cpu-small prompts (chat template), 64 output tokens each (EOS ignored), N requests through an engine of R rows
with continuous batching (requests join and leave, prefills interleaved), no HTTP. The gap to the served figure at
concurrency R is what the serving path costs. Usage:

    .venv/bin/python benchmarks/offline_throughput.py [--rows 8] [--requests 24] [--rounds 3] [--no-spec]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

from dflash_trt import SamplingParams  # noqa: E402
from dflash_trt.bench.datasets import load_dataset  # noqa: E402
from dflash_trt.embedded import SMOLLM2_DRAFTER, smollm2_dir  # noqa: E402
from dflash_trt.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--osl", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-spec", action="store_true")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--name", default="offline_throughput_cpu")
    args = ap.parse_args()
    torch.set_num_threads(2)
    cfg = EngineConfig(dtype="bfloat16", max_batch_size=args.rows, speculative=not args.no_spec, max_draft_len=args.k)
    engine = LLMEngine.from_dirs(smollm2_dir(), None if args.no_spec else SMOLLM2_DRAFTER, cfg)
    prompts = [engine.encode(p.text, chat=True) for p in load_dataset("cpu-small", osl=args.osl)][: args.requests]
    params = SamplingParams(max_new_tokens=args.osl, ignore_eos=True)
    engine.generate(prompts[: args.rows], params)  # warm-up
    samples = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        samples.append(sum(o.num_tokens for o in outs) / (time.perf_counter() - start))
    print(f"{'AR' if args.no_spec else f'DFlash K={args.k}'}: {args.requests} requests x {args.osl} tokens, "
          f"{args.rows} rows: {statistics.median(samples):.1f} tok/s (rounds {[round(s, 1) for s in samples]})")
    path = record(args.name, {"command": " ".join(sys.argv), "rows": args.rows, "requests": args.requests,
                              "osl": args.osl, "speculative": not args.no_spec, "k": None if args.no_spec else args.k,
                              "tok_s_median": round(statistics.median(samples), 1), "tok_s": samples})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
