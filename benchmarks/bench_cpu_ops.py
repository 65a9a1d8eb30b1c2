"""The CPU kernels (dflash_trt/kernels/cpu_ops.c) against the torch ops they replace, alone and in whole runs.

Ops: each kernel against the torch code it stands in for, at SmolLM2-135M's shapes (hidden 576, 9 / 3 heads of
64, MLP 1536), 1 and 8 rows, median microseconds per call. Linears: 120 SmolLM2 projections with distinct
weights (212 MB, streamed from memory as in a decode step, not cache-resident as a one-matrix loop would be),
oneDNN's packed linear against the kernel, at 1-32 rows. Whole runs: `offline_throughput.py` (the engine on the
sweep's prompts) with the kernels on and DFLASH_TRT_CPU_KERNELS=0, alternating, in child processes (the switch
is read once per process). Usage:

    .venv/bin/python benchmarks/bench_cpu_ops.py [--rounds 2] [--skip-whole-runs]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, per_call_us, record  # noqa: E402

from dflash_trt.kernels import cpu_ops  # noqa: E402
from dflash_trt.layers.attention import attend, round_up  # noqa: E402
from dflash_trt.layers.linear import PackedLinear  # noqa: E402
from dflash_trt.layers.rotary import apply_rotary  # noqa: E402

HERE = Path(__file__).resolve().parent


def op_timings(ops: cpu_ops.CpuOps) -> list[dict]:
    rows_out = []
    bf16 = torch.bfloat16
    for b in (1, 8):
        x, r, w = torch.randn(b, 1, 576).to(bf16), torch.randn(b, 1, 576).to(bf16), torch.randn(576).to(bf16)
        rows_out.append({"op": "rms_norm + residual add", "rows": b,
                         "torch_us": per_call_us(lambda: w * F.rms_norm(x + r, (576,), eps=1e-5)),
                         "kernel_us": per_call_us(lambda: ops.rms_norm(x, w, 1e-5, r))})
        qkv = torch.randn(b, 1, 15 * 64).to(bf16)
        cos, sin = torch.randn(b, 1, 1, 64).to(bf16), torch.randn(b, 1, 1, 64).to(bf16)
        kc, vc = torch.zeros(8, 3, 1024, 64, dtype=bf16), torch.zeros(8, 3, 1024, 64, dtype=bf16)
        rows, pos, idx = torch.arange(b), torch.full((b,), 100), torch.arange(b * 3) * 1024 + 100

        def torch_rotary_write():
            q, k, v = qkv.split((576, 192, 192), dim=-1)
            q = apply_rotary(q.view(b, 1, 9, 64).transpose(1, 2), cos, sin)
            k = apply_rotary(k.view(b, 1, 3, 64).transpose(1, 2), cos, sin)
            kc.view(-1, 64).index_copy_(0, idx, k.reshape(-1, 64))
            vc.view(-1, 64).index_copy_(0, idx, v.reshape(-1, 64))
            return q

        rows_out.append({"op": "rotary + K/V cache write", "rows": b, "torch_us": per_call_us(torch_rotary_write),
                         "kernel_us": per_call_us(lambda: ops.qkv_rotary_write(qkv, cos, sin, rows, pos, kc, vc, 9))})
        for keys in (128, 512):
            q = torch.randn(b, 9, 64).to(bf16)
            lens = torch.full((b,), keys)
            width = round_up(keys, 64)
            mask = (torch.arange(width) < keys)[None, None, None].expand(b, 1, 1, width)
            # torch's path as the runtime ran it: the grouped matmuls from 3 rows, SDPA below
            rows_out.append({"op": f"attention, {keys} keys", "rows": b,
                             "torch_us": per_call_us(lambda: attend(q[:, :, None], kc[:b, :, :width], vc[:b, :, :width],
                                                                    mask, 0.125), calls=500),
                             "kernel_us": per_call_us(lambda: ops.cached_attention(q, kc, vc, rows, lens, 0.125), calls=500)})
        gate_up = torch.randn(b, 1, 3072).to(bf16)

        def torch_silu():
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up

        rows_out.append({"op": "silu(gate) * up", "rows": b, "torch_us": per_call_us(torch_silu),
                         "kernel_us": per_call_us(lambda: ops.silu_mul(gate_up))})
    return rows_out


def linear_timings(ops: cpu_ops.CpuOps) -> list[dict]:
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30  # qkv, o, gate_up, down per layer
    weights = [(torch.randn(n, k) * 0.05).bfloat16() for n, k in shapes]
    packed = [PackedLinear(w) for w in weights]
    out = []
    for rows in (1, 4, 8, 16, 32):
        xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
        runs = {"onednn_packed": lambda: [p.forward_packed(xs[k]) for p, (_, k) in zip(packed, shapes)],
                "kernel": lambda: [ops.linear(xs[k], p.kernel_weight) for p, (_, k) in zip(packed, shapes)]}
        times = {name: [] for name in runs}
        with torch.inference_mode():
            for _ in range(3):  # interleaved
                for name, fn in runs.items():
                    fn()
                    start = time.perf_counter()
                    for _ in range(5):
                        fn()
                    times[name].append((time.perf_counter() - start) / 5 * 1e3)
        out.append({"rows": rows, **{f"{name}_ms": round(statistics.median(t), 2) for name, t in times.items()}})
    return out


def whole_runs(rounds: int) -> list[dict]:
    cases = [("--rows", "8", "--requests", "24", "--no-spec"), ("--rows", "1", "--requests", "4", "--no-spec"),
             ("--rows", "1", "--requests", "4", "-k", "3")]
    results = []
    for case in cases:
        samples = {"kernels": [], "torch ops": []}
        for _ in range(rounds):
            for label, flag in (("kernels", "1"), ("torch ops", "0")):
                name = f"_bench_cpu_ops_child_{os.getpid()}"
                env = {**os.environ, "DFLASH_TRT_CPU_KERNELS": flag}
                subprocess.run([sys.executable, str(HERE / "offline_throughput.py"), *case, "--rounds", "2",
                                "--name", name], env=env, check=True, capture_output=True)
                path = RESULTS / f"{name}.json"
                samples[label].append(json.loads(path.read_text())["tok_s_median"])
                path.unlink()
        row = {"case": " ".join(case), **{f"{k} tok/s": v for k, v in samples.items()},
               "speedup": round(statistics.median(samples["kernels"]) / statistics.median(samples["torch ops"]), 2)}
        print(row)
        results.append(row)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-whole-runs", action="store_true")
    ap.add_argument("--name", default="cpu_ops_cpu")
    args = ap.parse_args()
    torch.set_num_threads(2)
    ops = cpu_ops.load()
    if ops is None:
        sys.exit("the CPU kernels are not available here (no C compiler, or DFLASH_TRT_CPU_KERNELS=0)")
    with torch.inference_mode():
        ops_rows = op_timings(ops)
    for row in ops_rows:
        print(f"{row['op']:28s} rows {row['rows']}: torch {row['torch_us']:8.1f} us  kernel {row['kernel_us']:7.1f} us")
    linear_rows = linear_timings(ops)
    for row in linear_rows:
        print(f"120 linears, {row['rows']:2d} rows: oneDNN packed {row['onednn_packed_ms']:.2f} ms  kernel {row['kernel_ms']:.2f} ms")
    runs = [] if args.skip_whole_runs else whole_runs(args.rounds)
    path = record(args.name, {"command": " ".join(sys.argv), "ops": ops_rows, "linears_streamed": linear_rows,
                              "whole_runs": runs})
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
