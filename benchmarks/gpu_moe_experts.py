"""One MoE layer's experts on a GPU: the routed tokens one expert at a time against two grouped GEMMs
(torch._grouped_mm, the torch runtime's default on CUDA), milliseconds a call by the step's tokens.

A decode step routes 1 token a row, a verify step K + 1: at Qwen3-Coder-30B-A3B's shapes (128 experts of 768, top 8)
a one-row verify of 16 tokens reaches most of the 128 experts, each a few small kernels when run one at a time. Random
bf16 weights at the layer's real shapes (no checkpoint: the device machine reaches no network); the routes are the
top k of random router logits. Both paths' outputs are compared (their largest difference is recorded).

    python benchmarks/gpu_moe_experts.py [--tokens 1,8,16,64,256] [--repeats 50] [--out NAME]
    python benchmarks/gpu_moe_experts.py --device cpu --smoke   # a dry run of the script itself, small shapes

Writes benchmarks/results/NAME.json (default gpu_moe_experts_<gpu>). Under a minute on an H100/H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import device_name, record, require_device  # noqa: E402
from dflash_trt.layers.experts import SiluExperts  # noqa: E402
from dflash_trt.models.gpt_oss import GptOssExperts  # noqa: E402

SHAPES = {  # hidden, one expert's intermediate, experts, top k
    "qwen3-coder-30b-a3b": (2048, 768, 128, 8),
    "gpt-oss-120b": (2880, 2880, 128, 4),  # (its MXFP4 experts as the torch runtime holds them: bf16)
}
SMOKE = {"smoke": (64, 32, 8, 2)}


def _bank(name: str, hidden: int, inter: int, experts: int, device: str, dtype: torch.dtype):
    if name.startswith("gpt-oss"):
        bank = GptOssExperts(hidden, inter, range(experts), alpha=1.702, limit=7.0)
    else:
        bank = SiluExperts(hidden, inter, range(experts), bias=False)
    bank = bank.to(dtype).to_empty(device=device)
    with torch.no_grad():
        for p in bank.parameters():
            p.normal_(0.0, 0.02)
    return bank.eval()


def _timed(fn, repeats: int, device: str) -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tokens", default="1,8,16,64,256")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    require_device(args.device, "--device cpu --smoke")
    dtype = torch.bfloat16
    rows = []
    for name, (hidden, inter, experts, top_k) in (SMOKE if args.smoke else SHAPES).items():
        bank = _bank(name, hidden, inter, experts, args.device, dtype)
        for tokens in (int(t) for t in args.tokens.split(",")):
            g = torch.Generator(device=args.device).manual_seed(tokens)
            x = torch.randn(tokens, hidden, device=args.device, dtype=dtype, generator=g)
            logits = torch.randn(tokens, experts, device=args.device, generator=g)
            top, ids = torch.topk(logits, top_k, dim=-1)
            weights = torch.softmax(top, dim=-1).to(dtype)
            row = {"shape": name, "tokens": tokens, "experts_reached": int(ids.unique().numel())}
            with torch.no_grad():
                outs = {}
                for path, grouped in (("one_at_a_time", False), ("grouped", True)):
                    bank.grouped = grouped
                    outs[path] = bank(x, ids, weights)
                    row[f"{path}_ms"] = round(_timed(lambda: bank(x, ids, weights), args.repeats, args.device), 4)
                    row[f"{path}_taken"] = bank.grouped is grouped  # False: the grouped GEMM failed and fell back
                row["max_abs_diff"] = float((outs["grouped"].float() - outs["one_at_a_time"].float()).abs().max())
            row["speedup"] = round(row["one_at_a_time_ms"] / row["grouped_ms"], 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    path = record(args.out or f"gpu_moe_experts_{device_name(args.device)}", {
        "dtype": "bfloat16", "repeats": args.repeats, "torch": torch.__version__, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
