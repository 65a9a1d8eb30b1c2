"""What a new tensor shape costs on the CPU, and what bucketing shapes saves.

oneDNN builds (and caches) a primitive per matmul shape. Ops: the grouped attention's bf16 batched matmuls at a
key count not seen before against one seen before, and a prepacked bf16 linear at a row count not seen before
against a seen one; microseconds per call, median over 40 shapes. --e2e: whole generate() runs of an 8-row
engine at 1, 4 and 8 rows, each round on prompts of lengths not run before (as a server meets them), with the
runtime's buckets (keys read in multiples of attention.KEY_BUCKET, prompt chunks and long feature batches padded
to model_runner.TOKEN_BUCKET) and with both set to 1 (exact shapes); tok/s, interleaved rounds. Usage:

    .venv/bin/python benchmarks/bench_shapes.py [--threads 2] [--rounds 3] [--e2e]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, whole_runs  # noqa: E402

import dflash_trt.engine.model_runner as model_runner  # noqa: E402
import dflash_trt.layers.attention as attention  # noqa: E402
from dflash_trt.layers.linear import PackedLinear  # noqa: E402

DT = torch.bfloat16


def median_us(fn, inputs) -> float:
    times = []
    for x in inputs:
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def ops() -> list[dict]:
    q = torch.randn(8, 3, 3, 64, dtype=DT)  # 8 rows, 3 KV heads x 3 query heads each, one query

    def grouped(k: torch.Tensor) -> None:
        probs = torch.softmax(torch.matmul(q, k.transpose(-1, -2)).float(), -1).to(DT)
        torch.matmul(probs, k)

    linear = PackedLinear(torch.randn(1536, 576, dtype=DT))  # SmolLM2's MLP projection

    rows = []
    for what, fn, sizes, make in (("grouped attention, 8 rows x T keys", grouped, range(300, 340),
                                   lambda t: torch.randn(8, 3, t, 64, dtype=DT)),
                                  ("packed linear 576->1536, M rows", linear, range(40, 80),
                                   lambda m: torch.randn(m, 576, dtype=DT))):
        inputs = [make(n) for n in sizes]
        new = median_us(fn, inputs)
        seen = median_us(fn, inputs)
        rows.append({"what": what, "sizes": f"{sizes.start}..{sizes.stop - 1}", "new_shape_us": round(new, 1),
                     "seen_shape_us": round(seen, 1)})
        print(rows[-1], flush=True)
    return rows


def end_to_end(rounds: int) -> list[dict]:
    default = attention.KEY_BUCKET, model_runner.TOKEN_BUCKET

    def buckets(keys: int, tokens: int):
        return lambda: (setattr(attention, "KEY_BUCKET", keys), setattr(model_runner, "TOKEN_BUCKET", tokens))

    try:
        return whole_runs({"bucketed": buckets(*default), "exact": buckets(1, 1)}, (1, 4, 8), rounds, new_lengths=True)
    finally:
        attention.KEY_BUCKET, model_runner.TOKEN_BUCKET = default


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--e2e", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    result = {"command": " ".join(["benchmarks/bench_shapes.py", *sys.argv[1:]]), "threads": args.threads,
              "ops": ops()}
    if args.e2e:
        result["end_to_end_tok_s"] = end_to_end(args.rounds)
    print(f"recorded {record('shapes_cpu', result)}")


if __name__ == "__main__":
    main()
