"""CPU attention at the runtime's shapes (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64).

Ops: torch's SDPA, the grouped matmul on the cache views, the grouped matmul on contiguous copies; median of
interleaved rounds, microseconds per call. --e2e: whole autoregressive generate() runs of an 8-row engine with
one-query steps routed to SDPA or to the grouped matmul, each run on other prompts, tok/s by batch size (the op
timings alone misled: see attention.py's _grouped_is_faster). Usage:

    .venv/bin/python benchmarks/bench_attention.py [--threads 2] [--rounds 5] [--dtype bfloat16] [--e2e]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record, whole_runs  # noqa: E402

import dflash_trt.layers.attention as attention  # noqa: E402
from dflash_trt.layers.attention import _attend_grouped  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, MAX_LEN = 9, 3, 64, 2048
# (what, rows, queries, keys)
SHAPES = [
    ("decode", 1, 1, 300), ("decode", 4, 1, 300), ("decode", 8, 1, 300), ("decode", 8, 1, 1000),
    ("verify K=3", 1, 4, 300), ("verify K=3", 1, 4, 1000), ("verify K=3", 2, 4, 300), ("verify K=3", 8, 4, 300),
    ("verify K=7", 1, 8, 300), ("verify K=7", 1, 8, 1000), ("verify K=15", 1, 16, 300), ("verify K=15", 1, 16, 600),
    ("draft B=8", 1, 8, 300), ("draft B=8", 2, 8, 300), ("draft B=8", 8, 8, 300),
    ("prefill", 1, 64, 64), ("prefill", 1, 256, 256),
]


def time_us(fn, n: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def end_to_end(rounds: int) -> list[dict]:
    default = attention._grouped_is_faster

    def route(rule):
        return lambda: setattr(attention, "_grouped_is_faster", rule)

    variants = {"sdpa": route(lambda rows, queries: False), "grouped": route(lambda rows, queries: queries == 1),
                "default": route(default)}
    try:
        return whole_runs(variants, (1, 2, 3, 4, 8), rounds)
    finally:
        attention._grouped_is_faster = default


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--name", default="attention_cpu")
    ap.add_argument("--e2e", action="store_true", help="also time whole generate() runs under each routing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    rows = []
    for what, b, n, t in SHAPES:
        k_cache = torch.randn(b, KV_HEADS, MAX_LEN, HEAD_DIM, generator=g).to(dtype)
        v_cache = torch.randn(b, KV_HEADS, MAX_LEN, HEAD_DIM, generator=g).to(dtype)
        k, v = k_cache[:, :, :t], v_cache[:, :, :t]  # the views cache.read() returns
        q = torch.randn(b, HEADS, n, HEAD_DIM, generator=g).to(dtype)
        causal = torch.arange(t)[None, :] <= torch.arange(t - n, t)[:, None]
        mask = None if n == 1 else causal.expand(b, 1, n, t)
        variants = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True),
            "grouped_views": lambda: _attend_grouped(q, k, v, mask, 0.125),
            "grouped_contiguous": lambda: _attend_grouped(q, k.contiguous(), v.contiguous(), mask, 0.125),
        }
        samples = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                samples[name].append(time_us(fn, args.calls))
        row = {"what": what, "rows": b, "queries": n, "keys": t,
               **{f"{name}_us": round(statistics.median(s), 1) for name, s in samples.items()}}
        rows.append(row)
        print(row, flush=True)
    e2e = end_to_end(args.rounds) if args.e2e else None
    path = record(args.name, {"command": " ".join(sys.argv), "threads": args.threads, "dtype": args.dtype,
                              "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "results": rows,
                              "end_to_end_tok_s": e2e})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
